"""Chunked gated delta rule (GDN prefill) as a Pallas TPU kernel, for packed ragged batches, beside its reference.

Layouts (packed: several prompts back to back, no padding between them; sequence s owns tokens
cu_seqlens[s] : cu_seqlens[s+1]):
  q, k     [T, Hk, Dk]     v  [T, Hv, Dv]     g, beta  [T, Hv]     cu_seqlens [N + 1] int32
  initial_state, final_state  [N, Hv, Dk, Dv] float32
Value head h reads key head h // (Hv / Hk), so grouped heads need no repeat-interleave in HBM. `g` is the log-decay
(≤ 0), `beta` ∈ (0, 1) the write strength, `scale` defaults to Dk^-½, exactly as in `delta_rule`.

The kernel (per value head h, a flat work list of (sequence, chunk) items, in order):
  grid (Hv, W): W = ceil(T / C) + N is a static bound on Σ_s max(1, ceil(len_s / C)); the work list
  (sequence and chunk of each item) is scalar-prefetched into SMEM, items past the end do nothing.
  Each item DMAs its C tokens of q, k, v, g, beta for head h out of HBM at a dynamic token offset (any alignment:
  that is what lets ragged prompts sit back to back), masks the rows past the sequence's end (g = 0, beta = 0: no
  decay, no write), does the chunk's work as (C×C)/(C×D) matmuls, and carries the fp32 state S [Dk, Dv] in VMEM
  scratch to the next chunk. The first chunk of a sequence loads its initial state; every item leaves S in the
  final-state block of its sequence, which Pallas writes back when the sequence changes.

Per chunk (positions i, j; G the cumulative log-decay inside the chunk; as `delta_rule.chunk_gated_delta_rule`):
  A_ij = β_i (k_i·k_j) exp(G_i − G_j), j < i;   M⁻¹ = (I + A)⁻¹ by the Neumann product (I−A)(I+A²)(I+A⁴)…
  U = M⁻¹(β ⊙ V);  W = M⁻¹(β ⊙ exp(G) ⊙ K);  V' = U − W S
  O = (Q ⊙ exp(G)) S + [(Q Kᵀ) ⊙ exp(G_i − G_j)]_{j ≤ i} V';   S ← exp(G_C) S + (K ⊙ exp(G_C − G))ᵀ V'

The last chunk of a sequence writes C output rows, some past its end; they land on the next sequence's rows (or on
the C-row apron the wrapper adds after the last token) and are overwritten when that sequence is processed, which
the sequential order over the work list guarantees. Heads are independent ("parallel": the two TensorCores of a
megacore chip split them); the work list is "arbitrary" (sequential).

Napkin math per (item, head), C = 64, Dk = Dv = 128, bf16 q/k/v/o: reads C·(2·Dk + Dv)·2 + C·2·4 B ≈ 50 KB,
writes C·Dv·2 B = 16 KB; executes 2·(3·C²·Dk + C²·Dv + 10·C³ + 3·C·Dk·Dv) ≈ 16 MFLOP (the 10·C³ is the explicit
inverse; the algorithm's useful work is ≈ 9 MFLOP). Intensity ≈ 240 FLOP/B: about a v5e's ridge point (241), below a
v6e's (560); a bigger C raises it, mostly with work that is not useful. VMEM: one chunk's inputs and output
(~70 KB), the C×C intermediates (a few × 16 KB) and S (64 KB): far below any VMEM budget.
Not done here (a TPU follow-up): prefetching the next item's DMAs while this one computes (double buffering).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35.kernels.delta_rule import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule
from qwen35.kernels.interpret import default_interpret

__all__ = [
    "default_interpret",
    "check_packed_inputs",
    "chunked_gdn_reference",
    "chunked_gdn_packed",
    "chunk_gated_delta_rule_pallas",
    "chunked_gdn_conv_packed",
    "chunked_gdn_conv_reference",
]


def check_packed_inputs(q, k, v, g, beta, cu_seqlens, initial_state=None) -> None:
    """Shape checks for the packed layout; errors name the tensor and the expected shape."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be packed [T, H, D] (sequences back to back), got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    T, Hk, Dk = q.shape
    Tv, Hv, Dv = v.shape
    if Tv != T:
        raise ValueError(f"v has {Tv} tokens but q has {T}")
    if Hv % Hk:
        raise ValueError(f"{Hv} value heads are not a multiple of {Hk} key heads (value head h reads key head "
                         f"h // (Hv / Hk))")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (T, Hv):
            raise ValueError(f"{name} must be [T, Hv] = {(T, Hv)}, got {tuple(x.shape)}")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1 (cumulative lengths starting at 0), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"cu_seqlens must be integer, got {cu_seqlens.dtype}")
    N = cu_seqlens.shape[0] - 1
    if not isinstance(cu_seqlens, jax.core.Tracer):  # concrete: check the values too
        cu = np.asarray(cu_seqlens)
        if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) < 0):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={T} (the packed token "
                             f"count); got {cu.tolist()}")
    if initial_state is not None and tuple(initial_state.shape) != (N, Hv, Dk, Dv):
        raise ValueError(f"initial_state must be [N, Hv, Dk, Dv] = {(N, Hv, Dk, Dv)}, got "
                         f"{tuple(initial_state.shape)}")


