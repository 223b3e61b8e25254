"""The serving engine on a mesh (`Engine(..., mesh=...)`): attention data-parallel over 8 fake CPU devices, experts
split by expert parallelism, the MoE exchanging tokens by all-gather / reduce-scatter inside the step.

Checked against `qwen35.generate` on one device (greedy, each request alone), on the Ironwood post's layout
(`make_mesh(expert=8)`: DP and EP over the same 8 devices), on `make_mesh(data=2, expert=4)`, on a pure
data-parallel mesh (experts replicated) and on a one-device mesh; page sizes 16 and 256, chunked prefill on and
off, both backends. Also: each device holds only its own rank's cache, preemption confined to the rank under
pressure, 500 requests over 8 ranks, bad input, and the collectives' bytes in the compiled step against the
napkin formula.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import assert_same_greedy, greedy_step_logits, model_terms
from pallas_helpers import clean_interpreter  # noqa: F401 (autouse fixture: these tests run interpreted kernels)
from flax import nnx

from qwen35.execution import Execution
from qwen35 import Qwen35ForCausalLM, generate, sharding, tiny
from qwen35.serving import Engine, SamplingParams

MAX_LEN = 128
BUDGET = 64
STATE = {16: 5, 256: 3}  # blocks of one GDN state (tiny, float32; tests/test_serving.py checks the layout)
TERMS = model_terms(tiny(), MAX_LEN)


@pytest.fixture(scope="module")
def model():
    assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices before jax starts"
    return Qwen35ForCausalLM(tiny(), rngs=nnx.Rngs(0), execution=Execution(experts="dense"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 512, size=n).tolist() for n in [6, 40] * 6]


@pytest.fixture(scope="module")
def max_tokens():
    return [2 + i % 5 for i in range(12)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Each request alone on one device, greedy, and the logits each token was chosen from."""
    toks = [generate(model, np.asarray(p), 6).tolist() for p in prompts]
    return toks, [greedy_step_logits(model, p, r) for p, r in zip(prompts, toks)]


def meshes():
    return {"expert=8": lambda: sharding.make_mesh(expert=8),
            "data=2,expert=4": lambda: sharding.make_mesh(data=2, expert=4),
            "data=8": lambda: sharding.make_mesh(data=8),
            "one device": lambda: sharding.make_mesh(expert=1, devices=jax.devices()[:1])}


