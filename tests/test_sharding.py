"""qwen35.sharding on 8 fake CPU devices (tests/conftest.py), against independent references: the unsharded MoE
(`SparseMoeBlock`, `experts_dense`, `experts_capacity`), the flat `lax` collectives, numpy, and the compiled HLO."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, moe_terms
from pallas_helpers import clean_interpreter  # noqa: F401 (autouse fixture: some tests run interpreted kernels)
from flax import nnx
from jax.sharding import PartitionSpec as P

from qwen35.execution import Execution
from qwen35 import config as C
from qwen35 import sharding as S
from qwen35.model import Qwen35ForCausalLM
from qwen35.moe import SparseMoeBlock, experts_capacity, experts_dense, route

MESHES = {"expert8": dict(expert=8), "data2_expert4": dict(data=2, expert=4)}


def test_eight_fake_devices():
    assert len(jax.devices()) == 8


# ------------------------------------------------------------------------------------------------------------
# Meshes, rules, validation
def test_make_mesh_axes_and_device_count_error():
    for axes in (dict(data=8), dict(data=2, expert=4), dict(chip=4, core=2)):
        mesh = S.make_mesh(**axes)
        assert dict(mesh.shape) == axes and tuple(mesh.axis_names) == tuple(axes)
    chip_core = S.make_mesh(chip=4, core=2)
    assert [[d.id for d in row] for row in chip_core.devices] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(S.ShardingError,
                       match=r"needs 6 devices but there are 8.*xla_force_host_platform_device_count=8"):
        S.make_mesh(data=2, expert=3)
    assert dict(S.make_mesh(expert=3, devices=jax.devices()[:3]).shape) == {"expert": 3}


def test_logical_to_spec_follows_the_rules_table():
    dp_ep = S.make_mesh(data=2, expert=4)
    assert S.logical_to_spec(("batch", "hidden"), S.LOGICAL_RULES, dp_ep) == P(("data", "expert"), None)
    assert S.logical_to_spec(("experts", None, None), S.LOGICAL_RULES, dp_ep) == P("expert", None, None)
    assert S.logical_to_spec(("kv_heads", "hidden"), S.LOGICAL_RULES, dp_ep) == P(None, None)  # no model axis
    cc = S.make_mesh(chip=4, core=2)
    assert S.logical_to_spec(("experts", None, None), S.LOGICAL_RULES, cc) == P(("chip", "core"), None, None)
    tp = S.make_mesh(data=2, model=4)
    assert S.logical_to_spec(("vocab", "hidden"), S.LOGICAL_RULES, tp) == P("model", None)
    # A mesh axis splits at most one dimension of an array: the first logical axis that asks for it gets it.
    assert S.logical_to_spec(("batch", "experts"), S.LOGICAL_RULES, S.make_mesh(expert=8)) == P("expert", None)
    # A rules mapping works too, and unknown logical axes are named.
    assert S.logical_to_spec(("batch",), {"batch": "data"}, dp_ep) == P("data")
    with pytest.raises(S.ShardingError, match="no rule for logical axis 'sequence'"):
        S.logical_to_spec(("sequence",), S.LOGICAL_RULES, dp_ep)


def test_param_logical_axes_and_specs_for_every_parameter():
    assert S.param_logical_axes("model.layers.3.mlp.experts.gate_up_proj", (8, 64, 64)) == ("experts", "expert_mlp",
                                                                                              None)
    assert S.param_logical_axes("model.layers.3.self_attn.k_proj.weight") == ("kv_heads", "hidden")
    with pytest.raises(S.ShardingError, match="no logical axes known for parameter 'model.foo.weight'"):
        S.param_logical_axes("model.foo.weight")
    with pytest.raises(S.ShardingError, match="has shape"):
        S.param_logical_axes("model.norm.weight", (3, 4))

    cfg = C.tiny()  # 8 experts, 4 query / 2 KV heads
    abstract = nnx.eval_shape(lambda: Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    specs = S.param_specs(params, S.make_mesh(data=2, expert=4))
    flat = {S.placement._path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))[0]}
    assert len(flat) == len(jax.tree.leaves(params))
    for name, spec in flat.items():
        want = P("expert", None, None) if ".mlp.experts." in name else None
        if want is not None:
            assert spec == want, name
        else:  # data + expert parallelism: everything else replicated
            assert all(e is None for e in spec), (name, spec)
    tp = S.make_mesh(data=2, model=4)
    assert S.param_specs(params, tp)["model"]["embed_tokens"]["weight"].value == P("model", None)
    # 64 rows of k_proj divide by 4, but they are 2 heads of 32: only the config knows
    with pytest.raises(S.ShardingError, match="2 KV heads cannot be split over model=4"):
        S.param_specs(params, tp, config=cfg)
    few = nnx.state(nnx.eval_shape(lambda: Qwen35ForCausalLM(C.tiny(num_experts=4), rngs=nnx.Rngs(0))), nnx.Param)
    with pytest.raises(S.ShardingError, match=r"mlp.experts.down_proj \(4, 64, 32\): dim 0 \(experts, size 4\) "
                                              r"cannot be split over expert=8"):
        S.param_specs(few, S.make_mesh(expert=8))


def test_check_mesh_names_the_problem_and_the_fix():
    big = C.qwen35_397b_a17b()
    S.check_mesh(big, S.make_mesh(expert=8))
    S.check_mesh(big, S.make_mesh(data=2, expert=4))
    S.check_mesh(big, S.make_mesh(chip=4, core=2))
    with pytest.raises(S.ShardingError, match="512 experts cannot be split over expert=3"):
        S.check_mesh(big, S.make_mesh(expert=3, devices=jax.devices()[:3]))
    with pytest.raises(S.ShardingError, match="2 KV heads cannot be split over model=8; replicate attention with "
                                               "data parallelism"):
        S.check_mesh(big, S.make_mesh(model=8))


# ------------------------------------------------------------------------------------------------------------
# Packed routing metadata
def test_pack_routing_round_trip_is_bit_exact(rng):
    experts = jnp.asarray(rng.integers(0, 512, size=(7, 10)), jnp.int32)
    w = rng.random((7, 10)).astype(np.float32)
    w[0, :6] = [0.0, -0.0, np.inf, np.nan, np.finfo(np.float32).tiny / 8, 1.0]  # sign of zero, NaN, subnormal
    packed = S.pack_routing(experts, jnp.asarray(w))
    assert packed.shape == (7, 20) and packed.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(packed[:, 10:]), w.view(np.int32))  # numpy's reinterpretation
    e2, w2 = S.unpack_routing(packed)
    np.testing.assert_array_equal(np.asarray(e2), np.asarray(experts))
    np.testing.assert_array_equal(np.asarray(w2).view(np.int32), w.view(np.int32))
    with pytest.raises(ValueError, match="float32"):
        S.pack_routing(experts, jnp.asarray(w, jnp.bfloat16))


# ------------------------------------------------------------------------------------------------------------
# Expert-parallel MoE
def _moe_block(num_experts=16):
    cfg = C.tiny(num_experts=num_experts)
    return cfg, SparseMoeBlock(cfg, rngs=nnx.Rngs(0), execution=Execution(experts="dense"))


def _sharded_block(block, x, mesh, **kw):
    """SparseMoeBlock's forward with the routed experts through moe_ep (router and shared expert data-parallel)."""
    B, T, H = x.shape
    x_nh = x.reshape(B * T, H)
    w, e, _ = route(x_nh, block.gate.weight[...], block.top_k)
    y, stats = S.moe_ep(x_nh, w, e, block.experts.gate_up_proj[...], block.experts.down_proj[...],
                        Execution(mesh=mesh, **kw), return_stats=True)
    shared = jax.nn.sigmoid(block.shared_expert_gate(x_nh)) * block.shared_expert(x_nh)
    return (y + shared).reshape(B, T, H), stats


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_moe_ep_both_schemes_equal_the_unsharded_block(mesh_name, rng):
    cfg, block = _moe_block(16)  # 16 experts: 2 per device on expert=8, 4 on data=2 x expert=4
    mesh = S.make_mesh(**MESHES[mesh_name])
    x = jnp.asarray(rng.normal(size=(2, 8, cfg.hidden_size)), jnp.float32)  # 16 tokens: 2 per device
    ref, _ = block(x)
    y_ag, st = _sharded_block(block, x, mesh, exchange="allgather")
    assert_close(y_ag, ref, terms=moe_terms(cfg), name="all-gather")
    assert int(st.dropped) == 0 and st.capacity is None
    # Capacity factor E/k gives C = t (every slot of a device could go to one expert): nothing can drop.
    cf = cfg.num_experts / cfg.num_experts_per_tok
    y_a2a, st = _sharded_block(block, x, mesh, exchange="alltoall", capacity_factor=cf)
    assert_close(y_a2a, ref, terms=moe_terms(cfg), name="all-to-all")
    assert int(st.dropped) == 0 and st.capacity == 2