_chunk_rule_jit = jax.jit(chunk_gated_delta_rule, static_argnames=("chunk_size", "scale", "use_qk_l2norm"))


def chunked_gdn_reference(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale=None, use_qk_l2norm=False,
                          chunk_size=64):
    """Pure-JAX reference for the packed layout, the way an XLA path handles ragged prompts: scatter them into a
    zero-padded [N, max_len] batch (padding has g = 0 and beta = 0: no decay, no write, so each final state is the
    state after the prompt's last real token), repeat the key heads, run `delta_rule.chunk_gated_delta_rule` once,
    gather the real tokens back. cu_seqlens must be concrete (a list or numpy array).
    Returns (o [T, Hv, Dv] in q's dtype, final_state [N, Hv, Dk, Dv] float32)."""
    check_packed_inputs(q, k, v, g, beta, jnp.asarray(cu_seqlens), initial_state)
    cu = np.asarray(cu_seqlens, np.int64)
    lens = np.diff(cu)
    N, L = len(lens), max(1, int(lens.max()))
    rep = v.shape[1] // q.shape[1]
    t = cu[:-1, None] + np.arange(L)[None]  # [N, L] token index of each padded slot
    real = np.arange(L)[None] < lens[:, None]
    idx = jnp.asarray(np.where(real, t, 0))
    m = jnp.asarray(real)

    def pad(x):  # [T, ...] -> [N, L, ...], zeros in the padding
        return jnp.where(m.reshape(N, L, *([1] * (x.ndim - 1))), x[idx], 0).astype(x.dtype)

    n_idx, l_idx = (jnp.asarray(i) for i in np.nonzero(real))  # the real tokens, in packed order

    @jax.jit
    def run(q, k, v, g, beta, initial_state):
        qp, kp = (jnp.repeat(pad(x), rep, axis=2) for x in (q, k))
        o, S = chunk_gated_delta_rule(qp, kp, pad(v), pad(g), pad(beta), chunk_size=chunk_size,
                                      initial_state=initial_state, scale=scale, use_qk_l2norm=use_qk_l2norm)
        return o[n_idx, l_idx], S

    return run(q, k, v, g, beta, initial_state)


def _work_list(cu_seqlens, C: int, W: int):
    """The flat (sequence, chunk) work list: sequence s gets max(1, ceil(len_s / C)) items (an empty sequence one,
    to pass its initial state through). Items past the end get chunk -1 (skip) and repeat the last sequence, so
    the final-state block is not switched. Works on traced cu_seqlens."""
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    n_items = jnp.maximum(1, (lens + C - 1) // C)
    ends = jnp.cumsum(n_items)
    starts = ends - n_items
    w = jnp.arange(W, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), lens.shape[0] - 1).astype(jnp.int32)
    chunk = jnp.where(w < ends[-1], w - starts[seq], -1).astype(jnp.int32)
    return seq, chunk


