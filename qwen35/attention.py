"""Gated grouped-query attention of Qwen3.5: partial rotate-half RoPE (with optional YaRN), q/k RMSNorm, an
output gate, and a KV cache.

Layouts:
  x  [B, T, H]          q  [B, T, Hq, Dh]       k, v  [B, S, Hkv, Dh]       cache k, v  [B, S_max, Hkv, Dh]
  positions [T] (or [B, T])                      cos, sin  [..., rd/2]  (one entry per rotating pair)

The layer, for a token at position p (q head h reads kv head h // (Hq/Hkv)):
  q_h, gate_h = split(q_proj(x) per head);  q = RoPE_p(q_norm(q));  k = RoPE_p(k_norm(k_proj(x)));  v = v_proj(x)
  o = softmax(q kᵀ / sqrt(Dh), causal) v;   y = o_proj(o · sigmoid(gate))

RoPE rotates only the first rd = Dh · partial_rotary_factor dims, rotate-half style: dim i is paired with
dim i + rd/2 and both turn by the angle p · inv_freq[i]; dims ≥ rd pass through unchanged. Scores and softmax are
float32 whatever the activation dtype; the cache stores keys after k_norm and RoPE.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35.config import Qwen35Config
from qwen35.execution import Execution
from qwen35.kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_pool
from qwen35.layers import Linear, RMSNorm
from qwen35.pool import from_pool, pool_dtype, to_pool

__all__ = [
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope",
    "reference_attention",
    "gqa_attention",
    "KVCache",
    "GatedAttention",
    "kv_bytes_per_token",
]


# ------------------------------------------------------------------------------------------------------------
# RoPE tables.
def _rope_params(config: Qwen35Config) -> tuple[str, dict]:
    rs = config.rope_scaling_dict or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"rope type {kind!r} is not supported; use 'default' or 'yarn'.")
    return kind, rs


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@functools.lru_cache(maxsize=64)
def _rope_inv_freq_cached(config: Qwen35Config) -> tuple[tuple[float, ...], float]:
    kind, rs = _rope_params(config)
    base, rd = float(config.rope_theta), config.rotary_dim
    f32 = np.float32
    # transformers computes these tables in float32 (base ** (arange(0, rd, 2) / rd), then 1 / that); we do the
    # same arithmetic in float32 (the power is evaluated in float64 and rounded once) so the tables agree bit-close.
    exponent = np.arange(0, rd, 2, dtype=f32) / f32(rd)
    pos_freqs = (base ** exponent.astype(np.float64)).astype(f32)  # theta^(2i/rd)
    inv_freq = f32(1.0) / pos_freqs
    if kind == "default":
        return tuple(float(v) for v in inv_freq), 1.0

    # YaRN ("NTK-by-parts" + attention temperature), as transformers' `_compute_yarn_parameters`.
    original_max = rs.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = rs.get("factor")
    if factor is None:
        factor = config.max_position_embeddings / original_max
    factor = float(factor)
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(num_rotations):  # the dim index whose wavelength fits `num_rotations` turns in original_max
        return (rd * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rd - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(rd // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    extrapolation = f32(1) - ramp  # 1: keep the original frequency (fast dims), 0: divide it by `factor`
    inv_interp = f32(1.0) / (f32(factor) * pos_freqs)
    inv_freq = inv_interp * (f32(1) - extrapolation) + inv_freq * extrapolation
    return tuple(float(v) for v in inv_freq.astype(f32)), float(attention_factor)


def rope_inv_freq(config: Qwen35Config) -> tuple[np.ndarray, float]:
    """(inv_freq [rd/2] float32, attention_scaling) for the config's RoPE.

    Default: inv_freq[i] = theta^(-2i/rd), scaling 1. YaRN (`rope_scaling` with rope_type "yarn"): the slow
    dims (wavelength longer than the original context / beta_slow turns) are divided by `factor`, the fast ones
    (more than beta_fast turns) kept, a linear ramp in between; cos and sin are multiplied by the attention factor
    (0.1·ln(factor) + 1 unless `attention_factor` or `mscale`/`mscale_all_dim` say otherwise). This follows
    transformers' `_compute_yarn_parameters`, including `truncate` and its defaults (beta_fast 32, beta_slow 1,
    original_max_position_embeddings = max_position_embeddings).
    """
    inv, scale = _rope_inv_freq_cached(config)
    return np.asarray(inv, np.float32), scale


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, attention_scaling: float = 1.0):
    """cos and sin of positions · inv_freq, times attention_scaling, in float32: each [..., rd/2] for positions
    [...]. (transformers returns the same table concatenated with itself, [..., rd]; we keep one copy per pair.)"""
    angles = jnp.asarray(positions).astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(angles) * attention_scaling, jnp.sin(angles) * attention_scaling


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rotary_dim: int) -> jax.Array:
    """Rotate-half RoPE on the first `rotary_dim` dims of x [B, T, N, Dh]; the rest pass through.

    cos, sin [T, rd/2] or [B, T, rd/2]. Pair (i, i + rd/2) turns by angle i:
      y_i = x_i cos_i − x_{i+rd/2} sin_i,   y_{i+rd/2} = x_{i+rd/2} cos_i + x_i sin_i.
    Computed in float32, returned in x's dtype."""
    if x.ndim != 4:
        raise ValueError(f"apply_rope expects x [B, T, N, Dh], got shape {tuple(x.shape)}")
    half = rotary_dim // 2
    if rotary_dim % 2 or not 0 < rotary_dim <= x.shape[-1]:
        raise ValueError(f"rotary_dim must be even and in (0, Dh={x.shape[-1]}], got {rotary_dim}")
    if cos.shape[-1] != half or sin.shape != cos.shape:
        raise ValueError(
            f"cos and sin must be [..., rd/2 = {half}] (one angle per rotating pair), got cos {tuple(cos.shape)}, "
            f"sin {tuple(sin.shape)}"
        )
    if cos.shape[-2] != x.shape[1]:
        raise ValueError(f"cos/sin cover {cos.shape[-2]} positions but x has T = {x.shape[1]} (x {tuple(x.shape)})")
    c, s = cos.astype(jnp.float32)[..., None, :], sin.astype(jnp.float32)[..., None, :]  # broadcast over heads
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    y = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, rest], axis=-1)
    return y.astype(x.dtype)