ROUTED_TERMS = 16 + 8 + 2  # _routed_inputs' experts: gate/up over H = 16, down over I = 8, a k = 2 weighted sum


def _routed_inputs(rng, N=32, H=16, E=16, k=2, I=8, skew=0.0):
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    router = rng.normal(size=(E, H)).astype(np.float32)
    router[:2] += skew * x.mean(0)  # pull slots towards experts 0 and 1 (to overflow their capacity)
    w, e, _ = route(x, jnp.asarray(router), k)
    gu = jnp.asarray(0.3 * rng.normal(size=(E, 2 * I, H)), jnp.float32)
    dn = jnp.asarray(0.3 * rng.normal(size=(E, H, I)), jnp.float32)
    return x, w, e, gu, dn


def test_moe_ep_allgather_dense_local_path_and_two_level_mesh(rng):
    x, w, e, gu, dn = _routed_inputs(rng)
    ref = experts_dense(x, w, e, gu, dn)
    y = S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(data=2, expert=4), experts="dense"))
    assert_close(y, ref, terms=ROUTED_TERMS, name="data=2 x expert=4")
    # chip x core: experts and tokens over both axes, reduce-scatter hierarchical (core first, then chip).
    y = S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(chip=4, core=2), experts="dense"))
    assert_close(y, ref, terms=ROUTED_TERMS, name="chip=4 x core=2")


