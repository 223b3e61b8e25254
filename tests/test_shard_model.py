"""The sharded model (DP attention + EP experts) against the unsharded one; the full-size memory plan against
hand arithmetic; the 397B decode step lowered for TPU from shapes alone."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, assert_no_near_tie, greedy_step_logits, model_terms
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from qwen35.execution import EXCHANGES, Execution
from qwen35 import config as C
from qwen35 import sharding as S
from qwen35.model import Qwen35ForCausalLM

GiB = 2**30


@pytest.fixture(scope="module")
def tiny_model_and_reference():
    model = Qwen35ForCausalLM(C.tiny(), rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 9))
    cache = model.init_cache(8, 16)
    ref = []
    for sl in (slice(0, 7), slice(7, 8), slice(8, 9)):  # prefill T=7, then 2 decode steps
        logits, cache = model(ids[:, sl], cache=cache)
        ref.append(np.asarray(logits))
    return model, ids, ref


def assert_logits_close(got, want, model, name):
    """Sharded vs unsharded logits: two float32 evaluations of the decoder (sums split over devices reorder)."""
    assert_close(got, want, terms=model_terms(model.config, 9), name=name)


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_sharded_tiny_model_equals_unsharded(tiny_model_and_reference, exchange):
    model, ids, ref = tiny_model_and_reference
    mesh = S.make_mesh(expert=8)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    cf = E / k if exchange == "alltoall" else None  # E/k: nothing dropped
    ex = model.execution.replace(exchange=exchange, capacity_factor=cf)
    smodel = S.shard_model(model, mesh, execution=ex)
    assert smodel is not model and model.execution == Execution() and model.mesh is None  # the original untouched
    assert smodel.execution.replace(mesh=None, rules=None) == ex and smodel.execution.mesh is mesh
    assert smodel.mesh is mesh and isinstance(smodel, S.PlacedLM) and not model.placed  # built placed, not assigned
    mlp = smodel.model.layers[0].mlp
    assert mlp.execution is smodel.execution  # every layer holds the one value it was built with
    # parameters: experts E/8 per device, attention and GDN replicated
    gu = mlp.experts.gate_up_proj[...]
    assert gu.sharding.spec == P("expert", None, None)
    assert gu.addressable_shards[0].data.shape == (E // 8, *gu.shape[1:])
    assert smodel.model.layers[3].self_attn.q_proj.weight[...].sharding.spec == P(None, None)
    assert smodel.model.layers[0].linear_attn.in_proj_qkv.weight[...].sharding.spec == P(None, None)
    cache = smodel.init_cache(8, 16)
    out = []
    for sl in (slice(0, 7), slice(7, 8), slice(8, 9)):
        logits, cache = smodel(ids[:, sl], cache=cache)
        out.append(np.asarray(logits))
    # the cache: whole sequences per device
    for leaf in (cache.layers[3].k, cache.layers[0].recurrent, cache.layers[0].conv):
        assert leaf.sharding.spec[0] == "expert"
        assert leaf.addressable_shards[0].data.shape[0] == 1
    assert int(cache.index) == 9
    for step, (a, b) in enumerate(zip(out, ref)):
        assert_logits_close(a, b, model, f"{exchange} step {step}")


def test_pure_data_parallel_mesh_replicates_the_experts(tiny_model_and_reference):
    """make_mesh(data=8), a small model's natural layout: every weight on every device, the batch split, no
    exchange; equal to the unsharded model. The token-moving exchanges are refused there with the fix."""
    model, ids, ref = tiny_model_and_reference
    mesh = S.make_mesh(data=8)
    smodel = S.shard_model(model, mesh)
    gu = smodel.model.layers[0].mlp.experts.gate_up_proj[...]
    assert gu.sharding.spec == P(None, None, None) and gu.addressable_shards[0].data.shape == gu.shape
    cache = smodel.init_cache(8, 16)
    for step, sl in enumerate((slice(0, 7), slice(7, 8))):
        logits, cache = smodel(ids[:, sl], cache=cache)
        assert_logits_close(np.asarray(logits), ref[step], model, f"data=8 step {step}")
    assert cache.layers[0].recurrent.sharding.spec[0] == "data"
    with pytest.raises(S.ShardingError, match="no axis the 'experts' rule maps to.*exchange='allgather'"):
        S.shard_model(model, mesh, execution=Execution(exchange="ragged"))


def test_load_sharded_places_tensors_as_read_and_equals_unsharded(tiny_model_and_reference, tmp_path):
    """A checkpoint loaded straight onto the mesh (`load_sharded`: `checkpoint_shardings` per tensor, then
    `shard_model`) is placed at load (experts E/8 per device, the rest replicated) and gives the unsharded
    model's logits; a mesh that does not divide the experts, or a TP-MoE layout, is refused before any read."""
    import qwen35

    model, ids, ref = tiny_model_and_reference
    qwen35.save_hf_checkpoint(model, tmp_path)
    mesh = S.make_mesh(expert=8)
    placed = []
    shard = S.checkpoint_shardings(mesh, config=model.config)

    def spy(name, shape):
        sharding = shard(name, shape)
        placed.append((name, sharding.spec))
        return sharding

    loaded = qwen35.load_hf_checkpoint(tmp_path, shardings=spy, progress=False)
    specs = dict(placed)
    assert specs["model.layers.0.mlp.experts.gate_up_proj"] == P("expert", None, None)
    assert specs["model.layers.0.mlp.experts.down_proj"] == P("expert", None, None)
    assert specs["model.layers.3.self_attn.q_proj.weight"] == P(None, None)
    gu = loaded.model.layers[0].mlp.experts.gate_up_proj[...]
    assert gu.addressable_shards[0].data.shape == (model.config.num_experts // 8, *gu.shape[1:])

    smodel = S.load_sharded(tmp_path, mesh, progress=False)
    assert smodel.execution.exchange == "allgather" and smodel.mesh is mesh
    cache = smodel.init_cache(8, 16)
    for step, sl in enumerate((slice(0, 7), slice(7, 8), slice(8, 9))):
        logits, cache = smodel(ids[:, sl], cache=cache)
        assert_logits_close(logits, ref[step], model, f"step {step}")

    with pytest.raises(S.ShardingError, match="expert"):  # 8 experts over 3 devices
        S.load_sharded(tmp_path, S.make_mesh(expert=3, devices=jax.devices()[:3]), progress=False)
    with pytest.raises(S.ShardingError, match="TP-MoE"):
        S.checkpoint_shardings(S.make_mesh(model=8), S.rules_with(expert_mlp=("model",)))


def test_load_sharded_keeps_fp8_experts_on_the_mesh(tiny_model_and_reference, tmp_path):
    """An FP8 checkpoint loaded with fp8="keep" straight onto the mesh: FP8 experts and their block scales both
    E/8 per device, logits equal to the same checkpoint loaded unsharded and dequantised; TP-MoE is refused."""
    import ml_dtypes

    import qwen35
    from qwen35.weights import quantize_experts_fp8

    model, ids, _ = tiny_model_and_reference
    fp8 = quantize_experts_fp8(model)  # the experts as float8 + 128x128 block scales, the rest as it is
    qwen35.save_hf_checkpoint(fp8, tmp_path)  # fused FP8 experts + scales

    mesh = S.make_mesh(expert=8)
    smodel = S.load_sharded(tmp_path, mesh, fp8="keep", progress=False)
    ex = smodel.model.layers[0].mlp.experts
    for arr in (ex.gate_up_proj[...], ex.down_proj_scale_inv[...]):
        assert arr.sharding.spec == P("expert", None, None)
        assert arr.addressable_shards[0].data.shape[0] == model.config.num_experts // 8
    assert ex.gate_up_proj[...].dtype == ml_dtypes.float8_e4m3fn
    ref_model = qwen35.load_hf_checkpoint(tmp_path, progress=False)  # unsharded, dequantised on load
    cache, rcache = smodel.init_cache(8, 16), ref_model.init_cache(8, 16)
    for step, sl in enumerate((slice(0, 7), slice(7, 8))):
        logits, cache = smodel(ids[:, sl], cache=cache)
        want, rcache = ref_model(ids[:, sl], cache=rcache)
        assert_logits_close(logits, want, model, f"step {step}")
    # the CLI serves it the same way (`--fp8 keep`, the default on an accelerator)
    from qwen35.__main__ import main

    want = np.asarray(qwen35.generate(ref_model, np.asarray([list(b"Hi FP8")]), 4))[0].tolist()
    assert_no_near_tie(greedy_step_logits(ref_model, list(b"Hi FP8"), want), model_terms(ref_model.config, 10))
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "Hi FP8", "--max-tokens", "4",
                 "--max-num-batched-tokens", "16", "--expert-parallel", "8", "--fp8", "keep", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["token_ids"] == want
    kept = qwen35.load_hf_checkpoint(tmp_path, fp8="keep", progress=False)
    with pytest.raises(S.ShardingError, match="FP8"):
        S.shard_model(kept, S.make_mesh(expert=4, model=2), rules=S.rules_with(expert_mlp=("model",)))


TP_LAYOUTS = {
    # TP attention (heads, vocab, shared expert over "model") + the EP x TP-MoE hybrid (each expert's width over
    # "model", experts over "expert")
    "tp_attention+ep_x_tp_moe": (dict(expert=4, model=2), dict(rules=S.rules_with(expert_mlp=("model",)))),
    # TP=4 attention with the 2 KV heads replicated (what TP=8 on the real model must do), chunked exchange
    "tp4_replicated_kv+chunks": (dict(expert=2, model=4), dict(rules=S.rules_with(kv_heads=()),
                                                             execution=Execution(moe_chunks=2))),
}


@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tensor_parallel_layouts_equal_unsharded(tiny_model_and_reference, layout):
    model, ids, ref = tiny_model_and_reference
    axes, kw = TP_LAYOUTS[layout]
    smodel = S.shard_model(model, S.make_mesh(**axes), **kw)
    attn = smodel.model.layers[3].self_attn
    assert attn.q_proj.weight[...].sharding.spec == P("model", None)  # query heads split
    kv_split = layout.startswith("tp_attention")
    assert attn.k_proj.weight[...].sharding.spec == (P("model", None) if kv_split else P(None, None))
    gu = smodel.model.layers[0].mlp.experts.gate_up_proj[...]
    if "tp_moe" in layout:  # experts over "expert", each expert's 2I rows over "model", regrouped [gate_j; up_j]
        assert gu.sharding.spec == P("expert", "model", None)
        I = model.config.moe_intermediate_size
        np.testing.assert_array_equal(np.asarray(S.tp_deinterleave_gate_up(gu, 2)),
                                      np.asarray(model.model.layers[0].mlp.experts.gate_up_proj[...]))
        assert gu.addressable_shards[0].data.shape[1] == I
    cache = smodel.init_cache(8, 16)
    assert cache.layers[3].k.sharding.spec == P("expert", None, "model" if kv_split else None, None)
    for step, sl in enumerate((slice(0, 7), slice(7, 8), slice(8, 9))):
        logits, cache = smodel(ids[:, sl], cache=cache)
        assert_logits_close(logits, ref[step], model, f"{layout} step {step}")


def test_two_level_mesh_specs_and_batch_errors(tiny_model_and_reference):
    model, ids, _ = tiny_model_and_reference
    mesh = S.make_mesh(data=2, expert=4)
    smodel = S.shard_model(model, mesh)
    gu = smodel.model.layers[0].mlp.experts.gate_up_proj[...]
    assert gu.sharding.spec == P("expert", None, None) and gu.addressable_shards[0].data.shape[0] == 2
    cache = smodel.init_cache(8, 16)
    assert cache.layers[3].v.sharding.spec == P(("data", "expert"), None, None, None)
    assert cache.index.sharding.spec == P()
    with pytest.raises(S.ShardingError, match="batch 6 cannot be split .* multiple of 8"):
        smodel.init_cache(6, 16)
    with pytest.raises(S.ShardingError, match="batch 4 cannot be split"):
        smodel(ids[:4, :3])
    with pytest.raises(ValueError, match="exchange must be one of"):
        S.shard_model(model, mesh, execution=Execution(exchange="ring"))
    with pytest.raises(S.ShardingError, match="2 KV heads cannot be split"):
        S.shard_model(model, S.make_mesh(data=2, model=4))


def test_memory_plan_matches_hand_arithmetic():
    cfg = C.qwen35_397b_a17b()
    plan = S.memory_plan(cfg, {"expert": 8}, (64, 256, 512), 8192, expert_dtype_bytes=1, dense_dtype_bytes=2,
                         device_hbm_bytes=96 * GiB)
    # by hand: 60 layers x 512 experts x (gate, up, down) 1024 x 4096 at 1 byte, over 8 devices
    routed = 60 * 512 * 3 * 1024 * 4096
    assert plan["dp"]["weights_expert"] == routed // 8 == 48_318_382_080  # 45.0 GiB
    dense = cfg.param_counts()["total"] - routed
    assert plan["dp"]["weights_dense"] == 2 * dense
    assert 9.7e9 < dense < 9.9e9  # ~9.8B dense parameters, replicated in bf16: 18.3 GiB
    # per sequence at 8192 tokens: 15 attention layers x (K, V) x 2 heads x 256 x 2 bytes; 45 GDN layers of
    # fp32 [64, 128, 128] recurrent state and bf16 [12288, 4] conv state
    kv = 15 * 2 * 2 * 256 * 2 * 8192
    gdn = 45 * 64 * 128 * 128 * 4 + 45 * (2 * 16 * 128 + 64 * 128) * 4 * 2
    assert (kv, gdn) == (251_658_240, 193_167_360)
    assert plan["dp"]["state_per_seq"] == kv + gdn
    w = routed // 8 + 2 * dense
    for B in (64, 256, 512):
        row = plan["dp"]["by_concurrency"][B]
        assert row["seqs_per_device"] == B // 8 and row["total"] == w + B // 8 * (kv + gdn)
    assert plan["dp"]["by_concurrency"][512]["fits"]  # 89.8 GiB <= 96 GiB
    assert plan["dp"]["max_concurrency"] == 8 * ((96 * GiB - w) // (kv + gdn)) == 632
    # TP=8: dense split 8 ways except K/V projections (replicated), GDN state split over 64/8 heads, but the
    # whole KV cache of every sequence on every device
    kv_proj = 15 * 2 * 2 * 256 * 4096
    w_tp = routed // 8 + 2 * (dense - kv_proj) // 8 + 2 * kv_proj
    assert plan["tp"]["weights"] == w_tp
    assert plan["tp"]["state_per_seq"] == kv + gdn // 8
    assert plan["tp"]["by_concurrency"][64]["fits"] and not plan["tp"]["by_concurrency"][256]["fits"]
    assert plan["tp"]["max_concurrency"] == (96 * GiB - w_tp) // (kv + gdn // 8) == 189  # "near 200"


def test_decode_step_lowers_for_tpu_from_shapes_only():
    cfg = C.qwen35_397b_a17b(num_hidden_layers=4)  # one [L, L, L, F] block at full width
    mesh = AbstractMesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    exp = S.decode_step_lowering(cfg, mesh, batch=64, max_len=8192)
    assert exp.platforms == ("tpu",) and exp.nr_devices == 8
    text = exp.mlir_module()
    assert "all_gather" in text and "reduce_scatter" in text
    with pytest.raises(S.ShardingError, match="multiple of 8"):
        S.decode_step_lowering(cfg, mesh, batch=12, max_len=64)


def test_cli_generate_serves_a_checkpoint_with_expert_parallel(tiny_model_and_reference, tmp_path, capsys):
    """`python -m qwen35 generate --checkpoint PATH --expert-parallel 8` loads the checkpoint onto 8 devices and
    streams `qwen35.generate`'s greedy tokens (no tokenizer.json in the folder: byte tokens)."""
    import qwen35
    from qwen35.__main__ import main

    model, _, _ = tiny_model_and_reference
    qwen35.save_hf_checkpoint(model, tmp_path / "ckpt")
    prompt = "Hello, TPU"
    want = np.asarray(qwen35.generate(model, np.asarray([list(prompt.encode())]), 5))[0].tolist()
    assert_no_near_tie(greedy_step_logits(model, list(prompt.encode()), want), model_terms(model.config, 15))
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", prompt, "--max-tokens", "5",
                 "--max-num-batched-tokens", "16", "--expert-parallel", "8", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["token_ids"] == want[-5:]
    assert "experts split over 8 devices" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="9.*8 devices"):
        main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--expert-parallel", "9"])