# ------------------------------------------------------------------------------------------------------------
# Attention cores.
def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"{name} must be [B, T, heads, Dh], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch (axis 0) and head dim (axis 3)"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q has {q.shape[2]} heads, not a multiple of the {k.shape[2]} kv heads (GQA)")


def reference_attention(q, k, v, *, causal_offset: int | jax.Array = 0, kv_len: int | jax.Array | None = None):
    """Plain softmax attention, written to be obviously right: repeat each kv head Hq/Hkv times, float32 scores
    scaled by Dh^-0.5, query t (at position causal_offset + t) sees keys s ≤ causal_offset + t and s < kv_len.

    q [B, T, Hq, Dh], k, v [B, S, Hkv, Dh] -> [B, T, Hq, Dh] in q's dtype."""
    _check_qkv(q, k, v)
    B, T, Hq, Dh = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    k = jnp.repeat(k, Hq // Hkv, axis=2).astype(jnp.float32)  # head h -> kv head h // (Hq/Hkv)
    v = jnp.repeat(v, Hq // Hkv, axis=2).astype(jnp.float32)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * Dh**-0.5
    q_pos = causal_offset + jnp.arange(T)
    k_pos = jnp.arange(S)
    visible = k_pos[None, :] <= q_pos[:, None]
    if kv_len is not None:
        visible = visible & (k_pos[None, :] < kv_len)
    scores = jnp.where(visible, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v).astype(q.dtype)


# Queries per block of `gqa_attention` (at least; see `_query_block`). Small blocks keep the scores in cache and,
# for causal self-attention, skip the keys after the block's last query: about half the score and value FLOPs.
# On CPU blocks of 32 to 128 queries time alike for the `small` preset's prefill (`python benchmarks/vs_transformers.py`
# times the model's prefill).
ATTN_BLOCK_Q = 128
_MAX_QUERY_BLOCKS = 32  # longer inputs get bigger blocks, so the unrolled loop stays short to compile


def _query_block(T: int, block_q: int | None) -> int:
    if block_q is not None:
        if block_q < 1:
            raise ValueError(f"block_q must be >= 1, got {block_q}")
        return block_q
    return max(ATTN_BLOCK_Q, -(-T // _MAX_QUERY_BLOCKS))


def _gqa_block(qr, k, v, q_positions, kv_len, G: int):
    """One block of queries against its keys, as plain batched matmuls: qr [B, Hkv, t·G, Dh] (float32, scaled by
    Dh^-0.5; row r is query r // G, group member r % G: G = Hq/Hkv), k, v [B, Hkv, S, Dh] float32, q_positions [t].
    Returns [B, Hkv, t·G, Dh] float32. The softmax is normalised after the value product (one division per output
    element instead of one per score)."""
    S = k.shape[2]
    scores = jnp.einsum("bkrd,bksd->bkrs", qr, k)
    k_pos = jnp.arange(S)
    visible = k_pos[None, :] <= jnp.repeat(q_positions, G)[:, None]  # [t·G, S]
    if kv_len is not None:
        visible = visible & (k_pos[None, :] < kv_len)
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)  # key 0 is always visible: no empty rows
    p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True, initial=jnp.finfo(jnp.float32).min))
    return jnp.einsum("bkrs,bksd->bkrd", p, v) / jnp.sum(p, axis=-1, keepdims=True)


def gqa_attention(q, k, v, *, q_positions: jax.Array | None = None, kv_len: int | jax.Array | None = None,
                  block_q: int | None = None):
    """Grouped-query causal attention without materialising repeated kv heads: q is viewed as
    [B, T, Hkv, G, Dh] (G = Hq/Hkv, q head h = kv head h // G, member h % G). Query t at q_positions[t] sees keys
    s ≤ q_positions[t] (and s < kv_len if given). Scores and softmax in float32.

    `q_positions=None` means causal self-attention: q and k cover the same positions 0..T-1 (T = S).

    Layout: q is transposed once to [B, Hkv, T·G, Dh] (the G query heads that share a kv head, and their queries,
    as the rows of one matrix) and k, v to [B, Hkv, S, Dh], so each block's scores and values are plain batched
    matmuls with no per-block transposes (about half the time, on CPU, of [B, Hkv, G, t, S] scores built from the
    untransposed inputs).

    The queries go in blocks of `block_q` (default `ATTN_BLOCK_Q`, more for very long inputs), each a plain
    softmax over its keys: the same result as one block, with [B, Hkv, block_q·G, S] scores instead of
    [.., T·G, S] — small enough to stay in cache. In causal self-attention a block also stops at its last query's
    key (the keys after it are masked for every query in the block), which skips about half the work.

    q [B, T, Hq, Dh], k, v [B, S, Hkv, Dh] -> [B, T, Hq, Dh] in q's dtype."""
    _check_qkv(q, k, v)
    B, T, Hq, Dh = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    self_attn = q_positions is None
    if self_attn:
        if S != T:
            raise ValueError(f"q_positions=None (causal self-attention) needs as many keys as queries, got T={T}, "
                             f"S={S}; pass q_positions for queries that continue a longer sequence")
        q_positions = jnp.arange(T)
    qr = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dh) * Dh**-0.5
    qr = jnp.transpose(qr, (0, 2, 1, 3, 4)).reshape(B, Hkv, T * G, Dh)
    kh, vh = (jnp.transpose(x.astype(jnp.float32), (0, 2, 1, 3)) for x in (k, v))  # [B, Hkv, S, Dh]
    bq = _query_block(T, block_q)
    outs = []
    for a in range(0, max(T, 1), bq):  # T = 0 still makes one (empty) block
        b = min(T, a + bq)
        hi = b if self_attn else S  # causal self-attention: keys after the block's last query are all masked
        outs.append(_gqa_block(qr[:, :, a * G:b * G], kh[:, :, :hi], vh[:, :, :hi], q_positions[a:b], kv_len, G))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)
    o = jnp.transpose(o.reshape(B, Hkv, T, G, Dh), (0, 2, 1, 3, 4))
    return o.reshape(B, T, Hq, Dh).astype(q.dtype)