@pytest.mark.parametrize("exchange,axes,tp", [("allgather", dict(expert=8), False), ("ragged", dict(expert=8), False),
                                              ("allgather", dict(expert=4, model=2), True)],
                         ids=["allgather", "ragged", "allgather-ep4-tp2"])
def test_a_pallas_model_on_a_mesh_runs_its_experts_on_the_kernels(rng, monkeypatch, exchange, axes, tp):
    """The MoE of a placed model (`moe_on_mesh`) with kernels="pallas": the all-gather and the ragged
    all-to-all exchanges, and the EP x TP hybrid (each device an I/2 slice of its experts), run each device's
    experts on the grouped matmul + SwiGLU kernels (`grouped_swiglu`, called while tracing), and the MoE's routed
    sum equals the dense sum on one device."""
    from qwen35 import tiny
    from qwen35.kernels import grouped_matmul

    calls = []
    real = grouped_matmul.grouped_swiglu
    monkeypatch.setattr(grouped_matmul, "grouped_swiglu", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    cfg = tiny()
    ex = Execution(kernels="pallas", exchange=exchange, mesh=S.make_mesh(**axes), rules=TP if tp else None)
    block = SparseMoeBlock(cfg, rngs=nnx.Rngs(0), execution=ex)
    x = jnp.asarray(rng.normal(size=(24, cfg.hidden_size)), jnp.float32)  # 3 tokens per device
    w, e, _ = route(x, block.gate.weight[...], cfg.num_experts_per_tok)
    with jax.default_matmul_precision("highest"):
        want = experts_dense(x, w, e, *block.experts.dequantized(jnp.float32))
        if tp:  # a placed TP-MoE block's gate|up rows, regrouped as shard_model stores them
            block.experts.gate_up_proj[...] = S.tp_interleave_gate_up(block.experts.gate_up_proj[...], 2)
        got = S.moe_on_mesh(block, x, w, e)
    jax.effects_barrier()
    assert calls, f"the mesh's MoE ({exchange}, {axes}) did not run the kernels"
    assert_close(got, want, terms=moe_terms(cfg), name=f"pallas model on {axes} ({exchange}) vs dense")


def test_a_pallas_model_on_cpu_devices_warns_when_the_interpreter_may_starve(monkeypatch):
    """Placing a `kernels="pallas"` model on 8 CPU devices with XLA's CPU pool under twice the devices (the core
    count, or NPROC) warns and names the fix (TPU interpret mode can hang there); with NPROC=32 it does not."""
    import warnings

    from qwen35 import tiny

    model = Qwen35ForCausalLM(tiny(num_hidden_layers=1, layer_types=("full_attention",)), rngs=nnx.Rngs(0),
                              execution=Execution(kernels="pallas"))
    monkeypatch.setenv("NPROC", "2")
    with pytest.warns(RuntimeWarning, match="NPROC=32"):
        S.shard_model(model, S.make_mesh(expert=8))
    monkeypatch.setenv("NPROC", "32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        S.shard_model(model, S.make_mesh(expert=8))


def test_moe_ep_reads_fp8_experts_as_stored_when_exported_for_tpu():
    """FP8 experts with their block scales through the all-gather exchange on the kernels (W8A16, and W8A8 with
    w8a8), exported for TPU on expert=8: the grouped matmul kernels are in the program, each device's experts
    enter them as float8, and no float32 copy of them is made (tests/test_w8a8.py runs the same exchange
    interpreted on 8 devices against the references). Scales given to a path that cannot read them are refused;
    W8A8 without them is the XLA paths' activation rounding, which needs whole 512-wide blocks."""
    from qwen35.kernels.interpret import lower_for_tpu
    from qwen35.weights import fp8_block_quantize

    E, H, I, k, N = 8, 512, 512, 2, 16
    r = np.random.default_rng(0)
    (gq, gs), (dq, ds) = (fp8_block_quantize(r.standard_normal(shape) / np.sqrt(shape[-1]))
                          for shape in ((E, 2 * I, H), (E, H, I)))
    mesh = S.make_mesh(expert=8)
    args = (jax.ShapeDtypeStruct((N, H), jnp.float32), jax.ShapeDtypeStruct((N, k), jnp.float32),
            jax.ShapeDtypeStruct((N, k), jnp.int32), *(jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype)
                                                       for a in (gq, dq, gs, ds)))
    for w8a8 in (False, True):
        def f(x, w, e, gu, dn, gsc, dsc):
            return S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh, kernels="pallas", w8a8=w8a8), gate_up_scale=gsc,
                            down_scale=dsc)
        with lower_for_tpu():
            text = jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
        kernels = set(re.findall(r'kernel_name = "([^"]+)"', text))
        assert {"_gmm_swiglu_kernel", "_gmm_kernel"} <= kernels and "all_gather" in text, (w8a8, kernels)
        assert f"tensor<1x{2 * I}x{H}xf8E4M3FN>" in text and f"tensor<1x{2 * I}x{H}xf32>" not in text, w8a8
    x, w, e, gu, dn = _routed_inputs(np.random.default_rng(1))
    with pytest.raises(ValueError, match="read as stored"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh), gate_up_scale=gs, down_scale=ds)
    with pytest.raises(S.ShardingError, match="W8A8 quantises the expert activations in 512-wide blocks"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh, kernels="pallas", w8a8=True))


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_moe_ep_allgather_runs_each_slot_on_one_device(rng, monkeypatch, kernels):
    """In the all-gather exchange each device sums only the slots routed to its own experts: another device's slots
    get the id El, past its local experts, so they sort after every group and no matmul runs on them. Counted at
    run time on every device of expert=8: the slots the local sum groups add up to N·k over the devices (given
    local expert 0, as before, each device would group all N·k, 8x the work). The result equals the dense one."""
    from qwen35.kernels import grouped_matmul
    from qwen35.sharding import exchange

    counted = []
    name, module = (("experts_sorted", exchange) if kernels == "xla"
                    else ("experts_sorted_pallas", grouped_matmul))
    real = getattr(module, name)

    def spy(x, weights, experts, gate_up, down, **kw):
        jax.debug.callback(lambda n: counted.append(int(n)), jnp.sum(experts < gate_up.shape[0]))
        return real(x, weights, experts, gate_up, down, **kw)

    monkeypatch.setattr(module, name, spy)
    x, w, e, gu, dn = _routed_inputs(rng, N=40)  # a shape no other test traces (a cached trace would skip the spy)
    y = S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(expert=8), kernels=kernels))
    jax.effects_barrier()
    assert_close(y, experts_dense(x, w, e, gu, dn), terms=ROUTED_TERMS, name=f"expert=8, {kernels}")
    assert len(counted) == 8 and sum(counted) == e.size, counted


