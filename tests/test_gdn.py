"""Gated DeltaNet: chunked == recurrent == step-by-step, carried states, conv1d, and parity with transformers'
reference functions and `Qwen3_5MoeGatedDeltaNet` layer (including its cache states)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import BF16_EPS, assert_close, gdn_terms, rule_terms, to_torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import qwen35
from qwen35 import gdn
from qwen35.parity import hf_text_config


def make_inputs(rng, B, T, H, Dk, Dv, *, state=False, g_scale=1.0):
    f = np.float32
    q = rng.standard_normal((B, T, H, Dk)).astype(f)
    k = rng.standard_normal((B, T, H, Dk)).astype(f)
    v = rng.standard_normal((B, T, H, Dv)).astype(f)
    g = (-g_scale * np.abs(rng.standard_normal((B, T, H)))).astype(f)
    beta = rng.uniform(0.05, 1.0, size=(B, T, H)).astype(f)
    S0 = rng.standard_normal((B, H, Dk, Dv)).astype(f) if state else None
    return q, k, v, g, beta, S0


# ---------------------------------------------------------------------------------------------------------
# The math: three forms of the same rule
@pytest.mark.parametrize("T", [1, 5, 64, 65, 130])
@pytest.mark.parametrize("state", [False, True])
def test_chunked_equals_recurrent(rng, T, state):
    q, k, v, g, beta, S0 = make_inputs(rng, 2, T, 3, 16, 24, state=state)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=True)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=True)
    assert o_c.shape == (2, T, 3, 24) and s_c.shape == (2, 3, 16, 24) and s_c.dtype == jnp.float32
    assert_close(o_c, o_r, terms=rule_terms(T, 16), name="o")
    assert_close(s_c, s_r, terms=rule_terms(T, 16), name="state")


@settings(max_examples=6, deadline=None)
@given(
    T=st.integers(1, 150),
    H=st.integers(1, 3),
    Dk=st.sampled_from([4, 8, 16]),
    Dv=st.sampled_from([4, 12, 16]),
    chunk=st.sampled_from([8, 16, 64]),
    state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_recurrent_random_shapes(T, H, Dk, Dv, chunk, state, seed):
    rng = np.random.default_rng(seed)
    q, k, v, g, beta, S0 = make_inputs(rng, 1, T, H, Dk, Dv, state=state)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=True)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, initial_state=S0, use_qk_l2norm=True)
    assert_close(o_c, o_r, terms=rule_terms(T, Dk, chunk), name="o")
    assert_close(s_c, s_r, terms=rule_terms(T, Dk, chunk), name="state")


def test_closed_form_single_token(rng):
    """One token from a known state, by hand: S' = e^g S + beta k (v - e^g Sᵀk)ᵀ, o = S'ᵀ (q / sqrt(Dk))."""
    q, k, v, g, beta, S0 = make_inputs(rng, 1, 1, 1, 4, 3, state=True)
    S = np.exp(g[0, 0, 0]) * S0[0, 0]
    kt, vt, qt = k[0, 0, 0], v[0, 0, 0], q[0, 0, 0] / 2.0
    S_new = S + beta[0, 0, 0] * np.outer(kt, vt - S.T @ kt)
    o, s = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0)
    assert_close(s[0, 0], S_new, terms=4, name="state")  # Sᵀk over Dk = 4
    assert_close(o[0, 0, 0], S_new.T @ qt, terms=8, name="o")  # then S'ᵀq over Dk


def test_strong_decay_stays_finite(rng):
    """Cumulative log-decays of hundreds inside a chunk: the chunked form must not overflow."""
    q, k, v, g, beta, _ = make_inputs(rng, 1, 128, 2, 8, 8, g_scale=20.0)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    assert np.isfinite(np.asarray(o_c)).all()
    assert_close(o_c, o_r, terms=rule_terms(128, 8))


def test_decode_steps_equal_prefill(rng):
    q, k, v, g, beta, S0 = make_inputs(rng, 2, 9, 2, 8, 12, state=True)
    o_full, s_full = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=True)
    step = jax.jit(lambda *a: gdn.gated_delta_rule_step(*a, use_qk_l2norm=True))
    S = jnp.asarray(S0)
    for t in range(9):
        o_t, S = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S)
        assert_close(o_t, o_full[:, t], terms=rule_terms(9, 8), scale=np.max(np.abs(o_full)), name=f"o[{t}]")
    assert_close(S, s_full, terms=rule_terms(9, 8), name="state")


@pytest.mark.parametrize("split", [1, 30, 64, 70])
def test_split_prefill_equals_one_call(rng, split):
    q, k, v, g, beta, _ = make_inputs(rng, 1, 100, 2, 8, 12)
    kw = dict(use_qk_l2norm=True)
    o_full, s_full = gdn.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o1, s1 = gdn.chunk_gated_delta_rule(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split], **kw)
    o2, s2 = gdn.chunk_gated_delta_rule(q[:, split:], k[:, split:], v[:, split:], g[:, split:], beta[:, split:],
                                        initial_state=s1, **kw)
    assert_close(np.concatenate([o1, o2], axis=1), o_full, terms=rule_terms(100, 8), name="o")
    assert_close(s2, s_full, terms=rule_terms(100, 8), name="state")


def test_dtypes_and_jit(rng):
    q, k, v, g, beta, S0 = make_inputs(rng, 1, 40, 2, 8, 8, state=True)
    f = jax.jit(lambda q, k, v, g, b, s: gdn.chunk_gated_delta_rule(q, k, v, g, b, initial_state=s, use_qk_l2norm=True))
    o, s = f(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(S0))
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o32, _ = gdn.chunk_gated_delta_rule(*(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k, v)),
                                        g, beta, initial_state=S0, use_qk_l2norm=True)
    # the same bf16-rounded inputs: what differs is bf16 intermediates and the bf16 output, a few bf16 ulps
    assert_close(np.asarray(o, np.float32), o32, atol=4 * BF16_EPS * float(np.max(np.abs(o32))), name="bf16 o")


def test_bad_inputs_name_the_tensors(rng):
    q, k, v, g, beta, _ = make_inputs(rng, 1, 8, 2, 8, 8)
    with pytest.raises(ValueError, match=r"v .* must match q"):
        gdn.chunk_gated_delta_rule(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="q and k"):
        gdn.recurrent_gated_delta_rule(q, k[..., :4], v, g, beta)
    with pytest.raises(ValueError, match="beta"):
        gdn.chunk_gated_delta_rule(q, k, v, g, beta[:, :4])
    with pytest.raises(ValueError, match="initial_state"):
        gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=np.zeros((1, 2, 8, 9), np.float32))
    with pytest.raises(ValueError, match="floating"):
        gdn.chunk_gated_delta_rule(q.astype(np.int32), k, v, g, beta)


# ---------------------------------------------------------------------------------------------------------
# Against transformers' own reference functions
@pytest.mark.parametrize("T,state", [(1, True), (37, False), (64, True), (150, True)])
def test_rule_matches_transformers(rng, T, state):
    q, k, v, g, beta, S0 = make_inputs(rng, 2, T, 4, 16, 24, state=state)
    t = to_torch
    init = None if S0 is None else t(S0)
    o_hc, s_hc = hf.torch_chunk_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), initial_state=init,
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_hr, s_hr = hf.torch_recurrent_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), initial_state=init,
                                                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, s_c = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=True)
    o_r, s_r = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0, use_qk_l2norm=True)
    terms = rule_terms(T, 16)
    assert_close(o_c, o_hc.numpy(), terms=terms, name="chunk o")
    assert_close(s_c, s_hc.numpy(), terms=terms, name="chunk state")
    assert_close(o_r, o_hr.numpy(), terms=terms, name="recurrent o")
    assert_close(s_r, s_hr.numpy(), terms=terms, name="recurrent state")


@pytest.mark.parametrize("T", [1, 3, 10])
def test_conv1d_matches_transformers(rng, T):
    B, C, Kc = 2, 12, 4
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, 1, Kc)).astype(np.float32)
    y, state = gdn.causal_conv1d(x, w)
    y_hf = hf.causal_conv1d_fn(to_torch(x).transpose(1, 2), to_torch(w)[:, 0], None, activation="silu")
    assert_close(y, y_hf.transpose(1, 2).numpy(), terms=Kc, name="conv")  # a Kc-tap conv, then silu
    # continuation from the state, token by token, against transformers' update
    st_t = to_torch(np.asarray(state)).clone()
    st_j = state
    for _ in range(3):
        x1 = rng.standard_normal((B, C)).astype(np.float32)
        y_hf = hf.causal_conv1d_update(to_torch(x1)[:, :, None], st_t, to_torch(w)[:, 0], None, "silu")
        y1, st_j = gdn.causal_conv1d_update(x1, w, st_j)
        assert_close(y1, y_hf[:, :, 0].numpy(), terms=Kc, name="conv update")
        assert_close(st_j, st_t.numpy(), atol=0)


def test_conv1d_split_equals_one_call(rng):
    x = rng.standard_normal((2, 11, 6)).astype(np.float32)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    y, s = gdn.causal_conv1d(x, w)
    y1, s1 = gdn.causal_conv1d(x[:, :2], w)
    y2, s2 = gdn.causal_conv1d(x[:, 2:], w, s1)
    assert_close(np.concatenate([y1, y2], 1), y, terms=4)  # a 4-tap conv
    assert_close(s2, s, atol=0)
    with pytest.raises(ValueError, match="conv_state"):
        gdn.causal_conv1d(x, w, np.zeros((2, 6, 3), np.float32))


# ---------------------------------------------------------------------------------------------------------
# The layer against transformers' Qwen3_5MoeGatedDeltaNet, including its cache
hf_config = hf_text_config


def copy_gdn_weights(torch_layer, layer: gdn.GatedDeltaNet):
    sd = {k: v.detach().numpy() for k, v in torch_layer.state_dict().items()}
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d", "norm"):
        getattr(layer, name).weight.value = jnp.asarray(sd[f"{name}.weight"])
    layer.dt_bias.value = jnp.asarray(sd["dt_bias"])
    layer.A_log.value = jnp.asarray(sd["A_log"])


GDN_CONFIGS = {
    "tiny": qwen35.tiny(),
    "odd": qwen35.tiny(hidden_size=40, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
                       linear_value_head_dim=20, linear_conv_kernel_dim=3),
}


@pytest.mark.parametrize("name", sorted(GDN_CONFIGS))
def test_layer_matches_transformers_with_cache(rng, name):
    cfg = GDN_CONFIGS[name]
    hcfg = hf_config(cfg)
    torch.manual_seed(0)
    t_layer = hf.Qwen3_5MoeGatedDeltaNet(hcfg, layer_idx=0).eval()
    with torch.no_grad():  # non-trivial norm weight and dt_bias so layout mistakes show
        t_layer.norm.weight.uniform_(0.5, 1.5)
        t_layer.dt_bias.uniform_(-1.0, 1.0)
    layer = gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    copy_gdn_weights(t_layer, layer)

    B, T0 = 2, 70
    x = rng.standard_normal((B, T0 + 3 + 4, cfg.hidden_size)).astype(np.float32)
    cache = DynamicCache(config=hcfg)
    with torch.no_grad():
        y_full_hf = t_layer(to_torch(x)).numpy()  # no cache: one forward over everything
    call = nnx.jit(lambda m, x, s: m(x, s))
    y_full, _ = call(layer, jnp.asarray(x), None)
    terms, scale = gdn_terms(cfg, x.shape[1]), float(np.max(np.abs(y_full_hf)))
    assert_close(y_full, y_full_hf, terms=terms, name="no-cache forward")

    pieces = [(0, T0)] + [(T0 + i, T0 + i + 1) for i in range(3)] + [(T0 + 3, T0 + 7)]  # prefill, 3 decodes, 4-token continuation
    state = None
    for a, b in pieces:
        with torch.no_grad():
            y_hf = t_layer(to_torch(x[:, a:b]), cache=cache).numpy()
        y, state = call(layer, jnp.asarray(x[:, a:b]), state)
        assert_close(y, y_hf, terms=terms, scale=scale, name=f"tokens {a}:{b}")
        assert_close(y, y_full[:, a:b], terms=terms, scale=scale, name=f"tokens {a}:{b} vs one forward")
        assert_close(state.conv, cache.layers[0].conv_states[0].numpy(), terms=cfg.hidden_size,
                     name=f"conv state after {b}")  # the in_proj_qkv outputs, H-term sums
        assert_close(state.recurrent, cache.layers[0].recurrent_states[0].numpy(),
                     terms=terms, name=f"recurrent state after {b}")


def test_layer_bad_input():
    layer = gdn.GatedDeltaNet(qwen35.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="GatedDeltaNet expects"):
        layer(jnp.zeros((2, 5, 7)))


def test_default_chunk_size():
    """The XLA path on CPU uses C = 16 (benchmarks/gdn.py --chunk-sweep), the Pallas kernels 64; a bad path or chunk
    size is refused; a module built with none runs the default (`chunk_for`) and matches its own token-by-token
    recurrent decode."""
    assert gdn.default_chunk_size() == (16 if jax.default_backend() == "cpu" else 64)
    assert gdn.default_chunk_size("pallas") == 64
    with pytest.raises(ValueError, match="kernels must be one of"):
        gdn.default_chunk_size("triton")
    cfg = qwen35.get_preset("tiny")
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0), chunk_size=0)
    layer = gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    assert layer.chunk_size is None and layer.chunk_for() == gdn.default_chunk_size()
    pallas = gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0), execution=qwen35.Execution(kernels="pallas"))
    assert pallas.chunk_for() == 64 and gdn.GatedDeltaNet(cfg, rngs=nnx.Rngs(0), chunk_size=8).chunk_for() == 8
    x = jax.random.normal(jax.random.key(1), (2, 37, cfg.hidden_size), jnp.float32)
    with jax.default_matmul_precision("highest"):
        y, st = layer(x)
        # the same layer token by token (the single-token recurrent step from the cached state)
        state, ys = layer.init_state(2), []
        for t in range(x.shape[1]):
            y_t, state = layer(x[:, t:t + 1], state)
            ys.append(y_t)
    terms = gdn_terms(cfg, x.shape[1])
    assert_close(jnp.concatenate(ys, axis=1), y, terms=terms, name="token by token vs one call")
    assert_close(state.recurrent, st.recurrent, terms=terms, name="state")
