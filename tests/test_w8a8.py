"""W8A8 experts (`Execution(w8a8=True)`): FP8 activations with one scale per row and 512 columns times FP8 weights
with 128x128 block scales. The XLA paths (dense, sorted tiles, ragged_dot, the expert-parallel exchanges) against
the plain reference `grouped_swiglu_w8a8_reference`; the MoE block on the Pallas kernels against the XLA path; a
checkpoint loaded with it; and the errors that say how to switch it on.

Comparisons between two W8A8 evaluations allow for one thing: each computes the SwiGLU output in float32 in its
own order before quantising it, so an element lying on an e4m3 rounding boundary may round up in one and down in
the other (one e4m3 step, 2^-3 relative). Most outputs then agree to float32 rounding and none by more than a few
such steps (`assert_w8a8_close`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, model_terms
from pallas_helpers import clean_interpreter  # noqa: F401 (autouse fixture: these tests run interpreted kernels)

import qwen35
from qwen35 import sharding as S
from qwen35.execution import Execution
from qwen35.kernels.grouped_matmul import grouped_swiglu_w8a8_reference
from qwen35.moe import (ACT_BLOCK, SparseMoeBlock, experts_dense, experts_sorted, fp8_round_activations,
                        grouped_ragged, grouped_tiles, route, sort_by_expert)
from qwen35.weights import CheckpointError, fp8_block_dequantize, fp8_block_quantize

H = I = ACT_BLOCK  # whole 512-wide activation blocks along both contractions


def assert_w8a8_close(got, want, name):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    diff, top = np.abs(got - want), float(np.max(np.abs(want)))
    assert np.median(diff) <= 1e-5 * top and diff.max() <= 0.02 * top, (name, np.median(diff), diff.max(), top)


def fp8_experts(rng, E):
    gate_up = rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)
    down = rng.standard_normal((E, H, I)) / np.sqrt(I)
    (gq, gs), (dq, ds) = fp8_block_quantize(gate_up), fp8_block_quantize(down)
    return gq, gs, dq, ds


def fp8_problem(rng, E, N, k):
    """FP8 experts (`fp8_experts`) and N tokens routed to k distinct experts each with positive weights."""
    gq, gs, dq, ds = fp8_experts(rng, E)
    x = rng.standard_normal((N, H)).astype(np.float32)
    experts = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
    weights = rng.uniform(0.2, 1.0, (N, k)).astype(np.float32)
    return (gq, gs, dq, ds), x, experts, weights


def w8a8_reference(x, weights, experts, gq, gs, dq, ds):
    """Sort the slots by expert, the plain W8A8 grouped SwiGLU, the weighted sum back to tokens (numpy)."""
    N, k = experts.shape
    order, group_sizes = sort_by_expert(jnp.asarray(experts), gq.shape[0])
    order = np.asarray(order)
    y_sorted = np.asarray(grouped_swiglu_w8a8_reference(jnp.asarray(x)[order // k], group_sizes, gq, dq, gs, ds))
    y = np.zeros((N, H), np.float32)
    np.add.at(y, order // k, y_sorted * np.asarray(weights).reshape(-1)[order][:, None])
    return y


def test_activation_rounding_is_quantise_then_dequantise():
    """`fp8_round_activations` keeps every value within half an e4m3 step of its block (3 mantissa bits), leaves
    each block's largest magnitude exact (it maps to e4m3's 448), works on any leading shape, keeps the dtype."""
    x = np.random.default_rng(0).standard_normal((2, 3, 1024)).astype(np.float32) * 7.0
    r = np.asarray(fp8_round_activations(jnp.asarray(x)))
    blocks = np.abs(x).reshape(2, 3, 2, 512)
    amax = blocks.max(-1, keepdims=True)
    assert np.all(np.abs(r - x).reshape(blocks.shape) <= 2.0 ** -4 * blocks + amax / 448 * 2.0 ** -9)
    np.testing.assert_allclose(np.abs(r).reshape(blocks.shape).max(-1), amax[..., 0], rtol=1e-6)
    assert fp8_round_activations(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("path", ["dense", "tiles", "ragged_dot"])
def test_xla_w8a8_paths_equal_the_reference(path):
    rng = np.random.default_rng(1)
    (gq, gs, dq, ds), x, experts, weights = fp8_problem(rng, E=4, N=12, k=2)
    gu, dn = fp8_block_dequantize(gq, gs), fp8_block_dequantize(dq, ds)
    with jax.default_matmul_precision("highest"):
        if path == "dense":
            y = experts_dense(x, weights, experts, gu, dn, act_block=ACT_BLOCK)
        else:
            grouped = {"tiles": grouped_tiles, "ragged_dot": grouped_ragged}[path]
            y = experts_sorted(x, weights, experts, gu, dn, grouped=grouped, act_block=ACT_BLOCK)
        plain = experts_dense(x, weights, experts, gu, dn)
    want = w8a8_reference(x, weights, experts, gq, gs, dq, ds)
    assert_w8a8_close(y, want, path)
    rel = np.linalg.norm(want - np.asarray(plain)) / np.linalg.norm(np.asarray(plain))
    assert 0.005 < rel < 0.1, rel  # the activations' rounding against FP8 weights alone (W8A16): a few percent


def w8a8_config(**kw):
    return qwen35.tiny(hidden_size=H, moe_intermediate_size=I, num_experts=8, num_experts_per_tok=2,
                       num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), vocab_size=256,
                       shared_expert_intermediate_size=64, **kw)


def w8a8_block(kernels, gq, gs, dq, ds, **execution):
    """A W8A8 `SparseMoeBlock` on `kernels` whose FP8 experts and block scales are the given ones."""
    block = SparseMoeBlock(w8a8_config(), rngs=nnx.Rngs(0), fp8_experts=True,
                           execution=Execution(kernels=kernels, w8a8=True, **execution))
    for name, value in (("gate_up_proj", gq), ("down_proj", dq), ("gate_up_proj_scale_inv", gs),
                        ("down_proj_scale_inv", ds)):
        getattr(block.experts, name).set_value(jnp.asarray(value))
    return block


@pytest.mark.timeout(300)
def test_moe_block_w8a8_on_the_kernels_equals_xla():
    """`SparseMoeBlock` with `w8a8`: kernels "pallas" multiply FP8 by FP8 in the kernels, kernels "xla" round
    the activations through FP8 and multiplies the dequantised weights; both equal the reference."""
    rng = np.random.default_rng(2)
    gq, gs, dq, ds = fp8_experts(rng, 8)
    x = jnp.asarray(rng.standard_normal((1, 6, H)), jnp.float32)
    outs = {}
    for kernels in ("xla", "pallas"):
        block = w8a8_block(kernels, gq, gs, dq, ds)
        with jax.default_matmul_precision("highest"):
            outs[kernels] = np.asarray(block(x)[0])
            w, e, _ = route(x[0], block.gate.weight[...], 2)
            shared = outs[kernels][0] - np.asarray(block.routed(x[0], w, e))
    assert_w8a8_close(outs["pallas"], outs["xla"], "MoE block, pallas vs xla")
    assert_w8a8_close(outs["xla"][0] - shared, w8a8_reference(x[0], w, e, gq, gs, dq, ds), "MoE block vs reference")


@pytest.mark.parametrize("scheme", ["allgather", "ragged"])
@pytest.mark.parametrize("w8a8", [False, True])
def test_moe_ep_runs_fp8_experts_on_the_kernels_on_8_devices(w8a8, scheme):
    """The all-gather and the ragged all-to-all exchanges on expert=8 with FP8 experts as stored (one per device,
    its 128x128 block scales beside it) on the grouped matmul kernels, interpreted: W8A16 equals the dense sum of
    the dequantised experts, W8A8 (`w8a8`) the plain W8A8 reference. (The same all-gather program exported for
    TPU reads float8 experts and makes no float32 copy: tests/test_sharding.py.)"""
    rng = np.random.default_rng(5)
    k = 2
    (gq, gs, dq, ds), x, experts, weights = fp8_problem(rng, E=8, N=16, k=k)
    with jax.default_matmul_precision("highest"):
        ex = Execution(mesh=S.make_mesh(expert=8), exchange=scheme, kernels="pallas", w8a8=w8a8)
        got = S.moe_ep(x, weights, experts, jnp.asarray(gq), jnp.asarray(dq), ex, gate_up_scale=jnp.asarray(gs),
                       down_scale=jnp.asarray(ds))
        if w8a8:
            assert_w8a8_close(got, w8a8_reference(x, weights, experts, gq, gs, dq, ds), f"W8A8 on expert=8 ({scheme})")
        else:
            want = experts_dense(x, weights, experts, fp8_block_dequantize(gq, gs), fp8_block_dequantize(dq, ds))
            assert_close(got, want, terms=H + I + k, name=f"W8A16 on expert=8 ({scheme}) vs dense")  # gate/up, down, k


def test_the_engines_exchange_reads_fp8_experts_on_the_kernels(monkeypatch):
    """`moe_ep_local` (the serving engine's MoE inside its step's `shard_map`) with a W8A8 block on the kernels
    (kernels "pallas") on expert=8, each device holding one FP8 expert and its scales: both exact exchanges run
    the grouped kernels on the FP8 experts as stored (FP8 x FP8) and equal the plain W8A8 reference."""
    from jax.sharding import PartitionSpec as P

    from qwen35.kernels import grouped_matmul

    calls = []
    real = grouped_matmul.grouped_swiglu
    monkeypatch.setattr(grouped_matmul, "grouped_swiglu", lambda *a, **kw: calls.append(kw) or real(*a, **kw))

    rng = np.random.default_rng(7)
    (gq, gs, dq, ds), x, experts, weights = fp8_problem(rng, E=8, N=16, k=2)
    mesh = S.make_mesh(expert=8)
    for scheme in ("allgather", "ragged"):
        block = w8a8_block("pallas", gq, gs, dq, ds, exchange=scheme, mesh=mesh)
        graph, state = nnx.split(block)
        paths, treedef = jax.tree_util.tree_flatten_with_path(state)
        specs = [P("expert") if "experts" in jax.tree_util.keystr(path) else P() for path, _ in paths]
        want = w8a8_reference(x, weights, experts, gq, gs, dq, ds)

        def body(leaves, x, w, e, graph=graph, treedef=treedef):
            local = nnx.merge(graph, jax.tree.unflatten(treedef, leaves))
            return S.moe_ep_local(local, x, w, e, expert_axes=("expert",))

        run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("expert"), P("expert"), P("expert")),
                                    out_specs=P("expert"), check_vma=False))
        with jax.default_matmul_precision("highest"):
            got = run([leaf for _, leaf in paths], jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts))
        assert [(c["gate_up_scale"] is not None, c["w8a8"]) for c in calls] == [(True, True)], (scheme, calls)
        calls.clear()
        assert_w8a8_close(got, want, f"the engine's {scheme} exchange on the kernels vs W8A8 reference")


@pytest.mark.timeout(300)
def test_w8a8_checkpoint_loads_serves_sharded_and_moves_logits_a_little(tmp_path):
    """An FP8 checkpoint loaded with Execution(w8a8=True) (fp8="keep"): the in-memory W8A8 model's logits; against the
    same checkpoint's W8A16 logits a small nonzero change; on an expert=8 mesh (all-gather and ragged exchanges)
    the single-device W8A8 logits."""
    cfg = w8a8_config()
    model = qwen35.Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0), fp8_experts=True, execution=Execution(w8a8=True))
    path = qwen35.save_hf_checkpoint(model, tmp_path / "fp8")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (8, 6))
    w8a8 = qwen35.load_hf_checkpoint(path, fp8="keep", execution=Execution(w8a8=True), progress=False)
    w8a16 = qwen35.load_hf_checkpoint(path, fp8="keep", progress=False)
    assert w8a8.execution.w8a8 and not w8a16.execution.w8a8
    with jax.default_matmul_precision("highest"):
        got, mem, plain = (np.asarray(m(ids)[0]) for m in (w8a8, model, w8a16))
        assert_close(got, mem, terms=model_terms(cfg, 6), name="W8A8 logits, loaded vs in memory")
        rel = np.linalg.norm(got - plain) / np.linalg.norm(plain)
        assert 1e-3 < rel < 0.3, rel
        for scheme in ("allgather", "ragged"):
            sharded = S.shard_model(w8a8, S.make_mesh(expert=8), execution=w8a8.execution.replace(exchange=scheme))
            assert_w8a8_close(sharded(ids)[0], got, f"W8A8 logits on expert=8 ({scheme}) vs one device")


def test_w8a8_says_how_to_switch_it_on(tmp_path):
    with pytest.raises(ValueError, match="multiples of 512"):
        SparseMoeBlock(qwen35.tiny(), rngs=nnx.Rngs(0), fp8_experts=True, execution=Execution(w8a8=True))
    with pytest.raises(ValueError, match="fp8_experts=True"):
        SparseMoeBlock(w8a8_config(), rngs=nnx.Rngs(0), execution=Execution(w8a8=True))
    with pytest.raises(ValueError, match="'sorted' or 'dense'"):
        Execution(experts="capacity", w8a8=True)
    cfg = w8a8_config()
    bf16_experts = qwen35.save_hf_checkpoint(qwen35.Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0)), tmp_path / "plain")
    with pytest.raises(ValueError, match="fp8='keep'"):
        qwen35.load_hf_checkpoint(bf16_experts, execution=Execution(w8a8=True))
    with pytest.raises(CheckpointError, match="not FP8"):
        qwen35.load_hf_checkpoint(bf16_experts, fp8="keep", execution=Execution(w8a8=True), progress=False)
    with pytest.raises(ValueError, match="exact exchanges"):
        Execution(w8a8=True, exchange="alltoall")