def test_moe_ep_alltoall_drops_like_capacity_on_each_shard(rng):
    E, k, cf = 16, 2, 1.0
    x, w, e, gu, dn = _routed_inputs(rng, E=E, k=k, skew=3.0)
    mesh = S.make_mesh(data=2, expert=4)
    y, st = S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh, exchange="alltoall", capacity_factor=cf), return_stats=True)
    t = x.shape[0] // 8
    assert st.capacity == int(np.ceil(cf * t * k / E))
    # numpy: per device (its t tokens), slots past C per expert are dropped.
    e_np = np.asarray(e).reshape(8, t * k)
    want = sum(np.maximum(np.bincount(row, minlength=E) - st.capacity, 0).sum() for row in e_np)
    assert want > 0 and int(st.dropped) == want
    np.testing.assert_allclose(float(st.drop_rate), want / e.size)
    # the package's single-device capacity path on each device's shard (same C, same token-order drops)
    shards = [experts_capacity(x[i * t:(i + 1) * t], w[i * t:(i + 1) * t], e[i * t:(i + 1) * t], gu, dn,
                               capacity_factor=cf)[0] for i in range(8)]
    assert_close(y, jnp.concatenate(shards), terms=ROUTED_TERMS, name="all-to-all vs per-shard capacity")


def test_moe_ep_errors():
    x, w, e, gu, dn = _routed_inputs(np.random.default_rng(1), N=12)
    with pytest.raises(S.ShardingError, match="12 tokens cannot be split over data=2×expert=4 = 8 devices"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(data=2, expert=4)))
    with pytest.raises(S.ShardingError, match="no axis the 'experts' rule maps to.*use exchange 'allgather'"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(data=8), exchange="alltoall"))
    with pytest.raises(S.ShardingError, match="16 experts cannot be split over expert=3"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(expert=3, devices=jax.devices()[:3])))
    with pytest.raises(ValueError, match="exchange must be one of"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(expert=8), exchange="ring"))


def test_moe_ep_pure_data_parallel_runs_every_expert_on_each_device(rng):
    """make_mesh(data=8): experts replicated, each device's tokens through all of them, no collective at all."""
    x, w, e, gu, dn = _routed_inputs(rng)
    mesh = S.make_mesh(data=8)
    y = S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh))
    assert_close(y, experts_dense(x, w, e, gu, dn), terms=ROUTED_TERMS, name="data=8")
    hlo = jax.jit(functools.partial(S.moe_ep, execution=Execution(mesh=mesh))).lower(x, w, e, gu, dn).compile()
    hlo = hlo.as_text()
    assert S.hlo_collective_bytes(hlo)["ops"] == 0


# ------------------------------------------------------------------------------------------------------------
# The dropless ragged all-to-all
def _ragged_reference(operands, outputs, in_off, send, out_off, recv, n):
    """numpy, line by line from `lax.ragged_all_to_all`'s documented pseudo-code: device i's slice j goes to device
    j // (N/n) at that device's row out_off[i][j]; received slice j there is recv[d][j] rows long."""
    results = [o.copy() for o in outputs]
    N = len(in_off[0])
    spd = N // n
    for src in range(n):
        for j in range(N):
            dst, s = j // spd, j % spd
            rows = operands[src][in_off[src][j]:in_off[src][j] + send[src][j]]
            assert len(rows) == recv[dst][src * spd + s]  # the documented send/recv agreement
            results[dst][out_off[src][j]:out_off[src][j] + len(rows)] = rows
    return results