def _neumann_inverse(A, C: int):
    """(I + A)⁻¹ for strictly lower triangular A [C, C]: with L = -A nilpotent, (I - L)⁻¹ = (I + L)(I + L²)(I + L⁴)…
    — log2(C) squarings and products, matmuls only (no triangular solve on the MXU)."""
    eye = (jax.lax.broadcasted_iota(jnp.int32, (C, C), 0) == jax.lax.broadcasted_iota(jnp.int32, (C, C), 1))
    L = -A
    P = eye.astype(jnp.float32) + L
    p = 2
    while p < C:
        L = jnp.dot(L, L, preferred_element_type=jnp.float32)
        P = P + jnp.dot(P, L, preferred_element_type=jnp.float32)
        p *= 2
    return P


def _nt(a, b):  # a @ bᵀ without materialising the transpose
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _chunk_step(q, k, v, g, beta, S, n_valid, *, C: int, scale: float, use_qk_l2norm: bool):
    """One chunk of the rule for one head: q, k [C, Dk], v [C, Dv], g, beta [C, 1] (rows from n_valid on are past
    the sequence's end and are zeroed: no decay, no write), S [Dk, Dv] float32 -> (o [C, Dv], S after the chunk),
    both float32."""
    row = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    valid = row < n_valid  # [C, 1]
    q, k, v, g, beta = (jnp.where(valid, x.astype(jnp.float32), 0.0) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
    q = q * scale

    ii = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    lower = jj <= ii
    G = jnp.dot(lower.astype(jnp.float32), g, preferred_element_type=jnp.float32)  # [C, 1] cumulative log-decay
    G_row = G.T  # [1, C]
    G_last = G[C - 1:C, :]  # [1, 1]
    # Subtract before exponentiating: G_i - G_j <= 0 on and below the diagonal, so exp never overflows.
    decay = jnp.exp(jnp.where(lower, G - G_row, -jnp.inf))  # [C, C]
    kb = k * beta
    A = jnp.where(jj < ii, _nt(kb, k) * decay, 0.0)
    QK = _nt(q, k) * decay
    Minv = _neumann_inverse(A, C)
    U = jnp.dot(Minv, v * beta, preferred_element_type=jnp.float32)  # [C, Dv]
    Wm = jnp.dot(Minv, kb * jnp.exp(G), preferred_element_type=jnp.float32)  # [C, Dk]

    v_new = U - jnp.dot(Wm, S, preferred_element_type=jnp.float32)
    o = jnp.dot(q * jnp.exp(G), S, preferred_element_type=jnp.float32) + jnp.dot(
        QK, v_new, preferred_element_type=jnp.float32)
    k_dec = (k * jnp.exp(G_last - G)).T  # [Dk, C]
    S = S * jnp.exp(G_last) + jnp.dot(k_dec, v_new, preferred_element_type=jnp.float32)
    return o, S


def _work_item(cu_ref, seq_ref, chunk_ref, C: int):
    """Work item w = program_id(1): (sequence s, chunk c (-1: past the end, skip), its first token, its rows that
    belong to the sequence)."""
    w = pl.program_id(1)
    s, c = seq_ref[w], chunk_ref[w]
    start = cu_ref[s] + c * C
    return s, c, start, jnp.minimum(C, cu_ref[s + 1] - start)


def _chunked_gdn_kernel(cu_ref, seq_ref, chunk_ref,  # scalar prefetch (SMEM)
                        q_hbm, k_hbm, v_hbm, g_hbm, b_hbm, s0_ref,  # inputs
                        o_hbm, sT_ref,  # outputs
                        q_buf, k_buf, v_buf, g_buf, b_buf, o_buf, S_ref, sems,  # scratch
                        *, C: int, rep: int, scale: float, use_qk_l2norm: bool):
    h = pl.program_id(0)
    s, c, start, n_valid = _work_item(cu_ref, seq_ref, chunk_ref, C)

    @pl.when(c >= 0)
    def _():
        kh = jax.lax.div(h, jnp.int32(rep))  # (a plain // lowers through sign() on TPU)
        copies = [
            pltpu.make_async_copy(q_hbm.at[pl.ds(start, C), kh], q_buf, sems.at[0]),
            pltpu.make_async_copy(k_hbm.at[pl.ds(start, C), kh], k_buf, sems.at[1]),
            pltpu.make_async_copy(v_hbm.at[pl.ds(start, C), h], v_buf, sems.at[2]),
            pltpu.make_async_copy(g_hbm.at[pl.ds(start, C), pl.ds(h, 1)], g_buf, sems.at[3]),
            pltpu.make_async_copy(b_hbm.at[pl.ds(start, C), pl.ds(h, 1)], b_buf, sems.at[4]),
        ]
        for cp in copies:
            cp.start()

        @pl.when(c == 0)
        def _():
            S_ref[...] = s0_ref[0, 0].astype(jnp.float32)

        for cp in copies:
            cp.wait()

        o, S = _chunk_step(q_buf[...], k_buf[...], v_buf[...], g_buf[...], b_buf[...], S_ref[...], n_valid, C=C,
                           scale=scale, use_qk_l2norm=use_qk_l2norm)
        S_ref[...] = S
        sT_ref[0, 0] = S

        o_buf[...] = o.astype(o_buf.dtype)
        out = pltpu.make_async_copy(o_buf, o_hbm.at[pl.ds(start, C), h], sems.at[5])
        out.start()
        out.wait()


@functools.partial(jax.jit, static_argnames=("chunk_size", "scale", "use_qk_l2norm", "interpret"))
def _chunked_gdn_packed(q, k, v, g, beta, cu_seqlens, initial_state, *, chunk_size, scale, use_qk_l2norm, interpret):
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    N = cu_seqlens.shape[0] - 1
    C = chunk_size
    W = -(-T // C) + N  # static bound on the number of work items
    seq, chunk = _work_list(cu_seqlens, C, W)
    # One C-row apron after the last token so the last chunk's window never leaves the arrays.
    pad = lambda x: jnp.pad(x, ((0, C),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
    qp, kp, vp = pad(q), pad(k), pad(v)
    gp, bp = pad(g.astype(jnp.float32)), pad(beta.astype(jnp.float32))
    kernel = functools.partial(_chunked_gdn_kernel, C=C, rep=Hv // Hk, scale=scale, use_qk_l2norm=use_qk_l2norm)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    state_spec = pl.BlockSpec((1, 1, Dk, Dv), lambda h, w, cu, sq, ch: (sq[w], h, 0, 0))
    o, final = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(Hv, W),
            in_specs=[any_spec] * 5 + [state_spec],
            out_specs=[any_spec, state_spec],
            scratch_shapes=[
                pltpu.VMEM((C, Dk), q.dtype), pltpu.VMEM((C, Dk), k.dtype), pltpu.VMEM((C, Dv), v.dtype),
                pltpu.VMEM((C, 1), jnp.float32), pltpu.VMEM((C, 1), jnp.float32), pltpu.VMEM((C, Dv), q.dtype),
                pltpu.VMEM((Dk, Dv), jnp.float32), pltpu.SemaphoreType.DMA((6,)),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct((T + C, Hv, Dv), q.dtype),
                   jax.ShapeDtypeStruct((N, Hv, Dk, Dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(cu_seqlens.astype(jnp.int32), seq, chunk, qp, kp, vp, gp, bp, initial_state)
    return o[:T], final


def chunked_gdn_packed(q, k, v, g, beta, cu_seqlens, *, initial_state=None, scale=None, use_qk_l2norm=False,
                       chunk_size=64, interpret=None):
    """The chunked gated delta rule over a packed ragged batch, as one Pallas kernel.

    q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], cu_seqlens [N + 1] (int, may be traced; lengths may be 0
    or not a multiple of the chunk), initial_state [N, Hv, Dk, Dv] or None (zeros). `chunk_size` C is the token
    block (a multiple of 8 on TPU; 64 is the usual choice). `interpret`: None picks Mosaic on TPU and TPU interpret
    mode elsewhere; pass `pltpu.InterpretParams(detect_races=True)` in tests.
    Returns (o [T, Hv, Dv] in q's dtype, final_state [N, Hv, Dk, Dv] float32)."""
    check_packed_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    N = cu_seqlens.shape[0] - 1
    Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    if initial_state is None:
        initial_state = jnp.zeros((N, Hv, Dk, Dv), jnp.float32)
    scale = float(Dk ** -0.5 if scale is None else scale)
    return _chunked_gdn_packed(q, k, v, g, beta, jnp.asarray(cu_seqlens), initial_state.astype(jnp.float32),
                               chunk_size=int(chunk_size), scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                               interpret=default_interpret() if interpret is None else interpret)


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, *, chunk_size=64, initial_state=None, scale=None,
                                  use_qk_l2norm=False, interpret=None):
    """Drop-in for `delta_rule.chunk_gated_delta_rule` on a [B, T, ...] batch of equal-length sequences (they are
    packed back to back, T each). q, k may have fewer heads than v (grouped heads, no repeat needed).
    Returns (o [B, T, Hv, Dv] in q's dtype, final_state [B, Hv, Dk, Dv] float32)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, T, H, D], got shape {tuple(x.shape)}")
    B, T = q.shape[:2]
    Hv, Dv = v.shape[2:]
    if T == 0:
        raise ValueError("chunk_gated_delta_rule_pallas needs T >= 1 tokens")
    if initial_state is not None and tuple(initial_state.shape) != (B, Hv, q.shape[-1], Dv):
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv] = {(B, Hv, q.shape[-1], Dv)}, got "
                         f"{tuple(initial_state.shape)}")
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    o, S = chunked_gdn_packed(flat(q), flat(k), flat(v), flat(g), flat(beta), cu, initial_state=initial_state,
                              scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, interpret=interpret)
    return o.reshape(B, T, Hv, Dv), S


# The recurrent rule is the independent reference the tests also compare against.
recurrent_reference = recurrent_gated_delta_rule


# ------------------------------------------------------------------------------------------------------------
# The causal conv1d fused in: raw projected q | k | v columns in, no conv output written to memory
def _conv_chunked_gdn_kernel(cu_ref, seq_ref, chunk_ref,  # scalar prefetch (SMEM)
                             x_hbm, w_hbm, cs_hbm, g_hbm, b_hbm, s0_ref,  # inputs
                             o_hbm, sT_ref, ncs_hbm,  # outputs
                             xq_buf, xk_buf, xv_buf, wq_buf, wk_buf, wv_buf, g_buf, b_buf, o_buf, S_ref, sems,
                             *, C: int, Kc: int, rep: int, key_dim: int, scale: float, use_qk_l2norm: bool):
    h = pl.program_id(0)
    s, c, start, n_valid = _work_item(cu_ref, seq_ref, chunk_ref, C)

    @pl.when(c >= 0)
    def _():
        kh = jax.lax.div(h, jnp.int32(rep))
        Dk, Dv = xq_buf.shape[1], xv_buf.shape[1]
        groups = (  # (channel offset, x window, taps) for this head's q, k and v columns
            (kh * Dk, xq_buf, wq_buf), (key_dim + kh * Dk, xk_buf, wk_buf), (2 * key_dim + h * Dv, xv_buf, wv_buf))
        # x_hbm has Kc rows of apron in front: rows [start, start + Kc + C) are tokens [start - Kc, start + C).
        copies = []
        for i, (off, xb, wb) in enumerate(groups):
            D = xb.shape[1]
            copies.append(pltpu.make_async_copy(x_hbm.at[pl.ds(start, Kc + C), pl.ds(off, D)], xb, sems.at[i]))
            copies.append(pltpu.make_async_copy(w_hbm.at[:, pl.ds(off, D)], wb, sems.at[3 + i]))
        copies.append(pltpu.make_async_copy(g_hbm.at[pl.ds(start, C), pl.ds(h, 1)], g_buf, sems.at[6]))
        copies.append(pltpu.make_async_copy(b_hbm.at[pl.ds(start, C), pl.ds(h, 1)], b_buf, sems.at[7]))
        for cp in copies:
            cp.start()

        @pl.when(c == 0)
        def _():
            S_ref[...] = s0_ref[0, 0].astype(jnp.float32)

        for cp in copies:
            cp.wait()

        @pl.when(c == 0)  # a sequence's first chunk: the history rows are its carried conv state, not the tokens
        def _():           # before it in the packed batch
            hist = [pltpu.make_async_copy(cs_hbm.at[s, :, pl.ds(off, xb.shape[1])], xb.at[pl.ds(0, Kc)],
                                          sems.at[8 + i]) for i, (off, xb, _) in enumerate(groups)]
            for cp in hist:
                cp.start()
            for cp in hist:
                cp.wait()

        def conv(xb, wb):  # y_t = silu(Σ_j w_j · x_{t - (Kc-1) + j}); token t sits at window row Kc + t
            x, taps = xb[...].astype(jnp.float32), wb[...].astype(jnp.float32)
            return jax.nn.silu(sum(x[1 + j:1 + j + C] * taps[j:j + 1] for j in range(Kc)))

        q, k, v = (conv(xb, wb) for _, xb, wb in groups)
        o, S = _chunk_step(q, k, v, g_buf[...], b_buf[...], S_ref[...], n_valid, C=C, scale=scale,
                           use_qk_l2norm=use_qk_l2norm)
        S_ref[...] = S
        sT_ref[0, 0] = S
        o_buf[...] = o.astype(o_buf.dtype)
        writes = [pltpu.make_async_copy(o_buf, o_hbm.at[pl.ds(start, C), h], sems.at[11])]
        # The sequence's last Kc inputs so far (window rows [n_valid, n_valid + Kc)) are its new conv state; a later
        # chunk of the same sequence overwrites them. The q and k columns are shared by rep value heads: the first
        # of them writes them.
        first = jax.lax.rem(h, jnp.int32(rep)) == 0
        for i, (off, xb, _) in enumerate(groups):
            cp = pltpu.make_async_copy(xb.at[pl.ds(n_valid, Kc)], ncs_hbm.at[s, :, pl.ds(off, xb.shape[1])],
                                       sems.at[12 + i])
            if i < 2:
                @pl.when(first)
                def _():
                    cp.start()
                    cp.wait()
            else:
                writes.append(cp)
        for cp in writes:
            cp.start()
        for cp in writes:
            cp.wait()


@functools.partial(jax.jit, static_argnames=("num_k_heads", "head_k_dim", "chunk_size", "scale", "use_qk_l2norm",
                                             "interpret"))
def _chunked_gdn_conv_packed(mixed, conv_weight, conv_state, g, beta, cu_seqlens, initial_state, *, num_k_heads,
                             head_k_dim, chunk_size, scale, use_qk_l2norm, interpret):
    T, conv_dim = mixed.shape
    Hv = g.shape[1]
    Dk = head_k_dim
    key_dim = num_k_heads * Dk
    Dv = (conv_dim - 2 * key_dim) // Hv
    Kc = conv_weight.shape[-1]
    N = cu_seqlens.shape[0] - 1
    C = chunk_size
    W = -(-T // C) + N
    seq, chunk = _work_list(cu_seqlens, C, W)
    xp = jnp.pad(mixed, ((Kc, C), (0, 0)))  # Kc rows of apron in front (history windows), C behind (last chunk)
    pad = lambda x: jnp.pad(x.astype(jnp.float32), ((0, C), (0, 0)))  # noqa: E731
    cs = jnp.swapaxes(conv_state, 1, 2).astype(mixed.dtype)  # [N, Kc, conv_dim]: rows of history, like the tokens
    kernel = functools.partial(_conv_chunked_gdn_kernel, C=C, Kc=Kc, rep=Hv // num_k_heads, key_dim=key_dim,
                               scale=scale, use_qk_l2norm=use_qk_l2norm)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    state_spec = pl.BlockSpec((1, 1, Dk, Dv), lambda h, w, cu, sq, ch: (sq[w], h, 0, 0))
    wdt = conv_weight.dtype
    o, final, ncs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(Hv, W),
            in_specs=[any_spec] * 5 + [state_spec],
            out_specs=[any_spec, state_spec, any_spec],
            scratch_shapes=[
                pltpu.VMEM((Kc + C, Dk), mixed.dtype), pltpu.VMEM((Kc + C, Dk), mixed.dtype),
                pltpu.VMEM((Kc + C, Dv), mixed.dtype), pltpu.VMEM((Kc, Dk), wdt), pltpu.VMEM((Kc, Dk), wdt),
                pltpu.VMEM((Kc, Dv), wdt), pltpu.VMEM((C, 1), jnp.float32), pltpu.VMEM((C, 1), jnp.float32),
                pltpu.VMEM((C, Dv), mixed.dtype), pltpu.VMEM((Dk, Dv), jnp.float32), pltpu.SemaphoreType.DMA((15,)),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct((T + C, Hv, Dv), mixed.dtype),
                   jax.ShapeDtypeStruct((N, Hv, Dk, Dv), jnp.float32),
                   jax.ShapeDtypeStruct((N, Kc, conv_dim), mixed.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(cu_seqlens.astype(jnp.int32), seq, chunk, xp, jnp.swapaxes(conv_weight, 0, 1), cs, pad(g), pad(beta),
      initial_state)
    return o[:T], final, jnp.swapaxes(ncs, 1, 2)


def _check_conv_inputs(mixed, conv_weight, g, num_k_heads, head_k_dim, conv_state, N):
    if mixed.ndim != 2:
        raise ValueError(f"mixed must be packed [T, conv_dim] (the raw q | k | v projections), got {mixed.shape}")
    T, conv_dim = mixed.shape
    if g.ndim != 2 or g.shape[0] != T:
        raise ValueError(f"g must be [T, Hv] with T = {T}, got {tuple(g.shape)}")
    Hv = g.shape[1]
    rest = conv_dim - 2 * num_k_heads * head_k_dim
    if rest <= 0 or rest % Hv:
        raise ValueError(f"conv_dim {conv_dim} is not 2·Hk·Dk + Hv·Dv for Hk={num_k_heads}, Dk={head_k_dim}, Hv={Hv}")
    if conv_weight.shape[0] != conv_dim:
        raise ValueError(f"conv weight has {conv_weight.shape[0]} channels but mixed has {conv_dim}")
    Kc = conv_weight.shape[-1]
    if conv_state is not None and tuple(conv_state.shape) != (N, conv_dim, Kc):
        raise ValueError(f"conv_state must be [N, conv_dim, Kc] = {(N, conv_dim, Kc)}, got {tuple(conv_state.shape)}")
    return T, Hv, rest // Hv, Kc


def chunked_gdn_conv_packed(mixed, conv_weight, g, beta, cu_seqlens, *, num_k_heads: int, head_k_dim: int,
                            conv_state=None, initial_state=None, scale=None, use_qk_l2norm=True, chunk_size=64,
                            interpret=None):
    """The GDN prefill with its causal conv1d fused in, over a packed ragged batch, as one Pallas kernel.

    mixed [T, conv_dim]: the raw projected q | k | v columns (`GatedDeltaNet.project`), conv_dim = 2·Hk·Dk + Hv·Dv;
    conv_weight [conv_dim, Kc] (or the checkpoint's [conv_dim, 1, Kc]); g, beta [T, Hv] (`GatedDeltaNet.gates`);
    cu_seqlens [N + 1]; conv_state [N, conv_dim, Kc] (the last Kc inputs of each sequence so far; None: zeros) and
    initial_state [N, Hv, Dk, Dv] float32 (None: zeros). Each work item DMAs its chunk's raw columns with Kc rows
    of history before them (the sequence's previous chunk, or its carried conv state for the first chunk), runs
    the depthwise conv and SiLU in VMEM and goes on with the chunk's rule (`_chunk_step`): the conv's output
    [T, conv_dim] is never written to memory nor read back. chunk_size must be >= Kc.
    Returns (o [T, Hv, Dv] in mixed's dtype, final_state [N, Hv, Dk, Dv] float32, conv_state [N, conv_dim, Kc]:
    the last Kc inputs of each sequence, its old state's where the sequence is shorter than Kc)."""
    if conv_weight.ndim == 3:
        conv_weight = conv_weight[:, 0, :]
    cu = jnp.asarray(cu_seqlens)
    N = cu.shape[0] - 1
    T, Hv, Dv, Kc = _check_conv_inputs(mixed, conv_weight, g, num_k_heads, head_k_dim, conv_state, N)
    if chunk_size < Kc:
        raise ValueError(f"chunk_size {chunk_size} must be at least the conv width {Kc} (a chunk's history rows come "
                         f"from the chunk before it)")
    Dk = head_k_dim
    dummy = jnp.zeros((T, num_k_heads, Dk), mixed.dtype)
    check_packed_inputs(dummy, dummy, jnp.zeros((T, Hv, Dv), mixed.dtype), g, beta, cu, initial_state)
    if conv_state is None:
        conv_state = jnp.zeros((N, mixed.shape[1], Kc), mixed.dtype)
    if initial_state is None:
        initial_state = jnp.zeros((N, Hv, Dk, Dv), jnp.float32)
    scale = float(Dk ** -0.5 if scale is None else scale)
    return _chunked_gdn_conv_packed(mixed, conv_weight, conv_state, g, beta, cu, initial_state.astype(jnp.float32),
                                    num_k_heads=int(num_k_heads), head_k_dim=int(Dk), chunk_size=int(chunk_size),
                                    scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                                    interpret=default_interpret() if interpret is None else interpret)


def chunked_gdn_conv_reference(mixed, conv_weight, g, beta, cu_seqlens, *, num_k_heads: int, head_k_dim: int,
                               conv_state=None, initial_state=None, scale=None, use_qk_l2norm=True, chunk_size=64):
    """The unfused path the fused kernel replaces: `delta_rule.causal_conv1d` per sequence (with its conv state),
    the columns split into heads, then `chunked_gdn_reference`. cu_seqlens concrete. Same returns."""

    cu = np.asarray(cu_seqlens, np.int64)
    N = len(cu) - 1
    T, Hv, Dv, Kc = _check_conv_inputs(mixed, conv_weight if conv_weight.ndim == 2 else conv_weight[:, 0],
                                       g, num_k_heads, head_k_dim, conv_state, N)
    if conv_state is None:
        conv_state = jnp.zeros((N, mixed.shape[1], Kc), mixed.dtype)
    ys, states = [], []
    for s in range(N):
        y, st = causal_conv1d(mixed[None, cu[s]:cu[s + 1]], conv_weight, conv_state[s:s + 1])
        ys.append(y[0])
        states.append(st[0])
    y = jnp.concatenate(ys)
    key_dim = num_k_heads * head_k_dim
    q = y[:, :key_dim].reshape(T, num_k_heads, head_k_dim)
    k = y[:, key_dim:2 * key_dim].reshape(T, num_k_heads, head_k_dim)
    v = y[:, 2 * key_dim:].reshape(T, Hv, Dv)
    o, S = chunked_gdn_reference(q, k, v, g, beta, cu, initial_state=initial_state, scale=scale,
                                 use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    return o, S, jnp.stack(states)
