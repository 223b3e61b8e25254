"""Gated GQA: RoPE tables (default and YaRN) and the layer (prefill, cached decode, continuation) against
transformers' Qwen3_5MoeTextRotaryEmbedding / Qwen3_5MoeAttention; the GQA core against the closed-form
reference; jit with a traced cache_index; input errors."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import F32_EPS, assert_close, attention_terms, fp32_tol, to_torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from qwen35.attention import (
    GatedAttention,
    KVCache,
    apply_rope,
    gqa_attention,
    kv_bytes_per_token,
    reference_attention,
    rope_cos_sin,
    rope_inv_freq,
)
from qwen35.config import qwen35_397b_a17b, tiny
from qwen35.parity import hf_text_config

LAYER = 3  # a full-attention layer in the [linear, linear, linear, full] pattern

logging.getLogger("transformers").setLevel(logging.ERROR)  # YaRN factor vs max-positions warnings

YARN_CASES = {
    "yarn-f4": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024),
    "yarn-mscale-notrunc": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=512, mscale=1.0,
                                mscale_all_dim=0.5, truncate=False),
    "yarn-attnfactor-betas": dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=256,
                                  attention_factor=1.3, beta_fast=16, beta_slow=2),
}

CONFIGS = {
    # the tiny preset's head layout: Hq 4, Hkv 2, Dh 32, rd 8
    "tiny": tiny(),
    # an odd one: G = 3 query heads per kv head, Dh 24 with half of it rotating, YaRN with a cos/sin scale
    "odd-yarn": tiny(hidden_size=40, num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                     partial_rotary_factor=0.5, rope_theta=1e6, max_position_embeddings=256, rms_norm_eps=1e-5,
                     rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    # plain multi-head attention (Hq = Hkv), full rotary
    "mha-full-rope": tiny(hidden_size=32, num_attention_heads=3, num_key_value_heads=3, head_dim=16,
                          partial_rotary_factor=1.0),
}


hf_config = hf_text_config


def kv_terms(cfg):
    """Cached keys: the k projection over the hidden size, then k_norm over head_dim (RoPE adds two terms)."""
    return cfg.hidden_size + cfg.head_dim + 2


def hf_cos_sin(cfg, positions):
    rot = hf.Qwen3_5MoeTextRotaryEmbedding(hf_config(cfg))
    return rot(torch.zeros(1), torch.as_tensor(np.asarray(positions))[None])  # each [1, T, rd]


def make_pair(cfg, seed=0):
    """A transformers attention layer with random weights (norms too) and our module holding the same weights."""
    torch.manual_seed(seed)
    ref = hf.Qwen3_5MoeAttention(hf_config(cfg), layer_idx=LAYER).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.ndim == 1 else 0.15))
    mod = nnx.eval_shape(lambda: GatedAttention(cfg, rngs=nnx.Rngs(0)))  # shapes only: every weight is set below
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
        w = getattr(ref, name).weight.detach().numpy()
        dst = getattr(mod, name).weight
        assert dst.shape == w.shape, f"{name}: {dst.shape} vs {w.shape}"
        dst.value = jnp.asarray(w)
    return ref, mod


@nnx.jit
def jit_call(mod, x, cache, cache_index):
    """The layer under jit (a traced cache_index: one compile per shape, not one per position)."""
    return mod(x, cache=cache, cache_index=cache_index)


def causal_mask(T, S, start):
    """Additive [1, 1, T, S] mask: query t (position start + t) sees keys s <= start + t."""
    q_pos = torch.arange(start, start + T)[:, None]
    return torch.where(torch.arange(S)[None, :] <= q_pos, 0.0, float("-inf"))[None, None]


def hf_forward(ref, cfg, x, start=0, cache=None):
    T = x.shape[1]
    cos, sin = hf_cos_sin(cfg, np.arange(start, start + T))
    mask = causal_mask(T, start + T, start) if cache is not None else causal_mask(T, T, 0)
    with torch.no_grad():
        y, _ = ref(to_torch(x), position_embeddings=(cos, sin), attention_mask=mask, cache=cache)
    return y.numpy()


# ------------------------------------------------------------------------------------------------------------
# RoPE tables
@pytest.mark.parametrize("scaling", [None, *YARN_CASES], ids=["default", *YARN_CASES])
@pytest.mark.parametrize("base", ["tiny", "397b"])
def test_rope_tables_match_transformers(base, scaling):
    cfg = tiny() if base == "tiny" else qwen35_397b_a17b()
    if scaling is not None:
        cfg = cfg.replace(rope_scaling=YARN_CASES[scaling])
    rot = hf.Qwen3_5MoeTextRotaryEmbedding(hf_config(cfg))
    inv_freq, scale = rope_inv_freq(cfg)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (cfg.rotary_dim // 2,)
    # theta ** (-2i / rd) in float32 on both sides: a few roundings, relative
    assert_close(inv_freq, rot.inv_freq.numpy(), atol=0, rtol=fp32_tol(1.0), name="inv_freq")
    assert scale == pytest.approx(rot.attention_scaling, rel=1e-12)
    if scaling is None:
        assert scale == 1.0
    positions = np.array([0, 1, 2, 7, 100, 1023, 4095, 65_537])
    cos, sin = rope_cos_sin(positions, inv_freq, scale)
    hcos, hsin = hf_cos_sin(cfg, positions)
    half = cfg.rotary_dim // 2
    # transformers duplicates the table ([..., rd] = cat(t, t)); ours keeps one copy per rotating pair
    assert_close(hcos[0, :, :half], hcos[0, :, half:], atol=0, name="hf cos duplication")
    # float32 angles up to 6.5e4 rad: cos/sin of the same float32 angle (position x inv_freq, one rounding on
    # both sides), so only libm's ulp-level differences on values of size <= scale remain
    assert_close(cos, hcos[0, :, :half].numpy(), terms=1, scale=max(scale, 1.0), name="cos")
    assert_close(sin, hsin[0, :, :half].numpy(), terms=1, scale=max(scale, 1.0), name="sin")


def test_yarn_shape_of_frequencies():
    """YaRN keeps the fast dims, divides the slow ones by `factor`, and ramps in between."""
    cfg = qwen35_397b_a17b()
    f = 4.0
    base, _ = rope_inv_freq(cfg)
    yarn, scale = rope_inv_freq(cfg.replace(rope_scaling=dict(rope_type="yarn", factor=f,
                                                              original_max_position_embeddings=262_144)))
    ratio = base / yarn
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(f, rel=1e-5)
    assert np.all(np.diff(ratio) >= -1e-6), "the ratio ramps monotonically from 1 to factor"
    assert scale == pytest.approx(0.1 * np.log(f) + 1.0)


def test_apply_rope_properties(rng):
    """Partial RoPE: pass-through dims untouched, norms kept, and q·k depends only on the position difference."""
    cfg = tiny()
    rd, Dh = cfg.rotary_dim, cfg.head_dim
    inv, scale = rope_inv_freq(cfg)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, Dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 1, 1, Dh)), jnp.float32)

    def at(x, p):
        c, s = rope_cos_sin(jnp.array([p]), inv, scale)
        return apply_rope(x, c, s, rd)

    assert_close(at(q, 5)[..., rd:], q[..., rd:], atol=0, name="pass-through dims")
    assert_close(jnp.linalg.norm(at(q, 5)), jnp.linalg.norm(q), terms=Dh, name="norm")
    d1 = jnp.sum(at(q, 10) * at(k, 3))
    d2 = jnp.sum(at(q, 107) * at(k, 100))
    # a Dh-term dot of size <= |q||k| (Cauchy-Schwarz), plus the float32 angles' roundings: an angle near
    # 107 rad errs by up to 107·eps/2 rad on each side, moving the dot by that times |q||k|
    qk = float(jnp.linalg.norm(q) * jnp.linalg.norm(k))
    assert_close(d1, d2, atol=fp32_tol(qk, Dh) + 4 * 107 * F32_EPS * qk, name="relative position")
    # against transformers' apply_rotary_pos_emb on [B, N, T, Dh]
    x = rng.standard_normal((2, 5, 3, Dh)).astype(np.float32)
    cos, sin = rope_cos_sin(jnp.arange(5), inv, scale)
    hcos, hsin = hf_cos_sin(cfg, np.arange(5))
    xt = to_torch(x).transpose(1, 2)
    hq, _ = hf.apply_rotary_pos_emb(xt, xt, hcos, hsin)
    # a rotation: x1·cos − x2·sin, two terms
    assert_close(apply_rope(jnp.asarray(x), cos, sin, rd), hq.transpose(1, 2).numpy(), terms=2, name="apply_rope")
    # a per-batch position table [B, T, rd/2] gives the same result
    cos_b, sin_b = rope_cos_sin(jnp.tile(jnp.arange(5), (2, 1)), inv, scale)
    assert_close(apply_rope(jnp.asarray(x), cos_b, sin_b, rd), hq.transpose(1, 2).numpy(), terms=2, name="[B,T] pos")


# ------------------------------------------------------------------------------------------------------------
# The layer against transformers
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_transformers(name, rng):
    cfg = CONFIGS[name]
    ref, mod = make_pair(cfg)
    x = rng.standard_normal((2, 37, cfg.hidden_size)).astype(np.float32)
    y, cache = mod(jnp.asarray(x))
    assert cache is None
    assert_close(y, hf_forward(ref, cfg, x), terms=attention_terms(cfg, 37), name=f"{name} prefill")
    # RoPE positions follow cache_index even without a cache (HF with position ids 11..47)
    y11, _ = mod(jnp.asarray(x), cache_index=11)
    cos, sin = hf_cos_sin(cfg, np.arange(11, 48))
    with torch.no_grad():
        h11, _ = ref(to_torch(x), position_embeddings=(cos, sin), attention_mask=causal_mask(37, 37, 0))
    assert_close(y11, h11.numpy(), terms=attention_terms(cfg, 37), name=f"{name} prefill at offset 11")


@pytest.mark.parametrize("name", ["tiny", "odd-yarn"])
def test_cached_decode_matches_full_forward_and_transformers(name, rng):
    cfg = CONFIGS[name]
    ref, mod = make_pair(cfg, seed=1)
    B, T0, S_max = 2, 13, 24
    steps = [T0, 1, 1, 1, 4]  # prefill, 3 single tokens, a 4-token continuation
    T = sum(steps)
    x = rng.standard_normal((B, T, cfg.hidden_size)).astype(np.float32)
    full, _ = jit_call(mod, jnp.asarray(x), None, 0)
    full_hf = hf_forward(ref, cfg, x)
    terms = attention_terms(cfg, T)
    scale = float(np.max(np.abs(full)))  # one scale for every step: a 1-token step's max is no bound's scale
    assert_close(full, full_hf, terms=terms, name="full forward")

    cache = mod.init_cache(B, S_max, jnp.float32)
    hf_cache = transformers.DynamicCache(config=hf_config(cfg))
    pos = 0
    for n in steps:
        xs = x[:, pos:pos + n]
        y, cache = jit_call(mod, jnp.asarray(xs), cache, jnp.int32(pos))
        assert isinstance(cache, KVCache) and cache.k.shape == (B, S_max, cfg.num_key_value_heads, cfg.head_dim)
        assert_close(y, full[:, pos:pos + n], terms=terms, scale=scale, name=f"cached step at {pos} vs full forward")
        assert_close(y, full_hf[:, pos:pos + n], terms=terms, scale=scale, name=f"cached step at {pos} vs HF full")
        y_hf = hf_forward(ref, cfg, xs, start=pos, cache=hf_cache)
        assert_close(y, y_hf, terms=terms, scale=scale, name=f"cached step at {pos} vs HF with its DynamicCache")
        pos += n
    # the cache holds keys after k_norm and RoPE, exactly HF's cached keys; unused slots stay zero
    hk = hf_cache.layers[LAYER].keys.transpose(1, 2).numpy()
    hv = hf_cache.layers[LAYER].values.transpose(1, 2).numpy()
    assert_close(cache.k[:, :T], hk, terms=kv_terms(cfg), name="cached keys")
    assert_close(cache.v[:, :T], hv, terms=cfg.hidden_size, name="cached values")
    assert not np.any(np.asarray(cache.k[:, T:]))


def test_jit_with_traced_cache_index(rng):
    cfg = CONFIGS["odd-yarn"]
    _, mod = make_pair(cfg, seed=2)
    B, T0, S_max = 1, 9, 16
    x = jnp.asarray(rng.standard_normal((B, T0 + 3, cfg.hidden_size)), jnp.float32)
    full, _ = mod(x)
    terms, scale = attention_terms(cfg, T0 + 3), float(jnp.max(jnp.abs(full)))

    @nnx.jit
    def step(m, xs, cache, idx):
        return m(xs, cache=cache, cache_index=idx)

    cache = mod.init_cache(B, S_max)
    y, cache = step(mod, x[:, :T0], cache, jnp.int32(0))
    assert_close(y, full[:, :T0], terms=terms, scale=scale, name="jit prefill")
    for pos in range(T0, T0 + 3):  # one compiled decode step reused for every position
        y, cache = step(mod, x[:, pos:pos + 1], cache, jnp.int32(pos))
        assert_close(y, full[:, pos:pos + 1], terms=terms, scale=scale, name=f"jit decode at {pos}")

    # plain jax.jit over the split module, too
    graphdef, state = nnx.split(mod)

    @jax.jit
    def step2(state, xs, cache, idx):
        return nnx.merge(graphdef, state)(xs, cache=cache, cache_index=idx)

    cache2 = mod.init_cache(B, S_max)
    _, cache2 = step2(state, x[:, :T0], cache2, jnp.int32(0))
    y2, _ = step2(state, x[:, T0:T0 + 1], cache2, jnp.int32(T0))
    assert_close(y2, full[:, T0:T0 + 1], terms=terms, scale=scale, name="jax.jit decode")


# ------------------------------------------------------------------------------------------------------------
# The core against the closed form
@pytest.mark.parametrize("B,T,S,Hq,Hkv,Dh,offset", [(2, 7, 7, 4, 2, 16, 0), (1, 5, 19, 6, 3, 8, 11),
                                                    (3, 1, 10, 8, 1, 4, 9), (1, 37, 37, 2, 2, 24, 0)])
def test_gqa_core_matches_reference(rng, B, T, S, Hq, Hkv, Dh, offset):
    q = jnp.asarray(rng.standard_normal((B, T, Hq, Dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, Hkv, Dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, Hkv, Dh)), jnp.float32)
    kv_len = offset + T
    got = gqa_attention(q, k, v, q_positions=offset + jnp.arange(T), kv_len=kv_len)
    want = reference_attention(q, k, v, causal_offset=offset, kv_len=kv_len)
    assert_close(got, want, terms=Dh + S, name="gqa vs reference")  # scores over Dh, values over S
    # the reference itself against float64 numpy, one head at a time (head h reads kv head h // (Hq/Hkv))
    qn, kn, vn = (np.asarray(t, np.float64) for t in (q, k, v))
    out = np.zeros((B, T, Hq, Dh))
    for h in range(Hq):
        kh, vh = kn[:, :, h // (Hq // Hkv)], vn[:, :, h // (Hq // Hkv)]
        for t in range(T):
            s = np.einsum("bd,bsd->bs", qn[:, t, h], kh[:, : offset + t + 1]) / np.sqrt(Dh)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, t, h] = np.einsum("bs,bsd->bd", p, vh[:, : offset + t + 1])
    assert_close(want, out, terms=Dh + S, name="reference vs numpy")


@pytest.mark.parametrize("T,block_q", [(37, 8), (37, 37), (64, 16), (5, 1), (300, None)])
def test_gqa_query_blocks_match_reference(rng, T, block_q):
    """Queries in blocks (the default for long inputs) give the reference's result, for causal self-attention
    (q_positions=None: each block also stops at its last query's key) and for queries continuing a cache."""
    B, Hq, Hkv, Dh = 2, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, Hq, Dh)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T + 9, Hkv, Dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T + 9, Hkv, Dh)), jnp.float32)
    got = gqa_attention(q, k[:, :T], v[:, :T], q_positions=None, block_q=block_q)
    assert_close(got, reference_attention(q, k[:, :T], v[:, :T]), terms=Dh + T,
                 name="blocked self-attention")
    off = 5  # T queries at positions 5.., keys up to T + 9 with kv_len T + 5
    got = gqa_attention(q, k, v, q_positions=off + jnp.arange(T), kv_len=off + T, block_q=block_q)
    want = reference_attention(q, k, v, causal_offset=off, kv_len=off + T)
    assert_close(got, want, terms=Dh + T + 9, name="blocked, after a cache")


