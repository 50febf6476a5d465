"""The Kimi delta rule (KDA) in torch: the gated delta rule with a decay per key channel instead of per head.

Legend: L tokens of one sequence, D decode requests, h heads, dk key dim, dv value dim. The state S [h, dk, dv]
maps keys to values; per token t, with the decay of each key channel a_t = exp(g_t) [dk] and write strength beta_t:

    S_t = diag(a_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - (diag(a_t) S_{t-1})^T k_t),   o_t = S_t^T q_t

``engine.layers.delta_rule`` is the case where every channel of a head decays alike. Within a chunk of C tokens
entering with S_0, and G_t [dk] the cumulative log decay since the chunk began, unrolling gives
u = (I + A)^-1 beta (v - (exp(G) * K) S_0) with A[t, j] = beta_t sum_c k_t[c] exp(G_t[c] - G_j[c]) k_j[c] for j < t
(a unit-triangular solve), o = (exp(G) * Q) S_0 + (causal sum_c q_t[c] exp(G_t[c] - G_j[c]) k_j[c]) u, and the
state leaving the chunk diag(exp(G_C)) S_0 + (exp(G_C - G) * K)^T u. The pairwise decays exp(G_t - G_j) are taken
per channel from differences (j <= t, so each is at most 1: nothing overflows, whatever the chunk's decay), which
costs [h, C, C, dk] values a chunk: chunks are shorter than the per-head rule's. Both forms compute in float32.
"""

import torch

CHUNK = 32  # tokens per chunk of the parallel form: [h, C, C, dk] pairwise decays per chunk


def chunked_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: q, k, g [L, h, dk] (g <= 0, log decay per channel), v [L, h, dv], beta [L, h], state
    [h, dk, dv] entering (float32) -> (o [L, h, dv] float32, the state after the last token)."""
    q, k, v, g = (t.float().transpose(0, 1) for t in (q, k, v, g))  # [h, L, d]
    beta = beta.float().transpose(0, 1)  # [h, L]
    state = state.float()
    out = torch.empty_like(v)
    for c0 in range(0, q.shape[1], chunk):
        c1 = min(c0 + chunk, q.shape[1])
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1, None]  # [h, C, d], [h, C, 1]
        cum = g[:, c0:c1].cumsum(1)  # [h, C, dk]: G_t
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[:, :, None]  # [C, C, 1]
        # exp(G_t - G_j) per channel where j <= t; masked before the exp (j > t would overflow).
        decay = torch.where(causal, cum[:, :, None, :] - cum[:, None, :, :], float("-inf")).exp()  # [h, C, C, dk]
        kk = torch.einsum("htc,hjc,htjc->htj", kc, kc, decay)  # [h, C, C]
        strict = kk.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1), 0.0)
        system = torch.eye(n, device=q.device) + bc * strict  # [h, C, C]: I + A
        rhs = bc * (vc - (cum.exp() * kc) @ state)  # [h, C, dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [h, C, dv]
        qk = torch.einsum("htc,hjc,htjc->htj", qc, kc, decay)  # [h, C, C], zero above the diagonal
        out[:, c0:c1] = (cum.exp() * qc) @ state + qk @ u
        last = cum[:, -1:]  # [h, 1, dk]: G_C
        state = last.transpose(1, 2).exp() * state + ((last - cum).exp() * kc).transpose(1, 2) @ u
    return out.transpose(0, 1), state


def recurrent_kda_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of D requests: q, k, g [D, h, dk], v [D, h, dv], beta [D, h], state [D, h, dk, dv]
    (float32) -> (o [D, h, dv] float32, the states after the token)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state = g.exp()[..., None] * state  # [D, h, dk, dv]: each key channel's row decays by its own gate
    u = beta[..., None] * (v - (state * k[..., None]).sum(-2))  # [D, h, dv]
    state = state + k[..., None] * u[..., None, :]
    return (state * q[..., None]).sum(-2), state
