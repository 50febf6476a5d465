"""The gated delta rule in torch: a prompt chunk in the chunked (parallel) form, decode tokens one recurrent step.

Legend: L tokens of one sequence, D decode requests, h value heads (keys repeated to them), dk key dim, dv value
dim. The state S [h, dk, dv] maps keys to values; per token t, with decay a_t = exp(g_t) and write strength beta_t:

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t

Within a chunk of C tokens entering with S_0, and G_t the cumulative log decay since the chunk began, unrolling
gives u = (I + A)^-1 beta (v - exp(G) K S_0) with A[t, j] = beta_t exp(G_t - G_j) k_t.k_j for j < t (a
unit-triangular solve), o = exp(G) Q S_0 + (causal exp(G_t - G_j) q_t.k_j) u, and the state leaving the chunk
exp(G_C) S_0 + (exp(G_C - G) K)^T u. Both forms compute in float32 and give the same numbers up to rounding.
A Triton kernel can replace each later; this is the reference they would be tested against.
"""

import torch

CHUNK = 64  # tokens per chunk of the parallel form: the triangular solve is C x C per head


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: q, k [L, h, dk], v [L, h, dv], g, beta [L, h] (g <= 0, log decay), state [h, dk, dv]
    entering (float32) -> (o [L, h, dv] float32, the state after the last token)."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # [h, L, d]
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [h, L]
    out = torch.empty_like(v)
    for c0 in range(0, q.shape[1], chunk):
        c1 = min(c0 + chunk, q.shape[1])
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1, None]  # [h, C, d], [h, C, 1]
        cum = g[:, c0:c1].cumsum(-1)  # [h, C]: G_t
        n = c1 - c0
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # exp(G_t - G_j) where j <= t; masked before the exp (j > t would overflow).
        decay = torch.where(causal, cum[:, :, None] - cum[:, None, :], float("-inf")).exp()  # [h, C, C]
        strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
        system = torch.eye(n, device=q.device) + bc * strict * (kc @ kc.transpose(1, 2))  # [h, C, C] I + A
        rhs = bc * (vc - cum.exp()[..., None] * (kc @ state))  # [h, C, dv]
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [h, C, dv]
        out[:, c0:c1] = cum.exp()[..., None] * (qc @ state) + (decay * (qc @ kc.transpose(1, 2))) @ u
        last = cum[:, -1:]  # [h, 1]: G_C
        state = last.exp()[..., None] * state + ((last - cum).exp()[..., None] * kc).transpose(1, 2) @ u
    return out.transpose(0, 1), state


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of D requests: q, k [D, h, dk], v [D, h, dv], g, beta [D, h], state [D, h, dk, dv]
    (float32) -> (o [D, h, dv] float32, the states after the token)."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    state = g.exp()[..., None, None] * state  # [D, h, dk, dv]
    u = beta[..., None] * (v - (state * k[..., None]).sum(-2))  # [D, h, dv]
    state = state + k[..., None] * u[..., None, :]
    return (state * q[..., None]).sum(-2), state