def test_gqa_self_attention_needs_equal_lengths():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="as many keys as queries"):
        gqa_attention(q, jnp.zeros((1, 6, 1, 8)), jnp.zeros((1, 6, 1, 8)))
    with pytest.raises(ValueError, match="block_q must be >= 1"):
        gqa_attention(q, jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)), block_q=0)


def test_module_matches_closed_form(rng):
    """The whole layer written out with numpy from its weights (projections, norms, RoPE, softmax, gate)."""
    cfg = CONFIGS["odd-yarn"]
    _, mod = make_pair(cfg, seed=3)
    B, T = 2, 11
    x = rng.standard_normal((B, T, cfg.hidden_size))
    Hq, Hkv, Dh, rd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    W = {n: np.asarray(getattr(mod, n).weight[...], np.float64) for n in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "q_norm", "k_norm")}

    def norm(t, w):
        return t / np.sqrt(np.mean(t * t, -1, keepdims=True) + cfg.rms_norm_eps) * (1 + w)

    qg = (x @ W["q_proj"].T).reshape(B, T, Hq, 2 * Dh)
    q, gate = norm(qg[..., :Dh], W["q_norm"]), qg[..., Dh:].reshape(B, T, Hq * Dh)
    k = norm((x @ W["k_proj"].T).reshape(B, T, Hkv, Dh), W["k_norm"])
    v = (x @ W["v_proj"].T).reshape(B, T, Hkv, Dh)
    inv, scale = rope_inv_freq(cfg)
    ang = np.arange(T)[:, None] * inv.astype(np.float64)  # [T, rd/2]
    c, s = (np.cos(ang) * scale)[:, None], (np.sin(ang) * scale)[:, None]

    def rope(t):
        t1, t2 = t[..., : rd // 2], t[..., rd // 2: rd]
        return np.concatenate([t1 * c - t2 * s, t2 * c + t1 * s, t[..., rd:]], -1)

    o = np.asarray(reference_attention(jnp.asarray(rope(q), jnp.float32), jnp.asarray(rope(k), jnp.float32),
                                       jnp.asarray(v, jnp.float32)), np.float64)
    y = (o.reshape(B, T, Hq * Dh) / (1 + np.exp(-gate))) @ W["o_proj"].T
    got, _ = mod(jnp.asarray(x, jnp.float32))
    assert_close(got, y, terms=attention_terms(cfg, T), name="module vs closed form")


def test_bf16_runs_and_stays_close(rng):
    cfg = tiny()
    _, mod = make_pair(cfg, seed=4)
    x = jnp.asarray(rng.standard_normal((1, 9, cfg.hidden_size)), jnp.float32)
    y32, _ = mod(x)
    y16, cache = mod(x.astype(jnp.bfloat16), cache=mod.init_cache(1, 12, jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16 and cache.k.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(y16.astype(jnp.float32) - y32))) < 0.05 * float(jnp.max(jnp.abs(y32))) + 1e-2


# ------------------------------------------------------------------------------------------------------------
def test_kv_bytes_per_token():
    big = qwen35_397b_a17b()
    assert kv_bytes_per_token(big) == 15 * 2 * 2 * 256 * 2 == 30 * 1024
    assert kv_bytes_per_token(big) == big.cache_bytes_per_sequence(1)["kv_bytes_per_token"]
    assert kv_bytes_per_token(tiny(), dtype_bytes=4) == 2 * 2 * 2 * 32 * 4


def test_bad_inputs_raise_clear_errors():
    cfg = tiny()
    mod = nnx.eval_shape(lambda: GatedAttention(cfg, rngs=nnx.Rngs(0)))  # the checks run before any weight is read
    H = cfg.hidden_size
    with pytest.raises(ValueError, match=r"x \[B, T, H=64\], got shape \(2, 5\)"):
        mod(jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match=r"x \[B, T, H=64\], got shape \(1, 5, 63\)"):
        mod(jnp.zeros((1, 5, 63)))
    cache = mod.init_cache(1, 8)
    with pytest.raises(ValueError, match=r"prompt of 9 tokens at position 0 does not fit a cache of 8 tokens; "
                                         r"allocate a larger cache with init_cache\(batch, max_len\)"):
        mod(jnp.zeros((1, 9, H)), cache=cache)
    with pytest.raises(ValueError, match=r"continuation of 3 tokens at position 6 does not fit a cache of 8 tokens"):
        mod(jnp.zeros((1, 3, H)), cache=cache, cache_index=6)
    with pytest.raises(ValueError, match=r"cache_index must be >= 0"):
        mod(jnp.zeros((1, 3, H)), cache=cache, cache_index=-1)
    with pytest.raises(ValueError, match=r"cache.k must be \[B=2, S_max, Hkv=2, Dh=32\], got shape \(1, 8, 2, 32\)"):
        mod(jnp.zeros((2, 3, H)), cache=cache)
    with pytest.raises(ValueError, match=r"cache.v must be"):
        mod(jnp.zeros((1, 3, H)), cache=KVCache(cache.k, jnp.zeros((1, 8, 2, 16))))
    with pytest.raises(ValueError, match=r"cache.k \(1, 8, 2, 32\) and cache.v \(1, 9, 2, 32\) must have the same"):
        mod(jnp.zeros((1, 3, H)), cache=KVCache(cache.k, jnp.zeros((1, 9, 2, 32))))
    with pytest.raises(ValueError, match=r"cos and sin must be \[..., rd/2 = 4\]"):
        apply_rope(jnp.zeros((1, 3, 2, 32)), jnp.zeros((3, 8)), jnp.zeros((3, 8)), 8)
    with pytest.raises(ValueError, match=r"q has 3 heads, not a multiple of the 2 kv heads"):
        reference_attention(jnp.zeros((1, 2, 3, 4)), jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 2, 2, 4)))
