"""The default budget of layer-chunked image encoding: how much vision-tower work one step runs when the operator
sets none (``EngineConfig.max_num_encoder_token_blocks`` left unset).

A step's prompt chunk is bounded by ``max_num_batched_tokens`` (a decode engine's own prefills by
``decode_prefill_chunk_tokens``: ``engine.ranks.rank_builder.encoder_token_blocks`` passes the chunk), so a long
prompt lengthens the running streams' steps by one chunk at most; the tower is bounded the same way, by what it
costs against the text model. The cost of one token through the text layers and of one token-block (one patch through one tower block) are counted
in the multiply-adds of their weights, the routed experts at the share a token visits (``top_k`` of the
experts); embeddings and the LM head are left out (a prompt chunk reads the head for its last token only). The
budget is the token-blocks worth ``TOWER_SHARE`` of a full chunk: a tower's operations run at a lower efficiency
per multiply-add than the text model's (narrow matrices), and a step that encodes may also carry a prompt chunk, so
a whole chunk's worth would about double that step. Measured with ``benchmarks.image_itl``:
``docs/decisions/encoder-budget.md``.

The tower's attention is not in its weights: each patch's query meets every key of its image, so a block costs a
patch ``2 * attention_width`` multiply-adds per patch of the image on top of its weights' (scores, then the
weighted values). ``attention_per_patch`` gives that as a share of a token-block, and the scheduler charges a
block's token-block over an image of ``p`` patches ``1 + p * attention_per_patch``, the attention all on the pass
that mixes the row, where it runs (``engine.core.encoder_pieces``): on Qwen3-VL's tower (width 1,152) a 448x448 image's attention adds ~12% to its
blocks, a 1,920x1,080 photo's ~120%, which a budget of weights alone would let run in one step.


This is rank 0's view (it holds the tower and plans the steps): under tensor parallelism its share of the text
layers, which is what a step waits for on it.
"""

from torch import nn

from engine.layers.moe import SparseMoeBlock

# The share of a full prompt chunk's text-model work that a step's tower work may cost by default.
TOWER_SHARE = 0.25


def matrix_multiply_adds(module: nn.Module) -> int:
    """Multiply-adds per row through ``module``'s weight matrices (every parameter of two or more dimensions,
    once), counting its routed experts (``SparseMoeBlock.experts``) at ``top_k / num_experts`` of their size by
    their logical shape (4- and 8-bit layouts pack only the last dimension)."""
    experts = {id(m.experts): m for m in module.modules() if isinstance(m, SparseMoeBlock)}
    total = 0.0
    for sub in module.modules():
        if id(sub) in experts:
            block = experts[id(sub)]
            local, inner2, _ = sub.w13.shape  # [E_local, 2I, H or packed]
            hidden = sub.w2.shape[1]  # [E_local, H, I or packed]
            total += local * 3 * (inner2 // 2) * hidden * block.top_k / block.gate.out_features
            continue
        total += sum(p.numel() for p in sub.parameters(recurse=False) if p.dim() >= 2)
    return int(total)


def auto_token_blocks(text_layers: nn.Module, tower_block: nn.Module, chunk_tokens: int) -> int:
    """Token-blocks a step's tower work may take by default: ``TOWER_SHARE`` of a chunk of ``chunk_tokens`` prompt
    tokens (the longest a step takes) through ``text_layers`` (the rank's decoder layers), in multiply-adds of
    ``tower_block`` (one block of the tower: every block and the patch embedding count as one), at least 1."""
    per_token = matrix_multiply_adds(text_layers)
    per_block = max(matrix_multiply_adds(tower_block), 1)
    return max(1, round(TOWER_SHARE * chunk_tokens * per_token / per_block))


def attention_per_patch(tower_block: nn.Module) -> float:
    """Multiply-adds of one patch's attention in ``tower_block`` per patch of its image (``2 * attention_width``:
    scores, then weighted values), as a share of the block's weight multiply-adds per patch (a token-block)."""
    return 2 * tower_block.attention_width / max(matrix_multiply_adds(tower_block), 1)
