"""Triton kernels of the gated delta rule, per head (Gated DeltaNet) or per key channel (KDA): one recurrent step
per decode request, and the chunked form over each prompt chunk. Imported lazily by ``engine.kernels.delta_rule``.

Legend: h heads, dk key dim, dv value dim; BK >= dk and BV tile the key and value dims, BT tokens a chunk. Every
program owns one request's head and BV of its value columns: the state tile [BK, BV] stays in registers from the
request's slot to its last token and is written back to the same slot, so requests never share a tile.
The math is ``engine.layers.delta_rule`` / ``engine.layers.kda_rule`` (the docstrings there derive it), in float32
whatever the inputs' dtype; the chunked form's matrix products at ``PRECISION`` (``tl.dot``'s input precision).
"""

import triton
import triton.language as tl


@triton.jit
def _row(x, rows, i):
    """Row i of a [BT, N] register tile as [N] (registers cannot be indexed by a runtime value)."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)


@triton.jit
def delta_rule_decode_kernel(
    q, k, v, g, beta, out, state, slots, fresh,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Grid (D, h, cdiv(dv, BV)). One token of decode request d: q, k [D, h / GROUP, dk] (same strides; value head
    j reads key head j // GROUP), v [D, h, dv],
    g [D, h] or [D, h, dk] (PER_CHANNEL) log decays, beta [D, h]; out [D, h, dv] float32; state [S, h, dk, dv]
    float32 read and written at slots[d], read as zero where fresh[d]."""
    d = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ck = tl.arange(0, BK)
    cv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk, mv = ck < DK, cv < DV
    slot = tl.load(slots + d).to(tl.int64)
    s_ptr = state + slot * stride_ss + head * stride_sh + ck[:, None] * stride_sk + cv[None, :]
    s = tl.load(s_ptr, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)  # [BK, BV]
    s = tl.where(tl.load(fresh + d) != 0, 0.0, s)  # a reused slot may hold anything, NaN included
    qk_off = d * stride_qt + (head // GROUP) * stride_qh + ck
    qv = tl.load(q + qk_off, mask=mk, other=0.0).to(tl.float32)  # [BK]
    kv = tl.load(k + qk_off, mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v + d * stride_vt + head * stride_vh + cv, mask=mv, other=0.0).to(tl.float32)  # [BV]
    b = tl.load(beta + d * stride_bt + head).to(tl.float32)
    if PER_CHANNEL:
        gv = tl.load(g + d * stride_gt + head * stride_gh + ck, mask=mk, other=0.0).to(tl.float32)  # [BK]
        s = s * tl.exp(gv)[:, None]
    else:
        s = s * tl.exp(tl.load(g + d * stride_gt + head * stride_gh).to(tl.float32))
    u = b * (vv - tl.sum(s * kv[:, None], 0))  # [BV]
    s = s + kv[:, None] * u[None, :]
    o = tl.sum(s * qv[:, None], 0)  # [BV]
    tl.store(out + d * stride_ot + head * stride_oh + cv, o, mask=mv)
    tl.store(s_ptr, s, mask=mk[:, None] & mv[None, :])


@triton.jit
def delta_rule_chunk_kernel(
    q, k, v, g, beta, out, state, chunks,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_ot, stride_oh,
    stride_ss, stride_sh, stride_sk,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid (P, h, cdiv(dv, BV)). Prompt chunk p's flat rows [row, end) from its slot's state (zero if fresh), BT
    tokens at a time in the chunked form: ``chunks`` [P, 4] int64 (row, end, slot, fresh); the other tensors as the
    decode kernel's, with T flat rows."""
    p = tl.program_id(0)
    head = tl.program_id(1)
    row0 = tl.load(chunks + p * 4)
    end = tl.load(chunks + p * 4 + 1)
    slot = tl.load(chunks + p * 4 + 2)
    ck = tl.arange(0, BK)
    cv = tl.program_id(2) * BV + tl.arange(0, BV)
    rt = tl.arange(0, BT)
    mk, mv = ck < DK, cv < DV
    s_ptr = state + slot * stride_ss + head * stride_sh + ck[:, None] * stride_sk + cv[None, :]
    s = tl.load(s_ptr, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)  # [BK, BV]
    s = tl.where(tl.load(chunks + p * 4 + 3) != 0, 0.0, s)
    causal = rt[:, None] >= rt[None, :]  # [BT, BT]: token t sees j <= t
    for c0 in range(row0, end, BT):
        rows = c0 + rt
        mt = rows < end
        n = tl.minimum(end - c0, BT)  # tokens in this block: the loops below skip the padded rows
        # Rows past the chunk's end load as zero (k, v, beta, g): they add nothing and decay nothing.
        qk_off = rows[:, None].to(tl.int64) * stride_qt + (head // GROUP) * stride_qh + ck[None, :]
        Q = tl.load(q + qk_off, mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [BT, BK]
        K = tl.load(k + qk_off, mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)
        V = tl.load(v + rows[:, None].to(tl.int64) * stride_vt + head * stride_vh + cv[None, :],
                    mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        b = tl.load(beta + rows.to(tl.int64) * stride_bt + head, mask=mt, other=0.0).to(tl.float32)  # [BT]
        if PER_CHANNEL:
            graw = tl.load(g + rows[:, None].to(tl.int64) * stride_gt + head * stride_gh + ck[None, :],
                           mask=mt[:, None] & mk[None, :], other=0.0).to(tl.float32)  # [BT, BK]
            G = tl.cumsum(graw, 0)  # [BT, BK]: G_t per channel
            last = tl.sum(graw, 0)  # [BK]: G at the chunk's last token (padded rows add 0)
            # The pairwise decays exp(G_t - G_j) per channel, one column j at a time ([BT, BK] each, not
            # [BT, BT, BK]); differences under the mask, so each is at most 1.
            A = tl.zeros([BT, BT], dtype=tl.float32)
            QK = tl.zeros([BT, BT], dtype=tl.float32)
            for j in range(0, n):
                kj = _row(K, rt, j)  # [BK]
                gj = _row(G, rt, j)
                kd = tl.exp(tl.where(rt[:, None] >= j, G - gj[None, :], float("-inf"))) * kj[None, :]  # [BT, BK]
                A = tl.where(rt[None, :] == j, tl.sum(K * kd, 1)[:, None], A)
                QK = tl.where(rt[None, :] == j, tl.sum(Q * kd, 1)[:, None], QK)
            A = tl.where(rt[:, None] > rt[None, :], A * b[:, None], 0.0)  # strictly below the diagonal
            eG = tl.exp(G)
            rhs = b[:, None] * (V - tl.dot(eG * K, s, input_precision=PRECISION))  # [BT, BV]
            o = tl.dot(eG * Q, s, input_precision=PRECISION)
            s_decay = tl.exp(last)[:, None]  # [BK, 1]
            k_tail = tl.exp(last[None, :] - G) * K  # [BT, BK]: exp(G_C - G_t) k_t
        else:
            graw = tl.load(g + rows.to(tl.int64) * stride_gt + head * stride_gh, mask=mt, other=0.0).to(tl.float32)
            G = tl.cumsum(graw, 0)  # [BT]
            last = tl.sum(graw, 0)
            decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))  # [BT, BT]
            KK = tl.dot(K, tl.trans(K), input_precision=PRECISION)
            A = tl.where(rt[:, None] > rt[None, :], b[:, None] * decay * KK, 0.0)
            QK = decay * tl.dot(Q, tl.trans(K), input_precision=PRECISION)
            eG = tl.exp(G)[:, None]
            rhs = b[:, None] * (V - eG * tl.dot(K, s, input_precision=PRECISION))
            o = eG * tl.dot(Q, s, input_precision=PRECISION)
            s_decay = tl.exp(last)
            k_tail = tl.exp(last - G)[:, None] * K
        # u = (I + A)^-1 rhs by forward substitution: row i needs rows j < i, already final.
        u = rhs
        for i in range(1, n):
            ui = _row(u, rt, i) - tl.sum(_row(A, rt, i)[:, None] * u, 0)  # [BV]
            u = tl.where(rt[:, None] == i, ui[None, :], u)
        o += tl.dot(QK, u, input_precision=PRECISION)
        tl.store(out + rows[:, None].to(tl.int64) * stride_ot + head * stride_oh + cv[None, :], o,
                 mask=mt[:, None] & mv[None, :])
        s = s_decay * s + tl.dot(tl.trans(k_tail), u, input_precision=PRECISION)
    tl.store(s_ptr, s, mask=mk[:, None] & mv[None, :])
