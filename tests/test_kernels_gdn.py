"""The GDN Pallas kernels (chunked prefill over packed ragged batches, fused decode) against their references, in
TPU interpret mode with race detection; their TPU lowering; and `kernels="pallas"` against `kernels="xla"` for a
GatedDeltaNet layer and the tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc
from helpers import BF16_EPS, assert_close, fp32_tol, gdn_terms, rule_terms
from jax.experimental.pallas import tpu as pltpu

from qwen35.execution import Execution
from qwen35.config import tiny
from qwen35.gdn import GatedDeltaNet, recurrent_gated_delta_rule
from qwen35.kernels.chunked_gdn import (chunked_gdn_conv_packed, chunked_gdn_conv_reference, chunked_gdn_packed,
                                        chunked_gdn_reference)
from qwen35.kernels.fused_gdn_decode import fused_gdn_decode, fused_gdn_decode_reference

RACES = pltpu.InterpretParams(detect_races=True)


@pytest.fixture(autouse=True)
def _reset_interpret_state():
    """A failed interpreted kernel leaves TPU-interpret state behind; clear it so the next test starts clean."""
    yield
    pltpu.reset_tpu_interpret_mode_state()


def assert_no_races():
    assert _ipc.races is not None, "no kernel ran with race detection"
    assert not _ipc.races.races_found, "the race detector reported a data race"


def _gdn_inputs(rng, T, Hk, Hv, Dk, Dv, N, dtype=jnp.float32):
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = f(T, Hk, Dk).astype(dtype), f(T, Hk, Dk).astype(dtype), f(T, Hv, Dv).astype(dtype)
    g = -jnp.asarray(rng.uniform(0.01, 1.5, (T, Hv)), jnp.float32)  # log-decay <= 0
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (T, Hv)), jnp.float32)
    S0 = f(N, Hv, Dk, Dv)
    return q, k, v, g, beta, S0


# ------------------------------------------------------------------------------------------------------------
# Chunked GDN (prefill)
CHUNK_CASES = [
    # lens (packed, ragged), Hk, Hv, Dk, Dv, chunk, initial state, dtype
    pytest.param([5, 0, 1, 17, 8], 1, 2, 16, 8, 8, True, jnp.float32,
                 id="ragged-empty-len1-notmultiple-exact-carried-state"),
    pytest.param([9, 12], 2, 2, 16, 16, 8, False, jnp.bfloat16, id="bf16-zero-state"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lens, Hk, Hv, Dk, Dv, C, with_state, dtype", CHUNK_CASES)
def test_chunked_gdn_packed_matches_reference(rng, lens, Hk, Hv, Dk, Dv, C, with_state, dtype):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v, g, beta, S0 = _gdn_inputs(rng, int(cu[-1]), Hk, Hv, Dk, Dv, len(lens), dtype)
    S0 = S0 if with_state else None
    o, S = chunked_gdn_packed(q, k, v, g, beta, jnp.asarray(cu), initial_state=S0, use_qk_l2norm=True,
                              chunk_size=C, interpret=RACES)
    assert_no_races()
    ro, rS = chunked_gdn_reference(q, k, v, g, beta, cu, initial_state=S0, use_qk_l2norm=True, chunk_size=C)
    assert o.shape == ro.shape and o.dtype == q.dtype and S.dtype == jnp.float32
    # both compute in float32 (from the same bf16 inputs in the bf16 case); a bf16 output adds its own rounding:
    # two float32 values within the rule may round to neighbouring bf16 values, one bf16 ulp apart
    terms = rule_terms(max(lens), Dk, C)
    o32, ro32 = np.asarray(o, np.float32), np.asarray(ro, np.float32)
    atol = fp32_tol(np.max(np.abs(ro32)), terms) + (BF16_EPS * np.max(np.abs(ro32)) if dtype == jnp.bfloat16 else 0)
    assert_close(o32, ro32, atol=atol, name="o")
    assert_close(S, rS, terms=terms, name="state")
    if with_state and 0 in lens:  # an empty prompt passes its initial state through untouched
        s = lens.index(0)
        np.testing.assert_array_equal(S[s], S0[s])


@pytest.mark.timeout(120)
def test_chunked_gdn_equals_the_recurrent_rule_without_l2norm(rng):
    """Against the token-by-token rule (an independent reference), raw q/k with a custom scale, grouped heads."""
    Hk, Hv, Dk, Dv = 1, 2, 8, 8  # two prompts of 11 and 6 tokens
    cu = np.array([0, 11, 17], np.int32)
    q, k, v, g, beta, S0 = _gdn_inputs(rng, 17, Hk, Hv, Dk, Dv, 2)
    q, k = 0.3 * q, 0.3 * k  # |A_ij| stays O(1) without the norm
    o, S = chunked_gdn_packed(q, k, v, g, beta, jnp.asarray(cu), initial_state=S0, scale=0.5, chunk_size=8,
                              interpret=RACES)
    assert_no_races()
    for s in range(2):
        a, b = cu[s], cu[s + 1]
        ro, rS = recurrent_gated_delta_rule(jnp.repeat(q[None, a:b], 2, 2), jnp.repeat(k[None, a:b], 2, 2),
                                            v[None, a:b], g[None, a:b], beta[None, a:b], initial_state=S0[s:s + 1],
                                            scale=0.5)
        assert_close(o[a:b], ro[0], terms=rule_terms(b - a, Dk, 8), name=f"o of sequence {s}")
        assert_close(S[s], rS[0], terms=rule_terms(b - a, Dk, 8), name=f"state of sequence {s}")


@pytest.mark.parametrize("change, match", [
    (dict(q=jnp.zeros((5, 1, 16))), "q and k must have the same shape"),
    (dict(v=jnp.zeros((5, 3, 8))), "not a multiple of"),
    (dict(g=jnp.zeros((5,))), r"g must be \[T, Hv\]"),
    (dict(cu_seqlens=jnp.array([0.0, 5.0])), "cu_seqlens must be integer"),
    (dict(cu_seqlens=jnp.array([0, 3, 7], jnp.int32)), "end at T=5"),
    (dict(initial_state=jnp.zeros((2, 2, 16, 8))), "initial_state must be"),
])
def test_chunked_gdn_bad_input_is_a_clear_error(change, match):
    args = dict(q=jnp.zeros((5, 2, 16)), k=jnp.zeros((5, 2, 16)), v=jnp.zeros((5, 2, 8)), g=jnp.zeros((5, 2)),
                beta=jnp.zeros((5, 2)), cu_seqlens=jnp.array([0, 5], jnp.int32), initial_state=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        chunked_gdn_packed(**args)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_chunked_gdn_lowers_for_tpu(dtype):
    T, Hk, Hv, D, N = 512, 2, 4, 128, 3
    sds = jax.ShapeDtypeStruct
    f = lambda q, k, v, g, b, cu, s0: chunked_gdn_packed(q, k, v, g, b, cu, initial_state=s0,  # noqa: E731
                                                         use_qk_l2norm=True, chunk_size=64, interpret=False)
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
        sds((T, Hk, D), dtype), sds((T, Hk, D), dtype), sds((T, Hv, D), dtype), sds((T, Hv), jnp.float32),
        sds((T, Hv), jnp.float32), sds((N + 1,), jnp.int32), sds((N, Hv, D, D), jnp.float32))
    assert "tpu_custom_call" in exp.mlir_module()


# ------------------------------------------------------------------------------------------------------------
# The causal conv fused into the chunked kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_conv_fused_chunked_gdn_matches_conv_then_rule(rng, dtype):
    """Raw q | k | v columns in, against `causal_conv1d` per sequence then the chunked rule: ragged lengths (an
    empty prompt, prompts shorter than the conv width 4, one spanning three chunks), carried conv and recurrent
    states, grouped heads; the new conv state is each sequence's last 4 inputs (partly the old state's for the
    short ones)."""
    lens, Hk, Hv, Dk, Dv, Kc, C = [5, 0, 2, 17, 3], 1, 2, 16, 8, 4, 8
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T, N, cd = int(cu[-1]), len(lens), 2 * Hk * Dk + Hv * Dv
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    mixed, w, cs, S0 = f(T, cd).astype(dtype), 0.5 * f(cd, Kc), f(N, cd, Kc).astype(dtype), f(N, Hv, Dk, Dv)
    g = -jnp.asarray(rng.uniform(0.01, 1.5, (T, Hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (T, Hv)), jnp.float32)
    kw = dict(num_k_heads=Hk, head_k_dim=Dk, conv_state=cs, initial_state=S0, chunk_size=C)
    o, S, ncs = chunked_gdn_conv_packed(mixed, w, g, beta, jnp.asarray(cu), interpret=RACES, **kw)
    assert_no_races()
    ro, rS, rcs = chunked_gdn_conv_reference(mixed, w, g, beta, cu, **kw)
    assert o.dtype == ncs.dtype == dtype and S.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ncs, np.float32), np.asarray(rcs, np.float32))  # copies, no math
    np.testing.assert_array_equal(np.asarray(ncs[1]), np.asarray(cs[1]))  # the empty prompt keeps its state
    # The kernel convolves in float32; the reference in the activations' dtype (bf16 rounds each conv output).
    terms = rule_terms(max(lens), Dk, C) + Kc
    ro32 = np.asarray(ro, np.float32)
    atol = (fp32_tol(np.max(np.abs(ro32)), terms) if dtype == jnp.float32
            else 8 * BF16_EPS * max(1.0, np.max(np.abs(ro32))))
    assert_close(np.asarray(o, np.float32), ro32, atol=atol, name="o")
    if dtype == jnp.float32:
        assert_close(S, rS, terms=terms, name="state")
    with pytest.raises(ValueError, match="chunk_size 2 must be at least the conv width 4"):
        chunked_gdn_conv_packed(mixed, w, g, beta, jnp.asarray(cu), **(kw | dict(chunk_size=2)))
    with pytest.raises(ValueError, match="conv_state must be"):
        chunked_gdn_conv_packed(mixed, w, g, beta, jnp.asarray(cu), **(kw | dict(conv_state=cs[:, :, :3])))


@pytest.mark.timeout(120)
def test_conv_fused_chunked_gdn_lowers_for_tpu():
    T, Hk, Hv, D, N, Kc = 512, 2, 4, 128, 3, 4
    cd = 2 * Hk * D + Hv * D
    sds = jax.ShapeDtypeStruct
    f = lambda x, w, g, b, cu, cs, s0: chunked_gdn_conv_packed(  # noqa: E731
        x, w, g, b, cu, num_k_heads=Hk, head_k_dim=D, conv_state=cs, initial_state=s0, chunk_size=64,
        interpret=False)
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
        sds((T, cd), jnp.bfloat16), sds((cd, Kc), jnp.bfloat16), sds((T, Hv), jnp.float32), sds((T, Hv), jnp.float32),
        sds((N + 1,), jnp.int32), sds((N, cd, Kc), jnp.bfloat16), sds((N, Hv, D, D), jnp.float32))
    assert "tpu_custom_call" in exp.mlir_module()


# ------------------------------------------------------------------------------------------------------------
# Fused decode
def _decode_inputs(rng, B, Hk, Hv, Dk, Dv, Kc, state_dtype=jnp.float32, x_dtype=jnp.float32):
    cd = 2 * Hk * Dk + Hv * Dv
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    return (f(B, cd).astype(x_dtype), f(B, Hv).astype(x_dtype), f(B, Hv).astype(x_dtype),
            f(B, cd, Kc).astype(x_dtype), f(B, Hv, Dk, Dv).astype(state_dtype), 0.5 * f(cd, Kc),
            jnp.log(jnp.linspace(0.05, 2.0, Hv)), 0.5 * f(Hv))


DECODE_CASES = [
    pytest.param(3, 2, 4, 16, 24, 4, None, jnp.float32, id="tiny-preset-heads"),
    pytest.param(16, 1, 2, 8, 16, 3, 8, jnp.bfloat16, id="two-batch-blocks-bf16-state"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("B, Hk, Hv, Dk, Dv, Kc, block_b, state_dtype", DECODE_CASES)
def test_fused_decode_matches_reference(rng, B, Hk, Hv, Dk, Dv, Kc, block_b, state_dtype):
    args = _decode_inputs(rng, B, Hk, Hv, Dk, Dv, Kc, state_dtype)
    kw = dict(num_k_heads=Hk, head_k_dim=Dk, head_v_dim=Dv)
    o, conv, S = fused_gdn_decode(*args, **kw, block_b=block_b, interpret=RACES)
    assert_no_races()
    ro, rconv, rS = fused_gdn_decode_reference(*args, **kw)
    assert S.dtype == state_dtype and o.shape == (B, Hv, Dv)
    np.testing.assert_array_equal(conv, rconv)  # the conv state is only shifted
    terms = Kc + Dk + rule_terms(1, Dk, 1)  # the conv's taps, the l2norm, one step of the rule
    assert_close(o, ro, terms=terms, name="o")
    S32, rS32 = np.asarray(S, np.float32), np.asarray(rS, np.float32)
    if state_dtype == jnp.bfloat16:  # same fp32 math, one bf16 rounding of the new state: at most 1 ulp apart
        assert_close(S32, rS32, atol=fp32_tol(np.max(np.abs(rS32)), terms), rtol=BF16_EPS, name="bf16 state")
    else:
        assert_close(S32, rS32, terms=terms, name="state")


@pytest.mark.timeout(120)
def test_bf16_state_drift_over_a_long_decode(rng):
    """1024 decode steps through the kernel with a bf16 state against the fp32 reference. Measured (this seed):
    the output's error relative to its largest entry settles near 1e-2 (it does not grow: the decay forgets old
    rounding) with peaks of a few 1e-2; the state's relative Frobenius error stays around 1e-2. The bounds are
    loose (5×) on purpose: they catch a broken bf16 path (errors of O(1)), not seed noise. The kernel runs in the
    generic interpreter here (it has no DMAs or semaphores): 1024 TPU-interpreted steps would take minutes."""
    B, Hk, Hv, Dk, Dv, Kc, N = 2, 1, 2, 16, 16, 4, 1024
    cd = 2 * Hk * Dk + Hv * Dv
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    X, A, Bg = f(N, B, cd), f(N, B, Hv) + 2.0, f(N, B, Hv)
    w, A_log, dt_bias = 0.5 * f(cd, Kc), jnp.log(jnp.linspace(0.01, 1.0, Hv)), 0.1 * f(Hv) - 4.0
    kw = dict(num_k_heads=Hk, head_k_dim=Dk, head_v_dim=Dv)

    def run(state_dtype, step_fn):
        def step(carry, xs):
            o, conv, S = step_fn(*xs, *carry, w, A_log, dt_bias, **kw)
            return (conv, S), o
        init = (jnp.zeros((B, cd, Kc)), jnp.zeros((B, Hv, Dk, Dv), state_dtype))
        (_, S), o = jax.lax.scan(step, init, (X, A, Bg))
        return o, S

    o16, S16 = jax.jit(lambda: run(jnp.bfloat16, lambda *a, **k: fused_gdn_decode(*a, **k, interpret=True)))()
    o32, S32 = jax.jit(lambda: run(jnp.float32, fused_gdn_decode_reference))()
    o16, o32 = np.asarray(o16).reshape(N, -1), np.asarray(o32).reshape(N, -1)
    err = np.abs(o16 - o32).max(1) / np.abs(o32).max(1)
    S16, S32 = np.asarray(S16, np.float32), np.asarray(S32)
    state_err = np.linalg.norm(S16 - S32) / np.linalg.norm(S32)
    assert err[0] < 1e-6  # the first token reads a zero state: no rounding yet
    assert np.median(err[N // 2:]) < 5e-2 and err.max() < 0.2, (np.median(err[N // 2:]), err.max())
    assert np.median(err[N // 2:]) < 3 * np.median(err[N // 8:N // 4]) + 1e-3  # no runaway growth
    assert 1e-4 < state_err < 5e-2, state_err  # a bf16 state is visibly rounded, but only by ~1e-2


@pytest.mark.parametrize("change, match", [
    (dict(x_qkv=jnp.zeros((3, 10))), "columns but"),
    (dict(a=jnp.zeros((3, 3))), r"a must be \[B, Hv\]"),
    (dict(state=jnp.zeros((3, 4, 16, 24), jnp.float16)), "float32 or bfloat16"),
    (dict(block_b=2), "must divide the batch"),
])
def test_fused_decode_bad_input_is_a_clear_error(rng, change, match):
    names = ["x_qkv", "a", "b", "conv_state", "state", "conv_w", "A_log", "dt_bias"]
    args = dict(zip(names, _decode_inputs(rng, 3, 2, 4, 16, 24, 4)))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fused_gdn_decode(**args, num_k_heads=2, head_k_dim=16, head_v_dim=24)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_fused_decode_lowers_for_tpu(state_dtype):
    B, Hk, Hv, D, Kc = 64, 16, 64, 128, 4  # the 397B model's GDN heads, a 64-sequence decode batch
    cd = 2 * Hk * D + Hv * D
    sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    f = lambda *a: fused_gdn_decode(*a, num_k_heads=Hk, head_k_dim=D, head_v_dim=D, interpret=False)  # noqa: E731
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
        sds((B, cd), bf), sds((B, Hv), bf), sds((B, Hv), bf), sds((B, cd, Kc), bf), sds((B, Hv, D, D), state_dtype),
        sds((cd, Kc), bf), sds((Hv,), jnp.float32), sds((Hv,), jnp.float32))
    assert "tpu_custom_call" in exp.mlir_module()


# ------------------------------------------------------------------------------------------------------------
# kernels="pallas" in the layer and the model
@pytest.mark.timeout(240)
def test_gdn_layer_pallas_equals_xla(rng):
    """Prefill (T not a multiple of the chunk), two decode tokens through the fused kernel, then a 3-token
    continuation through the chunked kernel from the cached state (grouped heads Hv = 2·Hk, batch 2)."""
    cx = tiny()
    lx = GatedDeltaNet(cx, rngs=nnx.Rngs(0), chunk_size=8)
    lp = GatedDeltaNet(cx, rngs=nnx.Rngs(0), chunk_size=8, execution=Execution(kernels="pallas"))
    call = nnx.jit(lambda layer, x, state: layer(x, state))
    x = jnp.asarray(rng.standard_normal((2, 16, cx.hidden_size)), jnp.float32)
    sx = sp = None
    terms = gdn_terms(cx, 16, chunk=8)
    for a, b in ((0, 11), (11, 12), (12, 13), (13, 16)):
        yx, sx = call(lx, x[:, a:b], sx)
        yp, sp = call(lp, x[:, a:b], sp)
        assert_close(yp, yx, terms=terms, name=f"tokens {a}:{b}")
        assert_close(sp.recurrent, sx.recurrent, terms=terms, name=f"state after {b}")
        assert_close(sp.conv, sx.conv, terms=cx.hidden_size, name=f"conv state after {b}")  # in_proj outputs


# The whole tiny model with kernels="pallas" (these GDN kernels and the attention kernel together) against
# kernels="xla", prefill and two decode steps: tests/test_kernels_attention.py::test_model_pallas_backend_matches_xla.


# ------------------------------------------------------------------------------------------------------------
# The benchmark's cases
@pytest.mark.timeout(120)
def test_benchmark_cases_split_by_backend_and_a_cpu_case_runs():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "kernels_gdn.py"
    spec = importlib.util.spec_from_file_location("bench_kernels_gdn", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    kinds = {c.kernel for c in mod.CASES}
    assert kinds == {"chunked_gdn", "fused_gdn_decode", "paged_gdn_decode", "paged_conv_gdn_decode",
                     "reduce_scatter"}
    for c in mod.CASES:  # on this CPU: the realistic sizes say why they skip, the correctness sizes apply
        ok, why = c.applies("cpu", 8)
        assert ok == (c.size == "correctness") and (ok or why)
        assert c.applies("tpu", 8)[0] == (c.size == "realistic")
    for kernel in ("fused_gdn_decode", "paged_gdn_decode", "paged_conv_gdn_decode"):
        case = next(c for c in mod.CASES if c.kernel == kernel and c.size == "correctness")
        row = case.run(repeats=1)
        assert row["kernel_s"] > 0 and row["reference_s"] > 0 and row["flops"] > 0 and row["bytes"] > 0
        assert row["bound"] == "memory" and "interpret" in row["note"]
        assert row["max_rel_err"] <= fp32_tol(1.0, 64)  # relative to the output's size: the rule at scale 1


# ------------------------------------------------------------------------------------------------------------
# The paged decode kernel: states read and written in the serving pool by index
PAGED_CASES = [
    pytest.param(np.float32, 16, id="f32-pool-16-token-pages"),  # a layer's state: 2 whole units
    pytest.param(jnp.bfloat16, 4, id="bf16-pool-4-token-pages"),  # 12 units (two bf16 planes) over several blocks
]


def _scattered_pool(rng, cfg, page_size, dtype):
    """(layout, pool, blocks [4, state_blocks]): the tiny preset's pool, every unit holding random bits, then real
    conv and recurrent states (random bits are not all finite floats) in every GDN layer of three rows with
    scattered state blocks, and a fourth, padding row at NO_BLOCK."""
    from qwen35.serving.cache import init_paged_cache
    from qwen35.pool import NO_BLOCK, pool_layout, write_state

    lay = pool_layout(cfg, page_size, dtype)
    NB = 3 * lay.state_blocks + 4
    pool = init_paged_cache(cfg, NB, page_size, dtype).pool
    pool = jnp.asarray(rng.integers(0, 2 ** 14, pool.shape), pool.dtype)
    ids = rng.permutation(np.arange(1, NB))[:3 * lay.state_blocks].reshape(3, -1)
    blocks = jnp.asarray(np.concatenate([ids, np.full((1, lay.state_blocks), NO_BLOCK)]), jnp.int32)
    shapes = ((cfg.linear_conv_dim, cfg.linear_conv_kernel_dim),
              (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))
    for j in range(cfg.num_linear_layers):
        conv, rec = (jnp.asarray(rng.standard_normal((4, *shape)), jnp.float32) for shape in shapes)
        pool = write_state(cfg, pool, j, blocks, conv, rec)
    return lay, pool, blocks


def _units_written(lay, shape, blocks, j, units):
    """[pool shape] bool: units `units` (a range, within a layer's) of GDN layer j in the three real rows' blocks
    (the kernels write whole units: a part-filled last unit's unused tail too)."""
    written = np.zeros(shape, bool)
    for r in range(3):
        for u in units:
            u += j * lay.layer_units
            written[u % lay.units_per_block, int(blocks[r, u // lay.units_per_block])] = True
    return written


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype, page_size", PAGED_CASES)
def test_paged_decode_matches_gather_rule_scatter(rng, dtype, page_size):
    """`paged_gdn_decode` against its reference (`read_recurrent` gather, `gated_delta_rule_step`, `write_recurrent`
    scatter) on the tiny preset's pool, with scattered state blocks: a row mid-sequence, a fresh row (its stale
    blocks ignored), a padding row at NO_BLOCK (nothing read or written), two GDN layers through one compiled
    program (the layer index traced). Outputs and new states agree to float32 rounding; every pool element outside
    the rows' recurrent units of that layer keeps its bits (the other layers, the conv units, the K/V pages)."""
    from qwen35.kernels.paged_gdn_decode import paged_gdn_decode, paged_gdn_decode_reference
    from qwen35.pool import read_rec

    cfg = tiny()
    Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    B = 4
    lay, pool, blocks = _scattered_pool(rng, cfg, page_size, dtype)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731  (q and k arrive L2-normalised)
    q = jnp.asarray(unit(rng.standard_normal((B, Hv, Dk))), jnp.float32)
    k = jnp.asarray(unit(rng.standard_normal((B, Hv, Dk))), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hv, Dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.01, 1.5, (B, Hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (B, Hv)), jnp.float32)
    fresh = jnp.asarray([False, True, False, False])
    run = jax.jit(lambda p, j: paged_gdn_decode(q, k, v, g, beta, p, blocks, fresh, j, lay, interpret=RACES))
    for j in (1, 4):
        with jax.default_matmul_precision("highest"):
            ro, rpool = paged_gdn_decode_reference(q, k, v, g, beta, pool, blocks, fresh, jnp.int32(j), lay)
        o, new = run(jnp.array(pool, copy=True), jnp.int32(j))
        assert_no_races()
        terms = rule_terms(1, Dk, 1)
        assert_close(np.asarray(o)[:3], np.asarray(ro)[:3], terms=terms, name=f"layer {j} o")
        assert_close(read_rec(cfg, new, j, blocks)[:3], read_rec(cfg, rpool, j, blocks)[:3], terms=terms,
                     name=f"layer {j} new states")
        written = _units_written(lay, pool.shape, blocks, j, range(lay.rec_units))  # the recurrent units
        np.testing.assert_array_equal(np.asarray(new)[~written], np.asarray(pool)[~written])
    assert run._cache_size() == 1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype, page_size", PAGED_CASES)
def test_paged_conv_decode_matches_gather_conv_rule_scatter(rng, dtype, page_size):
    """`paged_conv_gdn_decode` (the engine's decode step with kernels="pallas": conv window, conv + SiLU, gates and
    rule, both states by block id) against gather + `fused_gdn_decode_reference` (`causal_conv1d_update`,
    `gated_delta_rule_step`) + scatter, on the tiny preset's pool with scattered state blocks: a row mid-sequence,
    a fresh row (its stale blocks ignored), a padding row at NO_BLOCK (nothing read or written). Outputs and
    recurrent states agree to float32 rounding, the conv windows bit for bit; every pool element outside the rows'
    units of that layer keeps its bits."""
    from qwen35.kernels.paged_gdn_decode import paged_conv_gdn_decode, paged_conv_gdn_decode_reference
    from qwen35.pool import read_conv, read_rec

    cfg = tiny()
    Hk, Hv, Dk, Dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    C, Kc = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
    B = 4
    lay, pool, blocks = _scattered_pool(rng, cfg, page_size, dtype)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    args = (f(B, C), f(B, Hv), f(B, Hv), 0.5 * f(C, Kc), 0.1 * f(Hv), f(Hv))
    heads = dict(num_k_heads=Hk, head_k_dim=Dk, head_v_dim=Dv)
    fresh = jnp.asarray([False, True, False, False])
    j = 4
    with jax.default_matmul_precision("highest"):
        ro, rpool = paged_conv_gdn_decode_reference(*args, pool, blocks, fresh, jnp.int32(j), lay, **heads)
    o, new = paged_conv_gdn_decode(*args, jnp.array(pool, copy=True), blocks, fresh, jnp.int32(j), lay,
                                   interpret=RACES, **heads)
    assert_no_races()
    terms = rule_terms(1, Dk, 1) + Kc
    assert_close(np.asarray(o)[:3], np.asarray(ro)[:3], terms=terms, name="o")
    assert_close(read_rec(cfg, new, j, blocks)[:3], read_rec(cfg, rpool, j, blocks)[:3], terms=terms,
                 name="new recurrent states")
    np.testing.assert_array_equal(read_conv(cfg, new, j, blocks[:3], jnp.float32),
                                  read_conv(cfg, rpool, j, blocks[:3], jnp.float32))
    written = _units_written(lay, pool.shape, blocks, j, range(lay.layer_units))  # recurrent and conv units
    np.testing.assert_array_equal(np.asarray(new)[~written], np.asarray(pool)[~written])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_paged_conv_decode_lowers_for_tpu(dtype):
    """The Mosaic lowering on the 397B model's pool (256-token pages) for 64 decode rows with bf16 projections."""
    from qwen35.config import get_preset
    from qwen35.kernels.paged_gdn_decode import paged_conv_gdn_decode
    from qwen35.pool import pool_layout

    cfg = get_preset("qwen35-397b-a17b")
    lay = pool_layout(cfg, 256, dtype)
    B, Hv, D, C = 64, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_conv_dim
    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    f = lambda *a: paged_conv_gdn_decode(*a, lay, num_k_heads=cfg.linear_num_key_heads, head_k_dim=D,  # noqa: E731
                                         head_v_dim=D, interpret=False)
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
        sds((B, C), bf16), sds((B, Hv), bf16), sds((B, Hv), bf16), sds((C, cfg.linear_conv_kernel_dim), bf16),
        sds((Hv,), jnp.float32), sds((Hv,), jnp.float32),
        sds((lay.units_per_block, 1000, lay.unit), jnp.uint16 if dtype == jnp.bfloat16 else jnp.uint32),
        sds((B, lay.state_blocks), jnp.int32), sds((B,), jnp.bool_), sds((), jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float32])
def test_paged_decode_lowers_for_tpu(dtype):
    """The Mosaic lowering on the 397B model's pool: 256-token pages (a 4 MiB float32 layer state in 16 units of
    two bf16 planes, or 8 float32 units) and 64 decode rows."""
    from qwen35.config import get_preset
    from qwen35.kernels.paged_gdn_decode import paged_gdn_decode
    from qwen35.pool import pool_layout

    cfg = get_preset("qwen35-397b-a17b")
    lay = pool_layout(cfg, 256, dtype)
    B, Hv, D = 64, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    sds, f32 = jax.ShapeDtypeStruct, jnp.float32
    f = lambda *a: paged_gdn_decode(*a, lay, interpret=False)  # noqa: E731
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(
        sds((B, Hv, D), f32), sds((B, Hv, D), f32), sds((B, Hv, D), f32), sds((B, Hv), f32), sds((B, Hv), f32),
        sds((lay.units_per_block, 1000, lay.unit), jnp.uint16 if dtype == jnp.bfloat16 else jnp.uint32),
        sds((B, lay.state_blocks), jnp.int32), sds((B,), jnp.bool_), sds((), jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()


def test_paged_decode_bad_input_is_a_clear_error():
    from qwen35.kernels.paged_gdn_decode import paged_gdn_decode
    from qwen35.serving.cache import init_paged_cache
    from qwen35.pool import pool_layout

    cfg = tiny()
    lay = pool_layout(cfg, 16, np.float32)
    pool = init_paged_cache(cfg, 8, 16).pool
    z = lambda *s: jnp.zeros(s, jnp.float32)  # noqa: E731
    args = [z(2, 4, 16), z(2, 4, 16), z(2, 4, 24), z(2, 4), z(2, 4), pool, jnp.ones((2, lay.state_blocks), jnp.int32),
            jnp.zeros(2, bool), 0, lay]
    with pytest.raises(ValueError, match=r"blocks must be \[B, state_blocks\]"):
        paged_gdn_decode(*args[:6], jnp.ones((2, 1), jnp.int32), *args[7:])
    with pytest.raises(ValueError, match="pool must be the engine's"):
        paged_gdn_decode(*args[:5], pool.view(jnp.float32), *args[6:])  # values, not the pool's bits
    with pytest.raises(ValueError, match=r"v must be \[B, Hv, Dv\]"):
        paged_gdn_decode(*args[:2], z(3, 4, 24), *args[3:])
    from qwen35.kernels.paged_gdn_decode import paged_conv_gdn_decode

    conv_args = (z(2, cfg.linear_conv_dim), z(2, 4), z(2, 4), z(cfg.linear_conv_dim, 4), z(4), z(4))
    heads = dict(num_k_heads=2, head_k_dim=16, head_v_dim=24)
    with pytest.raises(ValueError, match="is not Kc taps of conv_dim"):
        paged_conv_gdn_decode(*conv_args, pool, *args[6:9], lay._replace(conv_elems=640), **heads)
    with pytest.raises(ValueError, match="x_qkv has"):
        paged_conv_gdn_decode(z(2, 150), *conv_args[1:], pool, *args[6:9], lay, **heads)
