"""The gated delta rule and the causal conv1d in pure JAX: the GDN layer's XLA path, and the reference every Pallas
GDN kernel here is checked against (`chunked_gdn`, `fused_gdn_decode`, `paged_gdn_decode`).

Layouts (heads already expanded to the value heads, as the layer does with repeat-interleave):
  q, k  [B, T, H, Dk]      v  [B, T, H, Dv]      g, beta  [B, T, H]      state  [B, H, Dk, Dv] float32

The rule, for each token t (S is the state, g_t ≤ 0 the log-decay, beta_t ∈ (0, 1) the write strength):
  S ← exp(g_t) S;   u = Sᵀ k_t;   S ← S + k_t (beta_t (v_t − u))ᵀ;   o_t = Sᵀ q_t

Everything inside the rule runs in float32 (decays compound; see notebook 02). Outputs come back in q's dtype.
The layer (`qwen35.gdn.GatedDeltaNet`) builds q, k, v, g and beta from its projections and calls these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "l2norm",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule",
    "gated_delta_rule_step",
    "causal_conv1d",
    "causal_conv1d_update",
]


def l2norm(x: jax.Array, axis: int = -1, eps: float = 1e-6) -> jax.Array:
    """x · rsqrt(Σx² + eps), the fixed-eps form of the FLA library and transformers."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + eps)


# ------------------------------------------------------------------------------------------------------------
# Input checks: bad shapes fail here, naming the tensors, not deep inside an einsum.
def _check(q, k, v, g, beta, initial_state, *, step: bool = False):
    lead = 2 if step else 3  # [B, H] or [B, T, H]
    names = "[B, H, D]" if step else "[B, T, H, D]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != lead + 1:
            raise ValueError(f"{name} must be {names}, got shape {tuple(x.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.ndim != lead:
            raise ValueError(f"{name} must be {names[:-4] + ']'}, got shape {tuple(x.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            f"v {tuple(v.shape)} must match q {tuple(q.shape)} in all but the last (head-dim) axis; "
            f"expand the key heads to the value heads first (repeat-interleave)"
        )
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != q.shape[:-1]:
            raise ValueError(f"{name} {tuple(x.shape)} must have shape {tuple(q.shape[:-1])} (q without its head dim)")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    B, H, Dk, Dv = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (B, H, Dk, Dv):
        raise ValueError(f"initial_state must be [B, H, Dk, Dv] = {(B, H, Dk, Dv)}, got {tuple(initial_state.shape)}")


def _prep_qk(q, k, scale, use_qk_l2norm):
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k


def _delta_step(S, q_t, k_t, v_t, g_t, b_t):
    """One token of the gated delta rule for [B, H, ·] inputs (all float32). Returns (new S, o_t)."""
    S = S * jnp.exp(g_t)[..., None, None]
    u = jnp.einsum("bhkv,bhk->bhv", S, k_t)  # what the state predicts for k_t
    S = S + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * (v_t - u))  # write the correction
    return S, jnp.einsum("bhkv,bhk->bhv", S, q_t)


def gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False):
    """A single decode token: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv].

    Returns (o [B, H, Dv] in q's dtype, new state float32)."""
    _check(q, k, v, g, beta, state, step=True)
    dtype = q.dtype
    q, k = _prep_qk(q, k, scale, use_qk_l2norm)
    S, o = _delta_step(state.astype(jnp.float32), q, k, v.astype(jnp.float32), g.astype(jnp.float32),
                       beta.astype(jnp.float32))
    return o.astype(dtype), S


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, scale=None, use_qk_l2norm=False):
    """Token-by-token gated delta rule (a `lax.scan` over T): the reference, and the decode path.

    Returns (o [B, T, H, Dv] in q's dtype, final_state [B, H, Dk, Dv] float32)."""
    _check(q, k, v, g, beta, initial_state)
    dtype = q.dtype
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    q, k = _prep_qk(q, k, scale, use_qk_l2norm)
    S0 = jnp.zeros((B, H, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    # time-major for the scan
    xs = (
        jnp.moveaxis(q, 1, 0),
        jnp.moveaxis(k, 1, 0),
        jnp.moveaxis(v.astype(jnp.float32), 1, 0),
        jnp.moveaxis(g.astype(jnp.float32), 1, 0),
        jnp.moveaxis(beta.astype(jnp.float32), 1, 0),
    )
    S, o = jax.lax.scan(lambda S, x: _delta_step(S, *x), S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(dtype), S


def _unit_lower_inverse(A: jax.Array, base: int = 16) -> jax.Array:
    """(I + A)⁻¹ for strictly lower triangular A [..., n, n], in matmuls only (no triangular solve).

    Blocks of up to `base` rows use the Neumann product: with L = -A nilpotent (Lⁿ = 0),
    (I - L)⁻¹ = I + L + L² + … = (I + L)(I + L²)(I + L⁴)… . Bigger matrices are split in halves,
    [[M₁₁, 0], [A₂₁, M₂₂]]⁻¹ = [[T₁₁, 0], [-T₂₂ A₂₁ T₁₁, T₂₂]], with both diagonal halves inverted by one
    batched call when they have equal size. On CPU this is several times faster than a batched
    `triangular_solve` (which also leaves the right-hand sides to be multiplied in afterwards)."""
    n = A.shape[-1]
    if n <= base:
        L = -A
        P = jnp.eye(n, dtype=A.dtype) + L
        p = 2
        while p < n:  # P = (I + L)(I + L²)…(I + L^(p/2)) holds the powers up to L^(p-1)
            L = L @ L
            P = P + P @ L
            p *= 2
        return P
    h = n // 2
    A11, A21, A22 = A[..., :h, :h], A[..., h:, :h], A[..., h:, h:]
    if n == 2 * h:
        T = _unit_lower_inverse(jnp.stack([A11, A22]), base)
        T11, T22 = T[0], T[1]
    else:
        T11, T22 = _unit_lower_inverse(A11, base), _unit_lower_inverse(A22, base)
    T21 = -(T22 @ (A21 @ T11))
    top = jnp.concatenate([T11, jnp.zeros(T11.shape[:-1] + (n - h,), A.dtype)], axis=-1)
    return jnp.concatenate([top, jnp.concatenate([T21, T22], axis=-1)], axis=-2)



# Tokens handled per step of the chunked rule's outer loop (a whole number of chunks, at most _MAX_CHUNKS_PER_STEP).
_BLOCK_TOKENS = 256
_MAX_CHUNKS_PER_STEP = 8


def _chunk_block(q, k, v, g, beta, S, C):
    """The chunked rule over one block of L = m·C tokens: q, k [B, L, H, Dk] (normalised, scaled), v [B, L, H, Dv],
    g, beta [B, L, H], all float32, S [B, H, Dk, Dv]. Returns (o [B, L, H, Dv], S after the block)."""
    B, L, H, Dk = q.shape
    Dv = v.shape[-1]
    m = L // C

    def chunks(x):  # [B, L, H, ...] -> [m, B, H, C, ...]: chunk-major, so chunk j is the contiguous x[j]
        return jnp.moveaxis(x.reshape(B, m, C, H, *x.shape[3:]), (1, 3), (0, 2))

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    G = jnp.cumsum(g, axis=-1)  # [m, B, H, C]: log of the decay from the chunk start to position i
    G_last = G[..., -1:]
    lower = jnp.tril(jnp.ones((C, C), bool))  # j <= i
    # Subtract before exponentiating: G_i - G_j <= 0 on and below the diagonal, so exp never overflows (the min
    # caps the positive differences above it, which the mask then zeroes). exp-then-mask is one plain elementwise
    # fusion, cheaper on CPU than exp of a select (`python benchmarks/gdn.py` times the rule).
    decay = jnp.exp(jnp.minimum(G[..., :, None] - G[..., None, :], 0.0)) * lower  # [m, B, H, C, C]
    kT = jnp.swapaxes(k, -1, -2)  # [m, B, H, Dk, C]: both products below are plain (M×K)·(K×N) GEMMs
    kb = k * beta[..., None]
    A = jnp.where(jnp.tril(lower, -1), (kb @ kT) * decay, 0.0)  # strictly lower
    QK = (q @ kT) * decay  # causal, diagonal included
    Tinv = _unit_lower_inverse(A)  # M⁻¹, M = I + A
    U = Tinv @ (v * beta[..., None])  # [m, B, H, C, Dv]
    W = Tinv @ (kb * jnp.exp(G)[..., None])  # [m, B, H, C, Dk]
    q_dec = q * jnp.exp(G)[..., None]
    kT_dec = jnp.swapaxes(k * jnp.exp(G_last - G)[..., None], -1, -2)  # [m, B, H, Dk, C]
    chunk_decay = jnp.exp(G_last)[..., None]  # [m, B, H, 1, 1]

    # The only sequential part: m chunks, unrolled (m is small), 4 small GEMMs each.
    outs = []
    for j in range(m):
        v_new = U[j] - W[j] @ S
        outs.append(q_dec[j] @ S + QK[j] @ v_new)  # old state's read + the chunk's own contribution
        S = S * chunk_decay[j] + kT_dec[j] @ v_new
    o = jnp.stack(outs)  # [m, B, H, C, Dv]
    return jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, L, H, Dv), S


def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, initial_state=None, scale=None, use_qk_l2norm=False):
    """The chunked (WY / UT-transform) gated delta rule: the same result as the recurrent form, with the work
    inside each chunk of C tokens done as matmuls and only the [Dk, Dv] state carried between chunks.

    Per chunk (positions i, j in 0..C-1, G the cumulative log-decay inside the chunk):
      A_ij = β_i (k_i·k_j) exp(G_i − G_j) for j < i;  M = I + A (unit lower triangular)
      U = M⁻¹ (β ⊙ V)          — the "new values" before the old state is accounted for
      W = M⁻¹ (β ⊙ exp(G) ⊙ K) — how much of the old state each of them must subtract
      V' = U − W S;  O = (Q ⊙ exp(G)) S + [(Q Kᵀ) ⊙ exp(G_i − G_j)]_{j ≤ i} V'
      S ← exp(G_C) S + (K ⊙ exp(G_C − G))ᵀ V'
    T is zero-padded up to a multiple of C (g = 0 and beta = 0 there: decay 1, no write).

    How it is laid out for speed (on CPU; `python benchmarks/gdn.py` times it): a `fori_loop` walks the sequence in
    blocks of a few chunks (256 tokens); each step slices its block out of the inputs, does the per-chunk work
    of all its chunks as batched GEMMs (M⁻¹ explicitly, by `_unit_lower_inverse`, then U and W as products),
    runs the few state updates, and writes its outputs into the result in place. Working per block keeps every
    intermediate small (a few MB whatever T is): whole-sequence [N, C, C] / [N, C, D] intermediates cost more
    in memory traffic and page faults than their matmuls.

    Returns (o [B, T, H, Dv] in q's dtype, final_state [B, H, Dk, Dv] float32)."""
    _check(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = q.dtype
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    L = C * max(1, min(_MAX_CHUNKS_PER_STEP, _BLOCK_TOKENS // C))  # tokens per loop step
    S = jnp.zeros((B, H, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def prep(q, k, v, g, beta):
        q, k = _prep_qk(q, k, scale, use_qk_l2norm)
        return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)

    out = jnp.zeros((B, T, H, Dv), dtype)
    n_full = T // L
    if n_full:
        def step(i, carry):
            out, S = carry
            blk = [jax.lax.dynamic_slice_in_dim(x, i * L, L, axis=1) for x in (q, k, v, g, beta)]
            o, S = _chunk_block(*prep(*blk), S, C)
            return jax.lax.dynamic_update_slice_in_dim(out, o.astype(dtype), i * L, axis=1), S

        out, S = jax.lax.fori_loop(0, n_full, step, (out, S))
    rest = T - n_full * L
    if rest:  # the last partial block, zero-padded to whole chunks
        pad = (-rest) % C
        blk = [x[:, n_full * L:] for x in (q, k, v, g, beta)]
        blk = [jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)) for x in blk]
        o, S = _chunk_block(*prep(*blk), S, C)
        out = jax.lax.dynamic_update_slice_in_dim(out, o[:, :rest].astype(dtype), n_full * L, axis=1)
    return out, S


# ------------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d with its state.
def causal_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array | None = None, *, activation: bool = True):
    """Causal depthwise conv over time, then SiLU.

    x [B, T, C] (the pre-conv qkv columns), weight [C, Kc] (the checkpoint's [C, 1, Kc] squeezed; the last tap
    multiplies the current token), conv_state [B, C, Kc] holding the last Kc inputs (zeros at the start).
    Returns (y [B, T, C] in x's dtype, new conv_state [B, C, Kc] = the last Kc inputs, left zero-padded).
    """
    if weight.ndim == 3:
        weight = weight[:, 0, :]
    B, T, C = x.shape
    if weight.shape[0] != C:
        raise ValueError(f"conv weight has {weight.shape[0]} channels but x has {C} (x {tuple(x.shape)})")
    Kc = weight.shape[-1]
    if conv_state is None:
        hist = jnp.zeros((B, Kc, C), x.dtype)
    else:
        if tuple(conv_state.shape) != (B, C, Kc):
            raise ValueError(f"conv_state must be [B, C, Kc] = {(B, C, Kc)}, got {tuple(conv_state.shape)}")
        hist = jnp.swapaxes(conv_state, 1, 2).astype(x.dtype)
    xp = jnp.concatenate([hist, x], axis=1)  # [B, Kc + T, C]
    w = weight.astype(x.dtype)
    # y_t = sum_j w[:, j] * x_{t - (Kc - 1) + j}; x_t sits at xp index Kc + t.
    y = sum(xp[:, 1 + j: 1 + j + T, :] * w[:, j] for j in range(Kc))
    if activation:
        y = jax.nn.silu(y)
    new_state = jnp.swapaxes(xp[:, -Kc:, :], 1, 2)
    return y.astype(x.dtype), new_state


def causal_conv1d_update(x_t: jax.Array, weight: jax.Array, conv_state: jax.Array, *, activation: bool = True):
    """One decode token: x_t [B, C], conv_state [B, C, Kc]. Shift the state left, append x_t, dot with the taps.

    Returns (y [B, C], new conv_state)."""
    if weight.ndim == 3:
        weight = weight[:, 0, :]
    if x_t.ndim != 2 or tuple(conv_state.shape) != (x_t.shape[0], x_t.shape[1], weight.shape[-1]):
        raise ValueError(
            f"causal_conv1d_update wants x_t [B, C] and conv_state [B, C, Kc]; got x_t {tuple(x_t.shape)}, "
            f"conv_state {tuple(conv_state.shape)}, weight {tuple(weight.shape)}"
        )
    state = jnp.concatenate([conv_state[:, :, 1:].astype(x_t.dtype), x_t[:, :, None]], axis=-1)
    # Σ_j state[..., j]·w[:, j] written out over the Kc (= 4) taps: one elementwise fusion, where
    # `jnp.sum(state * w, -1)` becomes a reduction library call on CPU several times slower; this runs in every
    # GDN layer of every decode step.
    w = weight.astype(x_t.dtype)
    y = sum(state[:, :, j] * w[:, j] for j in range(w.shape[-1]))
    if activation:
        y = jax.nn.silu(y)
    return y.astype(x_t.dtype), state