def _pallas_attention(q, k, v, *, q_positions: jax.Array | None, kv_len: int | jax.Array):
    """`gqa_attention` through the ragged paged attention kernel (`kernels="pallas"`): the dense [B, S, Hkv, Dh]
    K/V is a paged cache with a trivial page table (sequence b owns pages b·P .. b·P + P − 1), the queries are
    packed [B·T, Hq, Dh] with cu_q_lens = T·arange(B + 1), and every sequence holds kv_len tokens. The queries are
    the last T of them (q_positions = kv_len − T + arange(T), as the model always calls it)."""
    del q_positions  # implied by kv_len: the kernel places the T queries at kv_len - T .. kv_len - 1
    B, T, Hq, Dh = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    page_size = next((p for p in (256, 128, 64, 32, 16, 8) if S % p == 0), 8)
    S_pad = -(-S // page_size) * page_size
    if S_pad != S:
        k, v = (jnp.pad(t, ((0, 0), (0, S_pad - S), (0, 0), (0, 0))) for t in (k, v))
    P = S_pad // page_size
    k_pages = k.reshape(B * P, page_size, Hkv, Dh)
    v_pages = v.reshape(B * P, page_size, Hkv, Dh)
    page_indices = jnp.arange(B * P, dtype=jnp.int32).reshape(B, P)
    kv_lens = jnp.full((B,), kv_len, jnp.int32)
    cu_q_lens = T * jnp.arange(B + 1, dtype=jnp.int32)
    o = ragged_paged_attention(q.reshape(B * T, Hq, Dh), k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                               jnp.array([B], jnp.int32))
    return o.reshape(B, T, Hq, Dh)


# ------------------------------------------------------------------------------------------------------------
class KVCache(NamedTuple):
    """Per-layer KV cache: k, v [B, S_max, Hkv, Dh]; keys stored after k_norm and RoPE. How many slots are filled
    is not stored here: the caller passes it as `cache_index`."""

    k: jax.Array
    v: jax.Array


def kv_bytes_per_token(config: Qwen35Config, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token costs across all full-attention layers: layers × 2 (K, V) × Hkv × Dh × bytes."""
    return config.num_full_layers * 2 * config.num_key_value_heads * config.head_dim * dtype_bytes


def _static_int(x) -> int | None:
    """x as a Python int if it is known at trace time, else None (a tracer under jit)."""
    try:
        return int(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


# ------------------------------------------------------------------------------------------------------------
# The serving step's paged attention: K/V in the pool's pages, queries packed by rows
def _paged_attend(kernels: str):
    """The step's ragged paged attention for `kernels` (the layer's `execution.kernels`), as
    `attend(q, k, v, pages, ki, batch) -> [Tb, Hq, D]`
    (k, v: this step's own keys and values [Tb, Hkv, D], already written into the pages; pages: the pool viewed
    as [2A, num_blocks, page_size, Hkv, D], the layer's K pages at pages[ki] and V pages at pages[ki + 1]): the
    Pallas kernel for "pallas" (it reads everything through the block tables, in place), else
    `_paged_attention_rows` (the reference's result, laid out by rows)."""
    if kernels == "pallas":
        return lambda q, k, v, pages, ki, b: ragged_paged_attention_pool(
            q, pages, ki, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, kv_dtype=pool_dtype(pages))
    return _paged_attention_rows


def _softmax_attend(spec: str, qg, k, v, mask, scale):
    """Masked softmax attention in float32. `spec` names q's leading axes (before [Hkv, G, D]) and k/v's (before
    [L, Hkv, D]), e.g. "pj,p" for a block of queries per row; mask has q's leading axes + [L]. Fully masked
    queries give 0."""
    qa, ka = spec.split(",")
    # Keys in their stored dtype, products accumulated in float32: exact for a bf16 cache and bf16 queries (q's
    # float32 copy of bf16 values rounds back exactly), without a float32 copy of every gathered key.
    q_in = qg.astype(k.dtype) if qg.dtype != k.dtype and jnp.finfo(k.dtype).bits < 32 else qg
    s = jnp.einsum(f"{qa}kgd,{ka}lkd->{qa}kgl", q_in, k, preferred_element_type=jnp.float32) * scale
    mask = mask[..., None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum(f"{qa}kgl,{ka}lkd->{qa}kgd", p / jnp.where(denom > 0, denom, 1.0), v)


def _paged_attention_rows(q, k_new, v_new, pool_pages, ki, b):
    """Ragged paged attention for the XLA kernels, by rows instead of by tokens: the same result as
    `ragged_paged_attention_reference` for every real token, without its per-token copy of the sequence's KV
    ([Tb, L, Hkv, D], the cost of a mixed step on CPU).

    Every row's last token attends to the row's pages ([Sb, L]: all a decode row has). The rows with several
    tokens (prefill chunks) attend again as the padded block [Sp, Lb] of `gather_idx` and replace their tokens'
    outputs (the layout `_gdn` uses): causally to the chunk's own keys and values `k_new`, `v_new` (no page
    gather), after the context the row had before this step, read from its first Pc pages (`ctx_pages`). A
    prompt prefilled in one step has no context (Pc = 0), so its attention costs Lb keys per query, not the
    L = P·page_size of the whole block table. When Pc·page_size + Lb would reach L anyway, the engine passes the
    whole table (Pc = P) and the chunk reads every key, its own included, from the pages."""
    T, Hq, D = q.shape
    _, _, PS, Hkv, _ = pool_pages.shape
    Sb, P = b.page_indices.shape
    G, L = Hq // Hkv, P * PS
    scale = D ** -0.5
    kv_dtype = pool_dtype(pool_pages)

    def pages(table):  # [R, P'] page ids -> K [R, P'·PS, Hkv, D] (cache dtype), V (float32): gathers in the pool
        R, n = table.shape
        return (from_pool(pool_pages[ki, table], pool_pages).reshape(R, n * PS, Hkv, D),
                from_pool(pool_pages[ki + 1, table], pool_pages).reshape(R, n * PS, Hkv, D).astype(jnp.float32))

    k, v = pages(b.page_indices)
    qf = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    key_pos = jnp.arange(L, dtype=jnp.int32)
    live = jnp.arange(Sb) < b.num_seqs[0]
    visible = (key_pos[None, :] < b.kv_lens[:, None]) & live[:, None]  # [Sb, L]
    Sp, Lb = b.gather_idx.shape
    Sv, K1 = b.spec_idx.shape
    if b.verify_only.shape[0]:  # every row verifies drafts: the verify block below covers every token
        o = jnp.zeros((T, Hkv, G, D), jnp.float32)
    else:
        o = _softmax_attend("s,s", qf[b.last_idx], k, v, visible, scale)[b.tok_row]  # [Tb, Hkv, G, D]
    if Sp:
        r = jnp.minimum(b.pf_rows, Sb - 1)
        valid = b.gather_valid
        j = jnp.arange(Lb)
        Pc = b.ctx_pages.shape[1]
        start = b.kv_lens[r] - jnp.sum(valid, axis=1)  # [Sp] tokens before the chunk
        if Pc == P:  # the whole block table (cheaper than context + chunk): the chunk's K/V are in the pages too
            keys, vals = pages(b.ctx_pages)
            pos = start[:, None] + j[None, :]  # [Sp, Lb]
            mask = (key_pos[None, None, :] <= pos[..., None]) & valid[..., None]  # [Sp, Lb, L]
        else:
            keys = k_new[b.gather_idx].astype(kv_dtype)  # [Sp, Lb, Hkv, D]: the chunk's own tokens
            vals = v_new[b.gather_idx].astype(jnp.float32)
            mask = (j[None, None, :] <= j[None, :, None]) & valid[:, None, :] & valid[:, :, None]  # [Sp, Lb, Lb]
            if Pc:  # a chunk that continues a sequence: its earlier tokens from the first Pc pages come first
                kc, vc = pages(b.ctx_pages)
                ctx = (jnp.arange(Pc * PS)[None, None, :] < start[:, None, None]) & valid[..., None]  # [Sp, Lb, Pc·PS]
                keys, vals = jnp.concatenate([kc, keys], axis=1), jnp.concatenate([vc, vals], axis=1)
                mask = jnp.concatenate([ctx, mask], axis=-1)
        o_pf = _softmax_attend("pj,p", qf[b.gather_idx], keys, vals, mask, scale)  # [Sp, Lb, Hkv, G, D]
        o = jnp.where(b.tok_pf[:, None, None, None], o_pf[b.tok_prow, b.tok_col], o)
    if Sv:  # verify rows (a speculative step): each token attends causally to its row's pages, itself included
        r = jnp.minimum(b.spec_rows, Sb - 1)
        mask = key_pos[None, None, :] <= b.positions[b.spec_idx][..., None]  # [Sv, K1, L]
        o_sp = _softmax_attend("pj,p", qf[b.spec_idx], k[r], v[r], mask, scale)  # [Sv, K1, Hkv, G, D]
        o = o.at[b.spec_idx.reshape(-1)].set(o_sp.reshape(Sv * K1, *o.shape[1:]), mode="drop")
    return o.reshape(T, Hq, D).astype(q.dtype)


class GatedAttention(nnx.Module):
    """The full-attention mixer of Qwen3.5 (`model.layers.{i}.self_attn.*`).

    `__call__(x [B, T, H], *, cache=None, cache_index=0) -> (y [B, T, H], KVCache | None)`.
    `cache_index` is how many tokens the cache already holds = the position of x[:, 0] (an int or a traced int32
    scalar). Without a cache: causal attention over the T tokens (RoPE positions start at cache_index), returns
    (y, None). With a cache: the new keys/values are written at [cache_index, cache_index + T) and the T queries
    attend over the cache up to their own position; returns (y, updated cache). `execution.kernels` picks the
    attention core (the one dispatch, `attend`): "pallas" the ragged paged attention kernel (`_pallas_attention`),
    "xla" `gqa_attention`. `paged(x, pool, i, b)` is the same layer in the serving step, its K/V in the pool's pages
    (the kernel reads them through the block tables; the XLA path by rows, `_paged_attention_rows`).
    """

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 execution: Execution = Execution()):
        c = config
        self.config, self.execution = c, execution
        H = c.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rotary_dim = c.rotary_dim
        Hq, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = Linear(H, Hq * Dh * 2, rngs=rngs, param_dtype=param_dtype)  # per head: q_h then gate_h
        self.k_proj = Linear(H, Hkv * Dh, rngs=rngs, param_dtype=param_dtype)
        self.v_proj = Linear(H, Hkv * Dh, rngs=rngs, param_dtype=param_dtype)
        self.o_proj = Linear(Hq * Dh, H, rngs=rngs, param_dtype=param_dtype)
        self.q_norm = RMSNorm(Dh, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(Dh, eps=c.rms_norm_eps, param_dtype=param_dtype)

    def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty (zeros) cache for `max_len` tokens."""
        shape = (batch_size, max_len, self.num_kv_heads, self.head_dim)
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def _check(self, x, cache, cache_index):
        H = self.config.hidden_size
        if x.ndim != 3 or x.shape[-1] != H:
            raise ValueError(f"GatedAttention expects x [B, T, H={H}], got shape {tuple(x.shape)}")
        B, T, _ = x.shape
        if jnp.ndim(cache_index) != 0:
            raise ValueError(
                f"cache_index must be a scalar (tokens already in the cache), got shape {jnp.shape(cache_index)}"
            )
        idx = _static_int(cache_index)
        if idx is not None and idx < 0:
            raise ValueError(f"cache_index must be >= 0, got {idx}")
        if cache is None:
            return
        Hkv, Dh = self.num_kv_heads, self.head_dim
        for name, t in (("cache.k", cache.k), ("cache.v", cache.v)):
            if t.ndim != 4 or (t.shape[0], t.shape[2], t.shape[3]) != (B, Hkv, Dh):
                raise ValueError(
                    f"{name} must be [B={B}, S_max, Hkv={Hkv}, Dh={Dh}], got shape {tuple(t.shape)}; "
                    f"build it with init_cache(batch, max_len)"
                )
        if cache.k.shape != cache.v.shape:
            raise ValueError(
                f"cache.k {tuple(cache.k.shape)} and cache.v {tuple(cache.v.shape)} must have the same shape"
            )
        S_max = cache.k.shape[1]
        if idx is not None and idx + T > S_max:
            noun = "prompt" if idx == 0 else "continuation"
            raise ValueError(
                f"{noun} of {T} tokens at position {idx} does not fit a cache of {S_max} tokens; allocate a larger "
                f"cache with init_cache(batch, max_len) (max_len >= {idx + T})"
            )

    def project(self, x: jax.Array, positions: jax.Array):
        """The layer before its attention core: x [B, T, H] at `positions` ([T], or [B, T]) -> q [B, T, Hq, Dh]
        (q_norm, RoPE), k [B, T, Hkv, Dh] (k_norm, RoPE), v [B, T, Hkv, Dh] and the output gate [B, T, Hq·Dh].
        `__call__` and the serving engine's paged step (`qwen35.serving.runner`) both start here."""
        B, T, _ = x.shape
        Hq, Hkv, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        qg = self.q_proj(x).reshape(B, T, Hq, 2 * Dh)  # per head: [q_h | gate_h]
        q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, T, Hq * Dh)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(B, T, Hkv, Dh))
        v = self.v_proj(x).reshape(B, T, Hkv, Dh)
        inv_freq, scaling = rope_inv_freq(self.config)
        cos, sin = rope_cos_sin(positions, inv_freq, scaling)
        return apply_rope(q, cos, sin, self.rotary_dim), apply_rope(k, cos, sin, self.rotary_dim), v, gate

    def output(self, o: jax.Array, gate: jax.Array, dtype) -> jax.Array:
        """The layer after its attention core: o [B, T, Hq, Dh] times sigmoid(gate) (float32), in `dtype`,
        through o_proj -> [B, T, H]."""
        B, T = o.shape[:2]
        o = o.reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj((o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(dtype))

    @property
    def attend(self):
        """The attention core `execution.kernels` picks: `_pallas_attention` or `gqa_attention` (same arguments)."""
        return _pallas_attention if self.execution.kernels == "pallas" else gqa_attention

    def __call__(self, x: jax.Array, *, cache: KVCache | None = None,
                 cache_index: jax.Array | int = 0) -> tuple[jax.Array, KVCache | None]:
        self._check(x, cache, cache_index)
        B, T, _ = x.shape
        start = jnp.asarray(cache_index, jnp.int32)
        positions = start + jnp.arange(T, dtype=jnp.int32)
        q, k, v, gate = self.project(x, positions)

        attend = self.attend
        if cache is None:
            o = attend(q, k, v, q_positions=None, kv_len=T)
            new_cache = None
        else:
            zero = jnp.zeros((), jnp.int32)
            ck = jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (zero, start, zero, zero))
            cv = jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (zero, start, zero, zero))
            new_cache = KVCache(ck, cv)
            o = attend(q, ck.astype(q.dtype), cv.astype(q.dtype), q_positions=positions, kv_len=start + T)
        return self.output(o, gate, x.dtype), new_cache

    def paged(self, x, pool, i, b):
        """This layer as attention layer i (of the model's attention layers) of a serving step, on its packed tokens
        x [Tb, H] over the cache pool: (y [Tb, H], pool). `b` is the step's packed batch (a
        `qwen35.serving.runner.StepBatch`: positions, slot mapping, block tables, the prefill and verify rows). The
        layer's own projections (`project`, every token at its own position), K/V scattered into its pages of the
        pool (units 2i and 2i + 1) at `slot_mapping`, the ragged paged attention of `_paged_attend` over the block
        tables, the layer's own output gate and projection."""
        q, k, v, gate = (t[0] for t in self.project(x[None], b.positions))
        C, NB, _ = pool.shape
        Hkv, Dh = k.shape[1:]
        PS = pool.shape[2] // (Hkv * Dh)
        flat = pool.reshape(C, NB * PS, Hkv, Dh)  # free views of the pool: token slots, then pages
        flat = flat.at[2 * i, b.slot_mapping].set(to_pool(k, pool)).at[2 * i + 1, b.slot_mapping].set(to_pool(v, pool))
        pages = flat.reshape(C, NB, PS, Hkv, Dh)
        o = _paged_attend(self.execution.kernels)(q, k, v, pages, 2 * i, b)  # [Tb, Hq, Dh]
        return self.output(o[None], gate[None], x.dtype)[0], pages.reshape(pool.shape)
