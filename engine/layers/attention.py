"""Self-attention block over the paged KV cache: packed qkv projection, optional q/k norms, RoPE."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.collectives import SINGLE, TensorParallel
from engine.device_batch.attention_metadata import AttentionMetadata, TritonAttentionMetadata
from engine.layers.cache_spec import CacheSpec
from engine.lora.slots import AttentionLora
from engine.layers.norms import RMSNorm
from engine.layers.paged_attention import paged_attention, write_kv
from engine.layers.rotary import RotaryEmbedding
from engine.kernels.elementwise import rope_inplace
from engine.kernels.attention import triton_paged_attention


class Attention(nn.Module):
    """Legend: T tokens, H hidden, h query heads, kvh KV heads, d head dim (h and kvh: this rank's).

    ``qk_norm``: "none"; "per_head" (Qwen3: RMSNorm over d of each head);
    "full" (OLMoE, MiniMax-M2: RMSNorm over all heads' projections before the split).
    ``o_bias``: o_proj has a bias (dots.llm1 with ``attention_bias``, gpt-oss); under tensor parallelism every
    rank holds it and only rank 0 adds it (``output``), so the all-reduce adds it once.

    Tensor parallel (``tp``): each rank holds ``num_heads / tp.size`` query heads and
    ``num_kv_heads / tp.size`` KV heads (one replicated KV head where there are fewer KV
    heads than ranks); ``qkv_proj`` is column-parallel, ``o_proj`` row-parallel, and the
    block's output is summed over the ranks (one all-reduce); an ``o_bias`` is added on rank 0 only.

    gpt-oss: ``sinks`` adds a learned sink logit per query head to every softmax (split with the heads),
    ``sliding_window`` gives this layer its own window (``ModelConfig.own_window``; None: the batch's).

    MiMo-V2-Flash: ``v_head_dim`` (dv) narrower than the q/k heads' d, and ``v_scale`` multiplying the values.
    The cache keeps V padded with zeros to d, so every attention kernel reads K and V of one width; the
    padded columns of the output are zeros and are dropped before o_proj (which reads h * dv).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        rms_norm_eps: float,
        qkv_bias: bool = False,
        qk_norm: str = "none",
        clip_qkv: float | None = None,
        o_bias: bool = False,
        tp: TensorParallel = SINGLE,
        sinks: bool = False,
        sliding_window: int | None = None,
        v_head_dim: int | None = None,
        v_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        num_heads = tp.shard(num_heads, "the number of attention heads")[1]
        if num_kv_heads >= tp.size:
            num_kv_heads = tp.shard(num_kv_heads, "the number of KV heads")[1]
        elif tp.size % num_kv_heads:
            raise ValueError(f"the tensor-parallel size ({tp.size}) must be a multiple of the number of KV heads "
                             f"({num_kv_heads}) when it exceeds it")
        else:
            num_kv_heads = 1  # replicated: rank r holds KV head r * kvh // tp
            if qk_norm == "full":
                raise ValueError("a whole-projection q/k norm needs at least one KV head per tensor-parallel rank")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.v_head_dim = v_head_dim or head_dim  # dv
        if self.v_head_dim > head_dim:
            raise ValueError(f"v_head_dim {self.v_head_dim} wider than head_dim {head_dim} is not supported")
        self.v_scale = v_scale
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.v_size = num_kv_heads * self.v_head_dim
        # Packed q, k, v rows: one matmul instead of three (loaded from q_proj/k_proj/v_proj).
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + self.kv_size + self.v_size, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * self.v_head_dim, hidden_size, bias=o_bias)
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None  # [h] this rank's heads
        self.sliding_window = sliding_window
        self.rotary = rotary
        self.qk_norm = qk_norm
        self.clip_qkv = clip_qkv
        if qk_norm == "per_head":
            self.q_norm = RMSNorm(head_dim, rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        elif qk_norm == "full":  # over every rank's heads: the weights are whole, the input gathered
            self.q_norm = RMSNorm(self.q_size * tp.size, rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size * tp.size, rms_norm_eps)
        else:
            assert qk_norm == "none", qk_norm
        self.scale = head_dim**-0.5
        # Set by engine.transforms.fusion: q/k norms and RoPE in one Triton pass over the packed projection.
        self.fused_rope = False
        # LoRA slot tables of qkv_proj and o_proj, and the step's adapter layout (engine.worker.lora_setup);
        # None: no adapters served.
        self.lora: AttentionLora | None = None
        # [N_blocks, block_size, kvh, d] each; bound by the runner once the pool is allocated.
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] = (torch.empty(0), torch.empty(0))

    def cache_spec(self) -> CacheSpec:
        """K and V of this rank's KV heads per token (V padded to d, see the class docstring)."""
        return CacheSpec(((self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)))

    def project_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shapes of what ``project`` returns (q, k, v); ``attend_shape``: of what ``attend`` returns."""
        return (self.num_heads, self.head_dim), (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def attend_shape(self) -> tuple[int, ...]:
        return self.num_heads, self.head_dim

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata | TritonAttentionMetadata) -> torch.Tensor:
        return self.output(self.attend(*self.project(x, positions), meta))  # [T, H]

    # The three parts below are what piecewise CUDA graphs (engine.transforms.piecewise_graphs) split the
    # forward at: ``project`` and ``output`` are fixed-shape per token and captured; ``attend`` reads
    # per-step metadata and runs eagerly between the captured pieces.
    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, H] -> q [T, h, d], k and v [T, kvh, d]: the packed projection, q/k norms and RoPE."""
        qkv = self.qkv_proj(x)  # [T, q + 2kv]
        if self.lora is not None and self.lora.step.batch is not None:
            qkv = self.lora.qkv.add_delta(x, qkv, self.lora.step.batch)  # each token's adapter's delta
        if self.fused_rope and self.qk_norm != "full" and self.clip_qkv is None:
            return self._fused_norm_rope(qkv, positions)
        return self._norm_rope(qkv, positions)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata | TritonAttentionMetadata) -> torch.Tensor:
        """The attention core: writes k, v into the paged cache at ``meta.slot_mapping``, returns [T, h, d]."""
        k_cache, v_cache = self.kv_cache
        # A layer with its own window reads (and writes) its cache group's tables and masks.
        meta = meta.for_window(self.sliding_window is not None)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        # The metadata's type is the backend the runner chose (``KernelChoice.attention``).
        if isinstance(meta, TritonAttentionMetadata):
            return triton_paged_attention(q, k_cache, v_cache, meta, self.scale, sinks=self.sinks,
                                          sliding_window=self.sliding_window)
        return paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.sinks)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, h, d] (or [T, h * d]) -> [T, H]: o_proj, summed over the tensor-parallel ranks."""
        if self.v_head_dim != self.head_dim:  # the zero padding of V's columns: [T, h, d] -> [T, h, dv]
            out = out.reshape(out.shape[0], self.num_heads, self.head_dim)[..., :self.v_head_dim]
        flat = out.reshape(out.shape[0], self.num_heads * self.v_head_dim)
        if self.o_proj.bias is not None and self.tp.rank > 0:
            out = F.linear(flat, self.o_proj.weight)  # summed over the ranks: rank 0 adds the bias
        else:
            out = self.o_proj(flat)  # [T, H]
        if self.lora is not None and self.lora.step.batch is not None:
            out = self.lora.o.add_delta(flat, out, self.lora.step.batch)
        return self.tp.all_reduce(out)

    def _fused_norm_rope(self, qkv: torch.Tensor, positions: torch.Tensor):
        # q heads then k heads are adjacent columns of qkv: one launch rotates (and normalizes) both, in place.
        per_head = self.qk_norm == "per_head"
        rope_inplace(
            qkv, self.num_heads + self.num_kv_heads, self.num_heads, positions, self.rotary.cos_cache,
            self.rotary.sin_cache, self.head_dim, self.q_norm.weight if per_head else None,
            self.k_norm.weight if per_head else None, self.q_norm.eps if per_head else 0.0,
        )
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.v_size], dim=-1)
        return (q.reshape(num_tokens, self.num_heads, self.head_dim), k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
                self._values(v))

    def _norm_rope(self, qkv: torch.Tensor, positions: torch.Tensor):
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.v_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self._full_norm(q, self.q_norm), self._full_norm(k, self.k_norm)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [T, h, d]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kvh, d]
        v = self._values(v)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return q, k, v

    def _values(self, v: torch.Tensor) -> torch.Tensor:
        """v [T, kvh * dv] -> [T, kvh, d]: scaled, zero-padded from dv to d where narrower."""
        v = v.reshape(v.shape[0], self.num_kv_heads, self.v_head_dim)
        if self.v_scale != 1.0:
            v = v * self.v_scale
        if self.v_head_dim != self.head_dim:
            v = F.pad(v, (0, self.head_dim - self.v_head_dim))
        return v

    def _full_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``norm`` over every rank's heads of ``x`` [T, local width]; returns this rank's columns."""
        if self.tp.size == 1:
            return norm(x)
        width = x.shape[-1]
        whole = norm(self.tp.all_gather(x, dim=-1))  # [T, tp * width]
        return whole[:, self.tp.rank * width:(self.tp.rank + 1) * width]