def _run_on_devices(fn, *per_device):
    mesh = S.make_mesh(expert=8)
    f = jax.shard_map(lambda *a: fn(*(b[0] for b in a))[None], mesh=mesh, in_specs=(P("expert"),) * len(per_device),
                      out_specs=P("expert"), check_vma=False)
    return np.asarray(jax.jit(f)(*(jnp.asarray(np.stack(a)) for a in per_device)))


def test_ragged_all_to_all_padded_follows_the_documented_semantics(rng):
    """The padded transport against numpy's reading of `lax.ragged_all_to_all`'s docstring: 8 devices, 2 slices per
    destination (16 slices), random sizes (zeros included) with gaps in both the operand and the output."""
    n, spd, M, rows_in, rows_out = 8, 2, 3, 64, 66
    sizes = rng.integers(0, M + 1, size=(n, n * spd)).astype(np.int32)  # sizes[src, j]: slice j of device src
    in_off = np.zeros_like(sizes)
    for i in range(n):  # slices in a shuffled order with one-row gaps
        at = 0
        for j in rng.permutation(n * spd):
            in_off[i, j] = at
            at += sizes[i, j] + 1
        assert at <= rows_in
    out_off = np.zeros_like(sizes)
    recv = np.zeros_like(sizes)
    for d in range(n):  # receiver d lays its incoming slices out source by source, with gaps
        at = 0
        for src in range(n):
            for s in range(spd):
                j = d * spd + s
                out_off[src, j] = at
                recv[d, src * spd + s] = sizes[src, j]
                at += sizes[src, j] + 1
        assert at <= rows_out
    operands = rng.normal(size=(n, rows_in, 2)).astype(np.float32)
    outputs = np.full((n, rows_out, 2), -7.0, np.float32)  # untouched rows keep the output's value
    want = _ragged_reference(operands, outputs, in_off, sizes, out_off, recv, n)
    got = _run_on_devices(lambda o, out, a, b, c, d: S.ragged_all_to_all_padded(o, out, a, b, c, d,
                                                                                 axis_name="expert", max_slice=M),
                          operands, outputs, in_off, sizes, out_off, recv)
    np.testing.assert_array_equal(got, np.stack(want))


@pytest.mark.parametrize("mesh_name", ["expert8", "data2_expert4", "chip_core", "ep4_tp2"])
def test_moe_ep_ragged_is_dropless_under_skewed_routing(mesh_name, rng):
    """Routing piled onto experts 0 and 1 (where the capacity all-to-all at factor 1 drops slots): the ragged
    exchange sends every slot and equals the single-device MoE."""
    x, w, e, gu, dn = _routed_inputs(rng, skew=3.0)
    axes, kw = {"expert8": (dict(expert=8), {}), "data2_expert4": (dict(data=2, expert=4), {}),
                "chip_core": (dict(chip=4, core=2), {}),
                "ep4_tp2": (dict(expert=4, model=2), dict(rules=TP))}[mesh_name]
    mesh = S.make_mesh(**axes)
    if not kw:
        _, st = S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh, exchange="alltoall", capacity_factor=1.0), return_stats=True)
        assert int(st.dropped) > 0, "the routing is not skewed enough to test droplessness"
    y, st = S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh, exchange="ragged", **kw), return_stats=True)
    assert int(st.dropped) == 0 and st.capacity is None
    assert_close(y, experts_dense(x, w, e, gu, dn), terms=ROUTED_TERMS, name=f"ragged on {mesh_name}")


def test_ragged_native_transport_lowers_to_ragged_all_to_all(rng):
    """On TPU / GPU the exchange is two `ragged_all_to_all`s (forward and back); lowered here from shapes, it names
    them (XLA:CPU, which has none, runs the padded transport). A capacity factor is refused: nothing drops."""
    from qwen35.sharding import exchange

    x, w, e, gu, dn = _routed_inputs(rng)
    mesh = S.make_mesh(expert=8)
    f = exchange._ep_fn(mesh, "ragged", ("expert",), ("expert",), (), None, "sorted", False, 1, True, True, None,
                        False, False)
    text = f.lower(x, w, e, gu, dn).as_text()
    assert text.count("ragged_all_to_all") == 2
    with pytest.raises(ValueError, match="applies to experts='capacity' or exchange='alltoall' only"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=mesh, exchange="ragged", capacity_factor=2.0))


def test_ragged_bytes_counts_the_slots_that_leave_their_device():
    # 2 devices, 4 experts (2 each), 2 tokens per device, k = 2; H = 3, 1 byte per element
    experts = np.array([[0, 1], [1, 2],    # device 0's tokens: one slot leaves (expert 2 is device 1's)
                        [0, 3], [2, 3]])   # device 1's tokens: one slot leaves (expert 0 is device 0's)
    np.testing.assert_array_equal(S.ragged_bytes(experts, 2, 4, 3, 1), [(1 + 1) * 3, (1 + 1) * 3])
    experts = np.array([[2, 3], [2, 3], [2, 3], [3, 2]])  # all to device 1: device 0 sends 4 out, 1 sends 4 back
    np.testing.assert_array_equal(S.ragged_bytes(experts, 2, 4, 3, 1), [4 * 3, 4 * 3])