def make_engine(model, mesh, block_size=16, chunked=True, max_num_seqs=2, num_blocks=None, **kw):
    kw.setdefault("min_batch_rows", max_num_seqs)  # one row count per engine: fewer programs to compile
    return Engine(model, mesh=mesh, max_num_seqs=max_num_seqs, max_num_batched_tokens=BUDGET, block_size=block_size,
                  num_blocks=num_blocks or max_num_seqs * (-(-MAX_LEN // block_size) + STATE[block_size]) + 1, max_model_len=MAX_LEN,
                  enable_chunked_prefill=chunked, **kw)


def assert_greedy(outs, reference, max_tokens, what):
    toks, logits = reference
    for i, (o, m) in enumerate(zip(outs, max_tokens)):
        assert o.error is None and len(o.token_ids) == m, f"request {i}: {o.error or len(o.token_ids)} tokens"
        assert_same_greedy(o.token_ids, toks[i], logits[i], TERMS, name=f"request {i} {what}")


def assert_all_free(engine):
    for k, r in enumerate(engine.ranks):
        assert r.blocks.num_free == engine.num_blocks - 1, f"rank {k}: blocks leaked"
        assert not r.blocks.tables and not r.blocks.states, f"rank {k}: a finished sequence kept pages or state"
        assert r.load == 0 and not r.scheduler.has_unfinished()


@pytest.mark.parametrize("mesh,block_size,chunked", [
    ("expert=8", 16, True), ("expert=8", 256, False), ("data=2,expert=4", 16, False),
    ("data=2,expert=4", 256, True), ("data=8", 16, True), ("one device", 16, True)])
def test_batch_invariance_on_a_mesh(model, prompts, max_tokens, reference, mesh, block_size, chunked):
    """Every request's greedy tokens equal `generate` alone on one device, whichever rank ran it and whatever the
    other ranks ran beside it (prefill chunks, decodes, padding ranks)."""
    mesh = meshes()[mesh]()
    # One sequence per rank on 8 ranks, two on one device: 12 requests then always outnumber the places, so later
    # requests prefill while others decode (on another rank, or beside them on the one device).
    engine = make_engine(model, mesh, block_size, chunked, max_num_seqs=1 if mesh.size > 1 else 2)
    assert engine.num_ranks == mesh.size
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert_greedy(outs, reference, max_tokens, f"differs from generate on {dict(mesh.shape)}")
    ranks = {k for h in engine.history for k in h["row_ranks"]}
    assert ranks == set(range(min(mesh.size, len(prompts))))  # least-loaded placement used every rank
    assert any({k for _, _, k in h["rows"]} == {"prefill", "decode"} for h in engine.history)  # mixed steps
    assert_all_free(engine)


def test_each_device_holds_only_its_ranks_cache(model):
    """The cache pool has a leading [dp] axis split over the mesh: device d's shard is rank d's pages and GDN states
    alone, and a model given unsharded is sharded by the engine (experts E/8 per device)."""
    mesh = sharding.make_mesh(expert=8)
    engine = make_engine(model, mesh)
    a = engine.cache.pool
    assert a.shape[0] == 8
    assert {s.data.shape for s in a.addressable_shards} == {(1, *a.shape[1:])}
    assert len({s.device for s in a.addressable_shards}) == 8
    gu = engine.model.model.layers[0].mlp.experts.gate_up_proj[...]
    E = model.config.num_experts
    assert {s.data.shape[0] for s in gu.addressable_shards} == {E // 8}


def test_preemption_on_one_rank(model, prompts, max_tokens, reference):
    """Cache pressure on rank 3 alone (every long prompt pinned there, 15 blocks: two such prompts' states and pages
    do not fit): it preempts and recomputes, the other ranks never do, every request completes with generate's
    tokens, and afterwards every block of every rank is free."""
    mesh = sharding.make_mesh(expert=8)
    engine = make_engine(model, mesh, max_num_seqs=4, num_blocks=16)  # a 40-token prompt: 5 state blocks + 3 pages
    ids = [engine.add_request(p, SamplingParams(max_tokens=m), dp_rank=3 if len(p) > 10 else i % 8)
           for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    while engine.has_unfinished():
        engine.step()
    outs = [engine._output(engine.requests.pop(r)) for r in ids]
    assert engine.ranks[3].scheduler.num_preemptions > 0, "the test did not create cache pressure on rank 3"
    assert all(r.scheduler.num_preemptions == 0 for k, r in enumerate(engine.ranks) if k != 3)
    assert sum(o.num_preemptions for o in outs) == engine.num_preemptions
    assert min(h["free_pages_per_rank"][3] for h in engine.history) <= 1
    assert_greedy(outs, reference, max_tokens, "differs from generate after preemption on rank 3")
    assert_all_free(engine)


def test_500_requests_over_8_ranks_and_bad_input(model):
    """500 short requests and 3 bad ones on 8 ranks: every good request completes once, in order, with its own
    number of tokens; the bad ones get their error and nothing else changes; the load is spread over all ranks."""
    rng = np.random.default_rng(2)
    engine = make_engine(model, sharding.make_mesh(expert=8), max_num_seqs=8, num_blocks=33 + 8 * STATE[16])
    good = [rng.integers(0, 512, size=int(rng.integers(1, 7))).tolist() for _ in range(500)]
    mt = [int(rng.integers(1, 4)) for _ in range(500)]
    bad = {100: [], 200: [7, 512], 300: list(range(MAX_LEN))}  # empty, id outside the vocabulary, too long
    prompts, params = list(good), [SamplingParams(max_tokens=m) for m in mt]
    for i, p in sorted(bad.items()):
        prompts.insert(i, p)
        params.insert(i, SamplingParams(max_tokens=2))
    outs = engine.generate(prompts, params)
    errors = {i: o.error for i, o in enumerate(outs) if o.finish_reason == "error"}
    assert sorted(errors) == sorted(bad)
    assert "empty prompt" in errors[100] and "outside the vocabulary" in errors[200]
    assert "does not fit max_model_len" in errors[300]
    ok = [o for o in outs if o.finish_reason != "error"]
    assert len({o.request_id for o in ok}) == 500
    assert [o.prompt_token_ids for o in ok] == good and [len(o.token_ids) for o in ok] == mt
    per_rank = np.bincount([k for h in engine.history for k, (_, _, kind) in zip(h["row_ranks"], h["rows"])
                            if kind == "prefill"], minlength=8)
    assert per_rank.min() >= 40, f"prefills per rank {per_rank}: placement did not balance"
    assert_all_free(engine)
    with pytest.raises(ValueError, match="dp_rank must be an int in"):
        engine.add_request([1, 2], dp_rank=8)


def test_engine_with_the_dropless_ragged_exchange(model, prompts, max_tokens, reference):
    """A model whose execution says exchange="ragged": the step's MoE sends exactly the routed rows by a ragged
    all-to-all (on CPU its padded transport) instead of all-gathering; greedy tokens equal `generate`."""
    smodel = sharding.shard_model(model, sharding.make_mesh(expert=8), execution=model.execution.replace(exchange="ragged"))
    engine = make_engine(smodel, None, max_num_seqs=1)
    assert engine.model.execution.exchange == "ragged"
    outs = engine.generate(prompts[:8], [SamplingParams(max_tokens=m) for m in max_tokens[:8]])
    assert_greedy(outs, (reference[0][:8], reference[1][:8]), max_tokens[:8], "differs from generate (ragged)")
    assert_all_free(engine)


def test_meshes_the_engine_refuses(model):
    """Tensor-parallel axes, a model sharded on another mesh and the dropping all-to-all exchange are refused with
    the fix in the message; nothing is half-built."""
    with pytest.raises(sharding.ShardingError, match="tensor"):
        make_engine(model, sharding.make_mesh(expert=4, model=2))
    smodel = sharding.shard_model(model, sharding.make_mesh(expert=8), execution=model.execution.replace(exchange="alltoall"))
    with pytest.raises(sharding.ShardingError, match="drops tokens past capacity.*Execution\\(exchange='allgather'\\)"):
        make_engine(smodel, None)
    with pytest.raises(sharding.ShardingError, match="the model's own mesh"):
        make_engine(smodel, sharding.make_mesh(data=2, expert=4))


def test_step_collectives_match_the_napkin_formula(model):
    """The compiled DP step's collectives per MoE layer, read from its HLO: an all-gather of each device's Tb
    tokens and packed routing over the expert axis and a reduce-scatter back, exactly `moe_comm_bytes`'s
    "allgather" bytes; attention and GDN add none (each rank reads only its own pages and states)."""
    mesh = sharding.make_mesh(data=2, expert=4)
    engine = make_engine(model, mesh, max_num_seqs=4)
    for p in ([1, 2, 3], list(range(20))):
        engine.add_request(p, SamplingParams(max_tokens=2))
    batch = engine._batch([r.scheduler.schedule() for r in engine.ranks])
    Tb = batch.tokens.shape[1]
    h = jax.device_put(np.zeros((8, Tb, model.config.hidden_size), np.float32), engine.dp.sharding())
    want = sharding.moe_comm_bytes(model.config, Tb, 4, "allgather", dtype_bytes=4)
    for i in (0, 3):  # a GDN layer and an attention layer
        prog, leaves = engine._run.layers[i]
        idx = engine._run.indices[i]
        hlo = prog.lower(leaves, idx, h, engine.cache.pool, batch).compile().as_text()
        got = sharding.hlo_collective_bytes(hlo)
        assert got["all-gather"] == want["all_gather_tokens"] + want["all_gather_routing"], (i, got, want)
        assert got["reduce-scatter"] == want["reduce_scatter"] and got["total"] == want["total"], (i, got, want)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mesh,block_size,chunked", [("data=2,expert=4", 16, True), ("expert=8", 256, False)])
def test_pallas_backend_on_a_mesh(mesh, block_size, chunked):
    """`kernels="pallas"` inside the data-parallel step: the ragged paged attention kernel reads each rank's own
    pages, the paged GDN decode kernel its own state blocks, the grouped matmul kernels each device's experts, and
    greedy tokens equal `generate` with the XLA backend on one device. Two layers (one GDN, one attention) keep the
    interpreter's compile time down; each rank's pool is the engine's default (on expert=8 with 256-token pages,
    640 KiB per device: `tests/conftest.py` sizes XLA's thread pool so the interpreted kernels do not hang)."""
    from qwen35.config import FULL, LINEAR

    cfg = tiny(num_hidden_layers=2, layer_types=(LINEAR, FULL))
    m_xla = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    m_pal = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0), execution=Execution(kernels="pallas"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 20, 9)]
    engine = Engine(m_pal, mesh=meshes()[mesh](), max_num_seqs=2, max_num_batched_tokens=32,
                    block_size=block_size, max_model_len=64, enable_chunked_prefill=chunked)
    outs = engine.generate(prompts, SamplingParams(max_tokens=3))
    for i, (o, p) in enumerate(zip(outs, prompts)):
        want = generate(m_xla, np.asarray(p), 3)
        assert_same_greedy(o.token_ids, want, greedy_step_logits(m_xla, p, want), model_terms(cfg, 64),
                           name=f"request {i}, Pallas engine on {mesh} vs XLA generate")
        assert len(o.token_ids) == 3
    assert_all_free(engine)


def test_serving_step_lowers_for_tpu():
    """The engine's whole step with `kernels="pallas"`, exported for a TPU from shapes (`plan.export_step`): every
    kernel lowers with Mosaic, which checks the TPU lowering rules that the interpret-mode runs of the other tests
    skip. One device: a decode step and a mixed step (one prefill chunk beside the decodes); the (2, 4) mesh: the
    mixed step inside the data-parallel `shard_map`, the MoE's exchange around the kernels, also with FP8 experts
    (W8A16 and W8A8) read by the kernels as stored."""
    import re

    from qwen35.config import FULL, LINEAR
    from qwen35.serving.plan import export_step

    cfg = tiny(num_hidden_layers=2, layer_types=(LINEAR, FULL))
    m = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0), execution=Execution(kernels="pallas"))
    attention, moe = {"_rpa_kernel"}, {"_gmm_swiglu_kernel", "_gmm_kernel"}
    decode, prefill = {"_paged_conv_gdn_kernel"}, {"_conv_chunked_gdn_kernel"}
    one = Engine(m, max_num_seqs=2, max_num_batched_tokens=32, block_size=16, max_model_len=64)
    dp = Engine(m, mesh=sharding.make_mesh(data=2, expert=4), max_num_seqs=2, max_num_batched_tokens=32,
                block_size=16, max_model_len=64, num_blocks=11)
    P = 64 // 16  # the Pallas path's page-table width: max_model_len's
    for engine, shape, want in [(one, (2, P, 2, 0, 1, 0), attention | moe | decode),
                                (one, (2, P, 32, 1, 16, 0), attention | moe | decode | prefill),
                                (dp, (2, P, 32, 1, 16, 0), attention | moe | decode | prefill)]:
        exported = export_step(engine, shape)
        text = exported.mlir_module()
        kernels = set(re.findall(r'kernel_name = "([^"]+)"', text))
        assert exported.platforms == ("tpu",) and want <= kernels, (shape, sorted(kernels))
        assert exported.nr_devices == (8 if engine is dp else 1)
        if engine is dp:  # the MoE exchange: all-gathers and reduce-scatters between the kernels
            assert "all_gather" in text and "reduce_scatter" in text
    # FP8 experts on the mesh, W8A16 and W8A8 (w8a8: the kernels' FP8 x FP8 products; whole 512-wide activation
    # blocks): the kernels inside the exchange read each device's experts as stored, float8, never a dequantised
    # float32 copy (tests/test_w8a8.py runs the FP8 exchange on the kernels on 8 devices)
    for w8a8 in (False, True):
        cq = tiny(num_hidden_layers=2, layer_types=(LINEAR, FULL), hidden_size=512, moe_intermediate_size=512,
                  num_experts=8, num_experts_per_tok=2)
        mq = Qwen35ForCausalLM(cq, rngs=nnx.Rngs(0), fp8_experts=True,
                               execution=Execution(kernels="pallas", w8a8=w8a8))
        dpq = Engine(mq, mesh=sharding.make_mesh(data=2, expert=4), max_num_seqs=2, max_num_batched_tokens=32,
                     block_size=16, max_model_len=64, num_blocks=11)
        text = export_step(dpq, (2, P, 32, 1, 16, 0)).mlir_module()
        assert moe <= set(re.findall(r'kernel_name = "([^"]+)"', text)) and "all_gather" in text, w8a8
        E, I2, H = mq.model.layers[0].mlp.experts.gate_up_proj[...].shape
        assert f"tensor<{E // 4}x{I2}x{H}xf8E4M3FN>" in text, w8a8      # each device's FP8 gate_up, as stored
        assert f"tensor<{E // 4}x{I2}x{H}xf32>" not in text, w8a8       # and no dequantised copy of it


def test_step_memory_from_shapes_alone():
    """`qwen35.serving.plan.step_memory` compiles the engine's own step from shapes: its per-device cache bytes
    equal the engine's allocator arithmetic (the pool's blocks: pages and GDN states, for
    concurrency / 8 sequences on the DP layout and all of them on the replicated one), its weights the model's
    bytes with the experts split 8 ways; replicating attention multiplies the cache by 8."""
    from qwen35.serving.plan import step_memory

    cfg = tiny()
    mesh = sharding.make_mesh(expert=8)
    C, ctx, bs = 64, 200, 16
    plans = {lay: step_memory(cfg, mesh, concurrency=C, context=ctx, block_size=bs, layout=lay,
                              param_dtype=np.float32, fp8_experts=False) for lay in ("dp", "replicated")}
    kv_page = bs * 2 * cfg.num_key_value_heads * cfg.head_dim * 4  # one layer's K and V page, float32
    for lay, seqs in (("dp", C // 8), ("replicated", C)):
        p = plans[lay]
        blocks = seqs * (-(-ctx // bs) + STATE[bs]) + 1  # pages and GDN state blocks, plus the scratch block
        assert p["num_blocks"] == blocks and p["seqs_per_cache"] == seqs
        assert p["cache"] == blocks * cfg.num_full_layers * kv_page  # a block: one page of every attention layer
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    experts = sum(layer.mlp.experts.gate_up_proj[...].nbytes + layer.mlp.experts.down_proj[...].nbytes
                  for layer in model.model.layers)
    assert plans["dp"]["weights"] == model.num_params() * 4 - experts + experts // 8
    assert plans["dp"]["weights"] == plans["replicated"]["weights"]
    assert plans["replicated"]["cache"] > 7 * plans["dp"]["cache"]
    for lay in plans:
        assert set(plans[lay]["programs"]) == {"embed", "layer (linear_attention)", "layer (full_attention)", "head"}
        p = plans[lay]
        assert p["temp"] > 0 and p["total"] == p["weights"] + p["cache"] + p["temp"]