# ------------------------------------------------------------------------------------------------------------
# Hierarchical reduce-scatter
def _replica_groups(hlo: str, op: str) -> list[str]:
    return re.findall(rf"{op}\(.*?replica_groups=(\{{[0-9,{{}}]*\}})", hlo)


@pytest.mark.parametrize("dim", [0, 1])
def test_hierarchical_psum_scatter_equals_flat(dim):
    mesh = S.make_mesh(chip=4, core=2)
    spec = P(("chip", "core"))
    shape = (8 * 16, 3) if dim == 0 else (8, 16 * 3)  # per device: [16, 3] scatter dim 0, or [1, 48] dim 1
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) % 97  # small ints: sums are exact

    def hier(x):
        return S.hierarchical_psum_scatter(x, "core", "chip", scatter_dimension=dim)

    def flat(x):
        return jax.lax.psum_scatter(x, ("chip", "core"), scatter_dimension=dim, tiled=True)

    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))  # noqa: E731
    got, want = run(hier)(x), run(flat)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # numpy: device d = 2·chip + core holds block d of Σ over the 8 devices' inputs
    total = np.asarray(x).reshape(8, shape[0] // 8, shape[1]).sum(0)
    blocks = np.split(total, 8, axis=dim)
    np.testing.assert_array_equal(np.asarray(got), np.concatenate(blocks, axis=0))
    if dim == 0:  # two reduce-scatters: the cores of a chip (groups of 2) first, then the chips (groups of 4)
        hlo = run(hier).lower(x).compile().as_text()
        assert _replica_groups(hlo, "reduce-scatter") == ["{{0,1},{2,3},{4,5},{6,7}}", "{{0,2,4,6},{1,3,5,7}}"]


# ------------------------------------------------------------------------------------------------------------
# Communication accounting
def test_moe_comm_bytes_formula():
    big = C.qwen35_397b_a17b()  # H 4096, E 512, k 10
    ag = S.moe_comm_bytes(big, 128, 8, "allgather", dtype_bytes=2)
    assert ag["all_gather_tokens"] == ag["reduce_scatter"] == 7 * 128 * 4096 * 2
    assert ag["all_gather_routing"] == 7 * 128 * 20 * 4
    a2a = S.moe_comm_bytes(big, 128, 8, "alltoall", dtype_bytes=2, capacity_factor=1.25)
    C_ = int(np.ceil(1.25 * 128 * 10 / 512))  # 4 rows per (source, expert)
    assert a2a["total"] == 2 * 7 * 64 * C_ * 4096 * 2


@pytest.mark.parametrize("scheme", ["allgather", "alltoall"])
def test_moe_comm_bytes_match_the_compiled_hlo(scheme):
    cfg = C.tiny(num_experts=16)
    N, H, E, k, I = 32, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    mesh = S.make_mesh(data=2, expert=4)  # EP groups of 4 devices, t = 32 / 8 = 4 tokens each
    cf = 1.25 if scheme == "alltoall" else None
    ex = Execution(mesh=mesh, exchange=scheme, capacity_factor=cf, experts="dense")
    f = jax.jit(functools.partial(S.moe_ep, execution=ex))
    args = (jnp.zeros((N, H)), jnp.zeros((N, k)), jnp.zeros((N, k), jnp.int32), jnp.zeros((E, 2 * I, H)),
            jnp.zeros((E, H, I)))
    hlo = f.lower(*args).compile().as_text()
    got = S.hlo_collective_bytes(hlo)
    want = S.moe_comm_bytes(cfg, 4, 4, scheme, dtype_bytes=4, capacity_factor=cf or 1.25)
    assert got["total"] == want["total"]
    if scheme == "allgather":  # tokens + packed routing (one all-gather for ids and weights) + reduce-scatter
        assert got["ops"] == 3
        assert got["all-gather"] == want["all_gather_tokens"] + want["all_gather_routing"]
        assert got["reduce-scatter"] == want["reduce_scatter"]
    else:
        assert got["ops"] == 2 and got["all-to-all"] == want["total"]


def test_ragged_padded_transport_bytes_in_the_compiled_hlo():
    """The "ragged" scheme's bytes depend on the routing (`moe_comm_bytes` gives the uniform expectation,
    `ragged_bytes` the real count); its CPU transport moves fixed padded blocks, read here off the HLO: the [E]
    counts all-gathered, E slices of t rows each way, and three all-to-alls of [E] offsets (the forward transport
    exchanges the destination offsets that the way back needs too: XLA computes that all-to-all once)."""
    cfg = C.tiny(num_experts=16)
    N, H, E, k, I = 32, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    n, t = 4, 4  # data=2 x expert=4: 4 devices per exchange, 32 / 8 tokens each
    f = jax.jit(functools.partial(S.moe_ep, execution=Execution(mesh=S.make_mesh(data=2, expert=4),
                                                                exchange="ragged")))
    args = (jnp.zeros((N, H)), jnp.zeros((N, k)), jnp.zeros((N, k), jnp.int32), jnp.zeros((E, 2 * I, H)),
            jnp.zeros((E, H, I)))
    got = S.hlo_collective_bytes(f.lower(*args).compile().as_text())
    want = S.moe_comm_bytes(cfg, t, n, "ragged", dtype_bytes=4)
    assert got["all-gather"] == want["all_gather_counts"] == (n - 1) * E * 4
    assert got["all-to-all"] == 2 * (n - 1) * E * t * H * 4 // n + 3 * (n - 1) * E * 4 // n
    assert want["ragged_dispatch"] == want["ragged_combine"] == (n - 1) * t * k * H * 4 // n


# ------------------------------------------------------------------------------------------------------------
# Tensor-parallel experts, the EP x TP hybrid, chunked exchange, hierarchical all-gather, placement by load
TP = S.rules_with(expert_mlp=("model",))
LAYOUTS = {  # name -> (mesh axes, Execution fields)
    "tp8": (dict(model=8), dict(rules=TP)),
    "ep4_tp2": (dict(expert=4, model=2), dict(rules=TP)),
    "ep2_tp4_chunks2": (dict(expert=2, model=4), dict(rules=TP, moe_chunks=2)),
    "ep8_chunks4": (dict(expert=8), dict(moe_chunks=4)),
    "chip_core_chunks2": (dict(chip=4, core=2), dict(moe_chunks=2)),
    "a2a_ep4_tp2": (dict(expert=4, model=2), dict(rules=TP, exchange="alltoall", capacity_factor=8.0)),
    "a2a_ep8_chunks2": (dict(expert=8), dict(exchange="alltoall", capacity_factor=8.0, moe_chunks=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_moe_hybrid_and_chunked_exchange_equal_the_dense_reference(layout, rng):
    axes, kw = LAYOUTS[layout]
    x, w, _, gu, dn = _routed_inputs(rng, N=32)
    # uneven routing: experts 12-15 get no slots, the others 2-10 each (distinct experts per token)
    e = jnp.asarray(np.stack([rng.choice(12, 2, replace=False) for _ in range(32)]), jnp.int32)
    assert set(np.unique(np.asarray(e))) == set(range(12))
    y = S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(**axes), experts="dense", **kw))
    assert_close(y, experts_dense(x, w, e, gu, dn), terms=ROUTED_TERMS, name=layout)


def test_tp_interleave_gives_each_device_its_gate_and_up_columns(rng):
    E, I, H, m = 3, 8, 5, 4
    gu = rng.normal(size=(E, 2 * I, H)).astype(np.float32)
    inter = np.asarray(S.tp_interleave_gate_up(jnp.asarray(gu), m))
    for j, piece in enumerate(np.split(inter, m, axis=1)):  # device j's contiguous slice
        np.testing.assert_array_equal(piece[:, : I // m], gu[:, j * I // m:(j + 1) * I // m])  # gate_j
        np.testing.assert_array_equal(piece[:, I // m:], gu[:, I + j * I // m: I + (j + 1) * I // m])  # up_j
    np.testing.assert_array_equal(np.asarray(S.tp_deinterleave_gate_up(jnp.asarray(inter), m)), gu)
    with pytest.raises(S.ShardingError, match="expert width I = 8 cannot be split over a tensor-parallel group of 3"):
        S.tp_interleave_gate_up(jnp.asarray(gu), 3)


def test_tp_and_chunk_errors_name_the_axis():
    x, w, e, gu, dn = _routed_inputs(np.random.default_rng(1), N=16, I=6)
    with pytest.raises(S.ShardingError, match=r"expert width I = 6 cannot be split over model=4 \(expert_mlp\)"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(expert=2, model=4), rules=TP))
    x, w, e, gu, dn = _routed_inputs(np.random.default_rng(1), N=16, I=8)
    with pytest.raises(S.ShardingError, match="'alltoall' .* use exchange 'allgather'"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(model=8), rules=TP, exchange="alltoall"))
    with pytest.raises(S.ShardingError, match="moe_chunks=3 must divide the 2 tokens per device"):
        S.moe_ep(x, w, e, gu, dn, Execution(mesh=S.make_mesh(expert=8), moe_chunks=3))
    with pytest.raises(S.ShardingError, match="no rule for logical axis 'expert_width'"):
        S.rules_with(expert_width=("model",))


def test_hierarchical_all_gather_equals_flat():
    mesh = S.make_mesh(chip=4, core=2)
    spec = P(("chip", "core"))
    x = jnp.arange(8 * 3 * 2, dtype=jnp.float32).reshape(8 * 3, 2)
    run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False))  # noqa: E731
    hier = run(lambda x: S.hierarchical_all_gather(x, "core", "chip"))
    flat = run(lambda x: jax.lax.all_gather(x, ("chip", "core"), axis=0, tiled=True))
    np.testing.assert_array_equal(np.asarray(hier(x)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(hier(x)), np.asarray(flat(x)))
    # across chips first (groups of 4), then inside each chip (groups of 2)
    assert _replica_groups(hier.lower(x).compile().as_text(), "all-gather") == [
        "{{0,2,4,6},{1,3,5,7}}", "{{0,1},{2,3},{4,5},{6,7}}"]


@pytest.mark.parametrize("chunks", [1, 2])
def test_tp_moe_comm_bytes_match_the_compiled_hlo(chunks):
    cfg = C.tiny(num_experts=16)
    N, H, E, k, I = 32, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    mesh = S.make_mesh(expert=4, model=2)  # EP 4 x TP 2: tokens split 4 ways (t = 8), replicated over "model"
    ex = Execution(mesh=mesh, rules=TP, experts="dense", moe_chunks=chunks)
    f = jax.jit(functools.partial(S.moe_ep, execution=ex))
    args = (jnp.zeros((N, H)), jnp.zeros((N, k)), jnp.zeros((N, k), jnp.int32), jnp.zeros((E, 2 * I, H)),
            jnp.zeros((E, H, I)))
    hlo = f.lower(*args).compile().as_text()
    got = S.hlo_collective_bytes(hlo)
    want = S.moe_comm_bytes(cfg, 8, 4, "allgather", dtype_bytes=4, tp_size=2)
    assert want["all_reduce_tp"] == 2 * 1 * 8 * H * 4 // 2
    assert got["all-reduce"] == want["all_reduce_tp"]
    assert got["total"] == want["total"]  # chunking moves the same bytes ...
    # ... in K times as many (smaller, independent) all-gathers (tokens, routing) and reduce-scatters; XLA's
    # all-reduce combiner may merge the K TP all-reduces into one tuple all-reduce (it does on CPU)
    assert len(re.findall(r" all-gather\(", hlo)) == 2 * chunks
    assert len(re.findall(r" reduce-scatter\(", hlo)) == chunks


def test_hlo_collective_bytes_reads_async_collectives():
    # the forms TPU/GPU schedules emit (collectives overlapped with compute), written as XLA prints them
    hlo = "\n".join([
        "  %ag = (bf16[4,64]{1,0}, bf16[32,64]{1,0}) all-gather-start(bf16[4,64]{1,0} %x), channel_id=1, "
        "replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true",
        "  %agd = bf16[32,64]{1,0} all-gather-done((bf16[4,64]{1,0}, bf16[32,64]{1,0}) %ag)",
        "  %ar = f32[8,64]{1,0} all-reduce-start(f32[8,64]{1,0} %y), channel_id=2, replica_groups={{0,1},{2,3},"
        "{4,5},{6,7}}, to_apply=%add",
        "  %ard = f32[8,64]{1,0} all-reduce-done(f32[8,64]{1,0} %ar)",
        "  %rs = bf16[4,64]{1,0} reduce-scatter(bf16[32,64]{1,0} %z), channel_id=3, replica_groups=[1,8]<=[8], "
        "dimensions={0}, to_apply=%add",
        "  %cnt = s32[] all-reduce(s32[] %c), channel_id=4, replica_groups=[1,8]<=[8], to_apply=%add",
    ])
    got = S.hlo_collective_bytes(hlo)
    assert got["all-gather"] == 7 * 32 * 64 * 2 // 8
    assert got["all-reduce"] == 2 * 1 * 8 * 64 * 4 // 2
    assert got["reduce-scatter"] == 7 * 4 * 64 * 2
    assert got["ops"] == 3 and got["async"] == 2  # the scalar counter is skipped; "-done" ops are not counted


def test_balanced_expert_placement_evens_device_load_and_keeps_the_output(rng):
    cfg, block = _moe_block(16)
    x = jnp.asarray(rng.normal(size=(4, 16, cfg.hidden_size)), jnp.float32)
    router = np.asarray(block.gate.weight[...]).copy()
    router[:4] += 2.0 * np.asarray(x).reshape(-1, cfg.hidden_size).mean(0)  # experts 0-3 hot: all on device 0
    block.gate.weight[...] = jnp.asarray(router)
    ref, _ = block(x)
    _, e, _ = route(x.reshape(-1, cfg.hidden_size), block.gate.weight[...], block.top_k)
    load = np.bincount(np.asarray(e).ravel(), minlength=16)
    perm = S.balanced_expert_placement(load, 4)
    assert sorted(perm.tolist()) == list(range(16))
    before, after = load.reshape(4, 4).sum(1), load[perm].reshape(4, 4).sum(1)
    assert after.max() < before.max() and after.max() <= load.sum() / 4 + load.max()  # LPT's bound
    # relabel the experts: router rows and expert weights permuted together give the same output
    block.gate.weight[...] = jnp.asarray(router[perm])
    block.experts.gate_up_proj[...] = block.experts.gate_up_proj[...][perm]
    block.experts.down_proj[...] = block.experts.down_proj[...][perm]
    y, _ = block(x)
    assert_close(y, ref, terms=moe_terms(cfg), name="relabelled experts")
    _, e2, _ = route(x.reshape(-1, cfg.hidden_size), block.gate.weight[...], block.top_k)
    np.testing.assert_array_equal(np.bincount(np.asarray(e2).ravel(), minlength=16), load[perm])
