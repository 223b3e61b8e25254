"""The serving engine (`qwen35.serving`): batch invariance against `qwen35.generate`, cache pressure with preemption,
load, bad input, sampling against a numpy reference of the distribution.

The model is the tiny preset in fp32 with the dense MoE path (same math as the default, compiles ~3x faster); the
reference is `qwen35.generate` running each request alone. Engines share one cache shape per block size, and the
engine pads rows to at least 32, so the jitted step programs are reused across tests.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_no_near_tie, assert_same_greedy, greedy_step_logits, model_terms
from flax import nnx

from qwen35.execution import Execution
from qwen35 import Qwen35ForCausalLM, generate, tiny
from qwen35.serving import BlockAllocator, Engine, SamplingParams, sample, sampling_probs

MAX_NEW = 8
MAX_LEN = 128
BUDGET = 64
# Blocks enough for 32 full-length sequences: pages plus each one's GDN state (tiny, float32: 5 blocks of 16-token
# pages, 3 of 256-token pages; test_pool_state_round_trip checks those sizes).
STATE_BLOCKS = {16: 5, 256: 3}
NUM_BLOCKS = {16: 32 * (MAX_LEN // 16 + 5) + 1, 256: 32 * (1 + 3) + 1}


@pytest.fixture(scope="module")
def model():
    return Qwen35ForCausalLM(tiny(), rngs=nnx.Rngs(0), execution=Execution(experts="dense"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    lens = [6, 40] * 16  # two lengths keep the reference to two compiles; 40 gets chunked under load
    return [rng.integers(0, 512, size=n).tolist() for n in lens]


@pytest.fixture(scope="module")
def max_tokens():
    return [3 + i % 6 for i in range(32)]  # 3..8: requests finish at different steps


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Each request alone through qwen35.generate (greedy)."""
    return [generate(model, np.asarray(p), MAX_NEW).tolist() for p in prompts]


@pytest.fixture(scope="module")
def reference_logits(model, prompts, reference):
    """The logits each reference token was chosen from (one teacher-forced forward pass per request)."""
    return [greedy_step_logits(model, p, r) for p, r in zip(prompts, reference)]


TERMS = model_terms(tiny(), MAX_LEN)  # the float32 bound's reduction chain, for the longest context served


def assert_greedy(outs, reference, reference_logits, max_tokens, what):
    """Each output has its max_tokens and is the reference's greedy continuation, up to a near tie (helpers)."""
    for i, (o, m) in enumerate(zip(outs, max_tokens)):
        assert o.error is None and len(o.token_ids) == m, f"request {i}: {o.error or len(o.token_ids)} tokens"
        assert_same_greedy(o.token_ids, reference[i], reference_logits[i], TERMS, name=f"request {i} {what}")


def make_engine(model, concurrency, block_size, chunked=True, num_blocks=None, **kw):
    kw.setdefault("min_batch_rows", 32)  # every step 32 rows: engines of any concurrency share compiled programs
    return Engine(model, max_num_seqs=concurrency, max_num_batched_tokens=BUDGET, block_size=block_size,
                  num_blocks=num_blocks or NUM_BLOCKS[block_size], max_model_len=MAX_LEN,
                  enable_chunked_prefill=chunked, **kw)


def assert_all_free(engine):
    assert engine.blocks.num_free == engine.num_blocks - 1, "blocks leaked"
    assert not engine.blocks.tables and not engine.blocks.states
    assert not engine.has_unfinished()


# Every combination of concurrency {1, 7, 32} x block size {16, 256} x chunked prefill {on, off}.
@pytest.mark.parametrize("concurrency,block_size,chunked",
                         list(itertools.product((1, 7, 32), (16, 256), (True, False))))
def test_batch_invariance_greedy(model, prompts, max_tokens, reference, reference_logits, concurrency, block_size,
                                 chunked):
    n = 8 if concurrency == 1 else len(prompts)  # one at a time: 8 requests make the point
    engine = make_engine(model, concurrency, block_size, chunked)
    outs = engine.generate(prompts[:n], [SamplingParams(max_tokens=m) for m in max_tokens[:n]])
    assert all(o.finish_reason == "length" for o in outs)
    assert_greedy(outs, reference, reference_logits, max_tokens[:n], "differs from generate")
    steps = engine.history
    rows = max(len(h["rows"]) for h in steps)
    assert rows <= concurrency and (rows == concurrency if concurrency <= 7 else rows >= 8)
    assert all(h["tokens"] <= BUDGET for h in steps)
    if concurrency > 1:  # prefill and decode shared a step
        assert any({k for _, _, k in h["rows"]} == {"prefill", "decode"} for h in steps)
    if chunked and concurrency == 32:  # some prompt was split over steps: more prefill rows than requests
        assert sum(k == "prefill" for h in steps for _, _, k in h["rows"]) > n
    assert_all_free(engine)


def test_cache_pressure_preempts_and_recomputes(model, prompts, max_tokens, reference, reference_logits):
    # 41 usable blocks, a GDN state taking 5: requests admitted on their first chunk's pages (prompts of 40 tokens
    # are cut to the budget left) outgrow the pool as their prompts and outputs grow.
    engine = make_engine(model, 8, 16, num_blocks=42)
    outs = engine.generate(prompts[:16], [SamplingParams(max_tokens=m) for m in max_tokens[:16]])
    assert engine.scheduler.num_preemptions > 0, "the test did not create cache pressure"
    assert sum(o.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    assert_greedy(outs, reference, reference_logits, max_tokens[:16], "differs from generate after preemption")
    assert min(h["free_pages"] for h in engine.history) <= 2
    assert_all_free(engine)


def test_request_larger_than_cache_is_rejected_not_stuck(model):
    engine = make_engine(model, 8, 16, num_blocks=4 + STATE_BLOCKS[16])  # 48 tokens beside one sequence's state
    with pytest.raises(ValueError, match="exceed the whole cache pool"):
        engine.add_request(list(range(40)), SamplingParams(max_tokens=20))
    assert not engine.has_unfinished()


def test_load_500_short_requests(model):
    rng = np.random.default_rng(2)
    engine = make_engine(model, 32, 16)
    prompts = [rng.integers(0, 512, size=int(rng.integers(1, 7))).tolist() for _ in range(500)]
    mt = [int(rng.integers(1, 4)) for _ in range(500)]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=m) for m in mt])
    assert len(outs) == 500
    assert len({o.request_id for o in outs}) == 500  # none duplicated
    assert [o.prompt_token_ids for o in outs] == prompts  # in order, none lost
    assert [len(o.token_ids) for o in outs] == mt
    assert all(o.finish_reason == "length" for o in outs)
    assert_all_free(engine)


def test_bad_input_fails_only_that_request(model, prompts, reference, reference_logits):
    for i in (0, 2, 3):  # the good requests' 5 tokens are compared exactly: the data has no near tie there
        assert_no_near_tie(reference_logits[i][:5], TERMS, name=f"reference {i}")
    engine = make_engine(model, 7, 16)
    good = SamplingParams(max_tokens=5)
    batch = [prompts[0], [], list(range(MAX_LEN + 5)), prompts[1], [3, 512, 7], [-1], prompts[2], prompts[3]]
    params = [good, good, good, SamplingParams(max_tokens=0), good, good, good, good]
    outs = engine.generate(batch, params)
    errors = [o.error for o in outs]
    assert "empty prompt" in errors[1]
    assert "max_model_len" in errors[2]
    assert "max_tokens must be an integer >= 1" in errors[3]
    assert "outside the vocabulary" in errors[4] and "outside the vocabulary" in errors[5]
    for i, ref in ((0, reference[0]), (6, reference[2]), (7, reference[3])):
        assert outs[i].error is None and outs[i].token_ids == ref[:5]
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    assert engine.generate([prompts[0]], good)[0].token_ids == reference[0][:5]  # the engine keeps going
    assert_all_free(engine)


def test_stop_tokens_stream_and_strings(model, prompts, reference, reference_logits):
    for i, n in ((0, 3), (1, 6)):  # compared exactly below: the data has no near tie there
        assert_no_near_tie(reference_logits[i][:n], TERMS, name=f"reference {i}")
    engine = make_engine(model, 7, 16)
    stop = reference[0][2]
    first = reference[0].index(stop)
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=8, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == reference[0][:first + 1]
    events = list(engine.stream(prompts[1], SamplingParams(max_tokens=6)))
    assert [t for e in events for t in e.token_ids] == reference[1][:6]
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    text = "hello serving"
    ids = list(text.encode())
    assert engine.generate([text], SamplingParams(max_tokens=4))[0].prompt_token_ids == ids
    assert_all_free(engine)


def test_seeded_sampling_is_reproducible_and_batch_invariant(model, prompts):
    p = SamplingParams(max_tokens=6, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    alone = make_engine(model, 7, 16).generate([prompts[4]], p)[0].token_ids
    crowd = make_engine(model, 7, 16).generate(prompts[:7], [SamplingParams(max_tokens=6, temperature=1.0, seed=i)
                                                            for i in range(4)] + [p] + [SamplingParams()] * 2)
    assert crowd[4].token_ids == alone  # same seed, different batch: same tokens
    other = make_engine(model, 7, 16).generate([prompts[4]], SamplingParams(
        max_tokens=6, temperature=0.9, top_k=50, top_p=0.9, seed=8))[0].token_ids
    assert other != alone


def numpy_probs(logits, T, k, p):
    """Reference: softmax(logits / T), keep the k largest, then the smallest prefix of the sorted probabilities
    whose mass reaches p, renormalise."""
    z = logits.astype(np.float64) / T
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), bool)
    keep[order[:k if k > 0 else len(z)]] = True
    q = np.where(keep, np.exp(z - z.max()), 0.0)
    q /= q.sum()
    mass = 0.0
    final = np.zeros(len(z), bool)
    for i in order:
        if not keep[i] or mass >= p:
            break
        final[i] = True
        mass += q[i]
    out = np.where(final, q, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("T,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.5, 20, 0.8), (2.0, 1, 1.0)])
def test_sampling_probs_match_numpy_reference(T, k, p):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, 64)).astype(np.float32) * 2
    got = np.asarray(jax.jit(sampling_probs)(logits, np.full(4, T, np.float32), np.full(4, k, np.int32),
                                    np.full(4, p, np.float32)))
    for row, lg in zip(got, logits):
        # probabilities (scale 1) from a 64-term normalisation, twice (the top-p mass, then the kept mass)
        assert_close(row, numpy_probs(lg, T, k, p), terms=2 * 64, scale=1.0, name=f"probs T={T} k={k} p={p}")


def test_samples_follow_the_restricted_distribution():
    rng = np.random.default_rng(4)
    V, N = 32, 3000
    lg = (rng.normal(size=V) * 1.5).astype(np.float32)
    T, k, p = 0.8, 6, 0.85
    ref = numpy_probs(lg, T, k, p)
    toks = np.asarray(jax.jit(sample)(np.tile(lg, (N, 1)), np.full(N, T, np.float32), np.full(N, k, np.int32),
                             np.full(N, p, np.float32), np.arange(N, dtype=np.uint32), np.zeros(N, np.int32)))
    freq = np.bincount(toks, minlength=V) / N
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(ref))  # never outside top-k ∩ top-p
    np.testing.assert_allclose(freq, ref, atol=4 * np.sqrt(ref.max() / N))
    greedy = np.asarray(sample(lg[None], np.zeros(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
                               np.zeros(1, np.uint32), np.zeros(1, np.int32)))
    assert greedy[0] == int(np.argmax(lg))


def test_allocators():
    blocks = BlockAllocator(5, 16)  # 4 usable pages
    assert blocks.allocate(1, 17) and len(blocks.tables[1]) == 2
    assert blocks.allocate(1, 32) == blocks.tables[1] and blocks.num_free == 2  # no growth needed
    assert not blocks.can_allocate(2, 49) and blocks.can_allocate(2, 32)
    assert 0 not in blocks.allocate(2, 32)  # page 0 is scratch
    blocks.free(1)
    blocks.free(2)
    assert blocks.num_free == 4
    pool = BlockAllocator(9, 16, state_blocks=3)  # 8 usable blocks, a GDN state takes 3
    assert pool.can_admit("a", 32) and not pool.can_admit("a", 97)  # 3 + 2 fit, 3 + 7 do not
    a = pool.allocate_state("a") + pool.allocate("a", 32)
    assert len(set(a)) == 5 and 0 not in a and pool.num_free == 3
    assert pool.allocate_state("a") == a[:3]  # taken once
    assert not pool.can_admit("b", 1)  # 3 + 1 > 3 free: the state and the pages come from the same blocks
    pool.free("a")
    assert pool.num_free == 8 and not pool.states and not pool.tables


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_pool_state_round_trip(dtype):
    """`write_state` / `read_state` on the pool: each GDN layer's states come back bit for bit (float32 recurrent
    states stored as 16-bit halves in a bf16 pool), writing one layer leaves every other layer's units and the
    attention pages alone (and the unused tail of its part-filled units), and a padding row (NO_BLOCK) reads zeros
    and writes nothing. The layout's sizes are the closed form: 16-token pages of 2 layers x K,V x 2 heads x 32
    dims are units of 1,024 elements, 4 a block; a layer's recurrent state 4 x 16 x 24 float32 takes 2 units (3 in
    bf16 halves), its conv state 160 x 4 one."""
    from qwen35.serving.cache import init_paged_cache, layout_bytes
    from qwen35.pool import NO_BLOCK, pool_layout, read_state, write_state

    cfg = tiny()
    lay = pool_layout(cfg, 16, dtype)
    halves = 2 if dtype == jnp.bfloat16 else 1
    assert (lay.unit, lay.units_per_block, lay.conv_units) == (1024, 4, 1)
    assert lay.rec_units == -(-1536 * halves // 1024) and lay.state_blocks == -(-6 * lay.layer_units // 4)
    pool = init_paged_cache(cfg, 16, 16, dtype).pool
    assert pool.dtype == (jnp.uint16 if halves == 2 else jnp.uint32)  # bits of the cache dtype
    rng = np.random.default_rng(0)
    pool = jnp.asarray(rng.integers(0, np.iinfo(pool.dtype).max, pool.shape), pool.dtype)  # every bit pattern
    blocks = jnp.asarray([[3, 7, 1, 12, 9, 5][:lay.state_blocks], [NO_BLOCK] * lay.state_blocks], jnp.int32)
    conv = jnp.asarray(rng.standard_normal((2, 160, 4)), dtype)
    rec = jnp.asarray(rng.standard_normal((2, 4, 16, 24)), jnp.float32)
    new = write_state(cfg, pool, 2, blocks, conv, rec)
    c2, r2 = read_state(cfg, new, 2, blocks, dtype)
    np.testing.assert_array_equal(np.asarray(r2[0]), np.asarray(rec[0]))
    np.testing.assert_array_equal(np.asarray(c2[0], np.float32), np.asarray(conv[0], np.float32))
    assert not np.any(np.asarray(r2[1])) and not np.any(np.asarray(c2[1], np.float32))  # padding row: zeros
    changed = np.asarray(new != pool)
    assert changed.sum() <= lay.rec_elems + lay.conv_elems  # one row's state of one layer, not its units' padding
    for j in (0, 1, 3, 4, 5):
        for got, was in zip(read_state(cfg, new, j, blocks, dtype), read_state(cfg, pool, j, blocks, dtype)):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(was, np.float32))
    b = layout_bytes(cfg, 20, 16, dtype_bytes=4)
    assert b["block_bytes"] == 16 * 1024 and b["pages"] == 2 and b["kv_bytes"] == 2 * 16 * 1024
    assert b["gdn_state_bytes"] == 5 * 16 * 1024 and b["gdn_waste_bytes"] == 5 * 16 * 1024 - 6 * (1536 + 640) * 4


def pool_layout_of(model):
    from qwen35.pool import pool_layout

    return pool_layout(model.config, 16, model.dtype)


def test_one_pool_moves_capacity_between_states_and_pages(model):
    """The same pool of blocks holds four short sequences at once (each one page and a 5-block GDN state) or one
    sequence of 300 tokens (19 pages and its state): two fixed pools of the same bytes sized for four sequences
    would hold four states and only four pages, and could serve neither the long one nor more short ones."""
    lay = pool_layout_of(model)
    num_blocks = 1 + 4 * (lay.state_blocks + 1)  # 25 blocks
    engine = Engine(model, max_num_seqs=8, max_num_batched_tokens=64, block_size=16, num_blocks=num_blocks,
                    max_model_len=320, min_batch_rows=8, min_page_width=20)
    outs = engine.generate([[1 + i] * 10 for i in range(6)], SamplingParams(max_tokens=4))
    assert all(o.error is None and len(o.token_ids) == 4 for o in outs)
    assert max(len(h["rows"]) for h in engine.history) == 4  # the blocks, not max_num_seqs = 8, bounded the batch
    assert_all_free(engine)
    (out,) = engine.generate([list(range(1, 297))], SamplingParams(max_tokens=4))
    assert out.error is None and len(out.token_ids) == 4
    assert_all_free(engine)
    with pytest.raises(ValueError, match="whole cache pool"):
        engine.add_request(list(range(1, 300)), SamplingParams(max_tokens=8))  # 19 pages + the state: no room


def test_engine_serves_a_sharded_model(model, prompts, max_tokens, reference, reference_logits):
    """A model from `shard_model` (experts split over the 8 fake devices) brings its mesh: the engine serves it with
    8 data-parallel ranks (tests/test_serving_dp.py checks that layout in depth), with the same tokens."""
    from qwen35 import sharding

    assert jax.device_count() == 8, "tests/conftest.py sets 8 fake CPU devices before jax starts"
    smodel = sharding.shard_model(model, sharding.make_mesh(expert=8))
    engine = make_engine(smodel, 4, 16)
    assert engine.num_ranks == 8 and engine.dp.expert_axes == ("expert",)
    outs = engine.generate(prompts[:4], [SamplingParams(max_tokens=m) for m in max_tokens[:4]])
    assert_greedy(outs, reference, reference_logits, max_tokens[:4], "differs from generate (sharded)")
    for rank in engine.ranks:
        assert rank.blocks.num_free == engine.num_blocks - 1 and not rank.blocks.states
    assert not engine.has_unfinished()


def test_prefill_block_lengths(model):
    """A step's prefill block is as long as its longest chunk rounded up to 16, 32, 64, then 256, 1024, ... (at most
    the token budget): a 5-token prompt gets a block of 16, not 64."""
    from qwen35.serving.engine import _block_len

    assert [_block_len(n) for n in (2, 16, 17, 32, 33, 64, 65, 256, 257)] == [16, 16, 32, 32, 64, 64, 256, 256, 1024]
    for lens, Lb in (([5], 16), ([5, 20], 32), ([40], 64)):
        engine = make_engine(model, 4, 16)
        for n in lens:
            engine.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=2))
        batch = engine.build_batch(engine.scheduler.schedule())
        assert batch.gather_idx.shape[1] == Lb and batch.gather_valid.sum() == sum(lens)


def test_mixed_step_runs_the_tokens_its_rows_and_block_can_hold(model, prompts, reference, reference_logits):
    """A mixed step's tokens are at most Sb + Sp·Lb (every row that does not prefill has one token), fewer than the
    next power of two when the prompt is long: 31 decoding sequences beside a 40-token prompt run 32 rows + a
    64-token block = 96 tokens, not 128; the tokens are generate's."""
    engine = Engine(model, max_num_seqs=32, max_num_batched_tokens=128, block_size=16, num_blocks=NUM_BLOCKS[16],
                    max_model_len=MAX_LEN, min_batch_rows=32)
    shapes = []
    step_shape = engine.step_shape
    engine.step_shape = lambda sched: shapes.append(step_shape(sched)) or shapes[-1]
    rids = [engine.add_request(p, SamplingParams(max_tokens=MAX_NEW)) for p in prompts[:31]]
    while any(r.num_computed < len(r.prompt) for r in engine.requests.values()):
        engine.step()
    assert all(len(engine.requests[i].output) < MAX_NEW for i in rids), "a sequence finished before the last prompt"
    rids.append(engine.add_request(prompts[31], SamplingParams(max_tokens=MAX_NEW)))
    engine.step()
    assert (shapes[-1].Sb, shapes[-1].Sp, shapes[-1].Lb, shapes[-1].Tb) == (32, 1, 64, 96)
    while engine.has_unfinished():
        engine.step()
    outs = [engine.requests[i] for i in rids]
    for i, r in enumerate(outs):
        assert_same_greedy(r.output, reference[i], reference_logits[i], TERMS, name=f"request {i}")
    assert_all_free(engine)


def test_layer_programs_compile_per_shape_of_what_they_read(model):
    """One program per layer runs each layer on only the batch fields it reads: a step whose page table is wider
    compiles the attention layers' program again but not the GDN layers' or the head's (they read no page table),
    and the step's tokens are the same either way."""
    from qwen35.serving.runner import BATCH_FIELDS, LayerwiseStep, StepBatch, batch_view

    assert set(BATCH_FIELDS["gdn"]).isdisjoint({"page_indices", "ctx_pages", "slot_mapping", "kv_lens"})
    view = batch_view(StepBatch(*range(len(StepBatch._fields))), "head")
    assert {f for f, x in zip(StepBatch._fields, view) if x is not None} == set(BATCH_FIELDS["head"])
    from qwen35.serving.cache import PagedHybridCache
    from qwen35.pool import SCRATCH_PAGE

    engine = make_engine(model, 2, 16)
    for p in ([1, 2, 3], [4, 5]):
        engine.add_request(p, SamplingParams(max_tokens=3))
    engine.step()  # prefill
    batch = engine.build_batch(engine.scheduler.schedule())  # a decode step
    step = LayerwiseStep(model)  # programs are shared by every runner of this model: count what each call adds
    progs = {"head": step.head[0], **{step.reads[i]: prog for i, (prog, _) in enumerate(step.layers)}}
    toks, sizes = [], []
    Sb, P = batch.page_indices.shape
    for extra in (0, 5):  # 5 more pages than the step needs: a width no bucket makes
        b = batch._replace(page_indices=np.concatenate(
            [batch.page_indices, np.full((Sb, extra), SCRATCH_PAGE, np.int32)], axis=1))
        cache = PagedHybridCache(jnp.array(engine.cache.pool, copy=True))  # the layer programs donate the pool
        toks.append(np.asarray(step(cache, b)[0]))
        sizes.append({k: f._cache_size() for k, f in progs.items()})
    assert sizes[1] == {**sizes[0], "attention": sizes[0]["attention"] + 1}
    np.testing.assert_array_equal(toks[0], toks[1])
    # The pool is donated and every layer writes only its own units: the compiled programs update it in place. A
    # copy of the whole pool per layer (XLA's way to keep a read's operand alive past a write it could not order)
    # would cost more than the layer's own work; write_state relies on the rule's data dependence to avoid it.
    embed, leaves = step.embed
    h = embed(leaves, batch.tokens, dtype=step.dtype)
    pool = engine.cache.pool
    for i in (step.reads.index("gdn"), step.reads.index("attention")):
        prog, leaves = step.layers[i]
        hlo = prog.lower(leaves, step.indices[i], h, pool, batch_view(batch, step.reads[i])).compile().as_text()
        copies = pool_copies(hlo, pool)
        assert not copies, f"the {step.reads[i]} layer program copies the pool: {copies[0][:200]}"

def pool_copies(hlo: str, pool) -> list[str]:
    """The instructions of a compiled program that copy an array of the pool's shape."""
    shape = "[" + ",".join(map(str, pool.shape)) + "]"
    return [line for line in hlo.splitlines() if " copy(" in line and shape in line.split("copy(")[0]]


@pytest.mark.parametrize("fused", [False, True])
def test_one_sequence_steps_update_the_pool_in_place(fused):
    """A step with one sequence still has two rows (`MIN_ROWS`, a padding row), and its programs update the pool
    in place. With one row every pool write was a one-index scatter, which XLA rewrites into a bounds-checked
    dynamic-update-slice; on CPU that copied the whole pool in every layer program (a one-sequence decode step of
    the tiny model cost 4x a two-row one, growing with the pool). Two layers keep the compile time down."""
    from qwen35.config import FULL, LINEAR
    from qwen35.serving.engine import MIN_ROWS
    from qwen35.serving.runner import batch_view

    m = Qwen35ForCausalLM(tiny(num_hidden_layers=2, layer_types=(LINEAR, FULL)), rngs=nnx.Rngs(0))
    engine = Engine(m, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, max_model_len=64, fused=fused)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    engine.step()  # the prefill
    batch = engine.build_batch(engine.scheduler.schedule())  # one sequence decoding
    assert MIN_ROWS == 2 and batch.tokens.shape == (2,)
    pool, run = engine.cache.pool, engine._run
    if fused:
        hlos = {"step": run.run.lower(run.leaves, engine.cache, batch, return_logits=False).compile().as_text()}
    else:
        embed, leaves = run.embed
        h = embed(leaves, batch.tokens, dtype=run.dtype)
        hlos = {run.reads[i]: prog.lower(leaves, run.indices[i], h, pool, batch_view(batch, run.reads[i])).compile().as_text()
                for i, (prog, leaves) in enumerate(run.layers)}
    for name, hlo in hlos.items():
        copies = pool_copies(hlo, pool)
        assert not copies, f"the {name} program copies the pool: {copies[0][:200]}"
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0]
    want = generate(m, np.asarray([1, 2, 3]), 4)
    assert out.error is None and len(out.token_ids) == 4
    assert_same_greedy(out.token_ids, want, greedy_step_logits(m, [1, 2, 3], want), model_terms(m.config, 64),
                       name="one sequence, padded to two rows, vs generate")


def test_rowwise_attention_equals_the_reference_on_engine_batches(model, prompts, max_tokens):
    """The XLA path's attention (`_paged_attention_rows`: each row's last token against its pages, the prefill rows
    again as a causal [Sp, Lb] block over their own new K/V and, for chunks that continue a sequence, its context
    pages) equals `ragged_paged_attention_reference` (every token against its sequence's pages) on the real tokens
    of every batch shape a mixed run produces: decode-only steps, whole-prompt prefills, continued chunks, and
    these together."""
    from qwen35.kernels.ragged_paged_attention import ragged_paged_attention_reference
    from qwen35.attention import _paged_attention_rows

    modes = set()
    for block_size in (16, 256):  # pages of 16: context pages + chunk; of 256: one page, read whole (Pc = P)
        engine = make_engine(model, 7, block_size)
        seen = {}
        run = engine._run

        def record(cache, batch, **kw):
            key = (batch.tokens.shape, batch.gather_idx.shape, int(batch.num_seqs[0]), batch.ctx_pages.shape,
                   batch.page_indices.shape[1])
            seen.setdefault(key, batch)
            return run(cache, batch, **kw)

        engine._run = record
        engine.generate(prompts[:12], [SamplingParams(max_tokens=m) for m in max_tokens[:12]])
        assert any(k[1][0] == 0 for k in seen) and any(k[1][0] > 0 and k[0][0] > k[1][0] for k in seen)
        modes |= {"own" if k[3][1] == 0 else "whole table" if k[3][1] == k[4] else "context"
                  for k in seen if k[1][0] > 0}
        rng = np.random.default_rng(0)
        cfg = model.config
        C, NB, _ = engine.cache.pool.shape
        pool_shape = (C, NB, block_size, cfg.num_key_value_heads, cfg.head_dim)  # the pool's page view
        kv_shape = pool_shape[1:]  # [num_pages, page_size, Hkv, D]
        Hq = cfg.num_attention_heads
        for (_, _, S, _, _), b in seen.items():
            q = rng.standard_normal((b.tokens.shape[0], Hq, kv_shape[-1]), np.float32)
            pages = rng.standard_normal(pool_shape, np.float32)
            k, v = pages[2], pages[3]  # attention layer 1's K and V pages
            bits = jax.lax.bitcast_convert_type(pages, engine.cache.pool.dtype)  # as the pool stores them
            T = int(b.cu_q_lens[S])
            with jax.default_matmul_precision("highest"):
                ref = ragged_paged_attention_reference(q, k, v, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs)
                k_new = k.reshape(-1, *kv_shape[2:])[b.slot_mapping]  # the step's own K/V, as written to the pages
                v_new = v.reshape(-1, *kv_shape[2:])[b.slot_mapping]
                got = _paged_attention_rows(q, k_new, v_new, bits, 2, b)
            # scores over D, then the values over the longest context's keys
            assert_close(np.asarray(got)[:T], np.asarray(ref)[:T], terms=kv_shape[-1] + int(np.max(b.kv_lens)),
                         name="paged attention rows")
    assert modes == {"own", "context", "whole table"}  # whole prompts; continued chunks, both ways


@pytest.mark.timeout(600)
def test_engine_with_the_pallas_backend_matches_generate():
    """`Execution(kernels="pallas")`: the engine's attention layers go through the ragged paged attention kernel (TPU interpret
    mode on CPU) over the block tables, its GDN layers through the paged decode kernel (states read and written in
    the pool by index) and the chunked prefill kernel, its experts through the grouped matmul + SwiGLU kernel, and greedy tokens equal `qwen35.generate` on the same weights with the XLA backend. Two layers (one
    GDN, one attention) keep the interpreter's compile time down."""
    from qwen35.config import FULL, LINEAR

    cfg = tiny(num_hidden_layers=2, layer_types=(LINEAR, FULL))
    m_xla = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    m_pal = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0), execution=Execution(kernels="pallas"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 20)]
    engine = Engine(m_pal, max_num_seqs=2, max_num_batched_tokens=32, block_size=16, max_model_len=64)
    batches = []
    run = engine._run

    def record(cache, batch, **kw):
        batches.append(batch)
        return run(cache, batch, **kw)

    engine._run = record
    outs = engine.generate(prompts, SamplingParams(max_tokens=3))
    for i, (o, p) in enumerate(zip(outs, prompts)):
        want = generate(m_xla, np.asarray(p), 3)
        assert_same_greedy(o.token_ids, want, greedy_step_logits(m_xla, p, want), model_terms(cfg, 64),
                           name=f"request {i}, Pallas engine vs XLA generate")
        assert len(o.token_ids) == 3
    h = np.zeros((batches[0].tokens.shape[0], cfg.hidden_size), np.float32)  # the first step: two prefill rows

    def jaxpr(i):
        prog, leaves = run.layers[i]
        return str(jax.make_jaxpr(lambda: prog(leaves, run.indices[i], h, engine.cache.pool, batches[0]))())

    assert "name=_rpa" in jaxpr(1)  # the attention layer: ragged paged attention over the block tables
    gdn = jaxpr(0)  # the GDN layer: the paged decode kernel for every row, the chunked kernel for the prefill block
    assert "name=_paged_conv_gdn_decode" in gdn and "name=_chunked_gdn_conv_packed" in gdn and "pallas_call" in gdn
    assert "name=gmm_swiglu" in gdn  # and the MoE: grouped matmul with the fused SwiGLU


def test_fused_engine_and_step_fn_match_generate():
    """`fused=True` (the default off CPU: the whole step as one program, `FusedStep`) gives the greedy tokens of
    `qwen35.generate`, and the one-shot `step_fn` gives the same tokens and logits as `FusedStep` on a mixed step.
    Two layers (one GDN, one attention) keep the compile time down."""
    from qwen35.config import FULL, LINEAR
    from qwen35.serving.runner import FusedStep, step_fn

    cfg = tiny(num_hidden_layers=2, layer_types=(LINEAR, FULL))
    m = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in (5, 20, 9)]
    engine = Engine(m, max_num_seqs=2, max_num_batched_tokens=32, block_size=16, max_model_len=64, fused=True)
    assert isinstance(engine._run, FusedStep)
    outs = engine.generate(prompts, SamplingParams(max_tokens=4))
    for i, (o, p) in enumerate(zip(outs, prompts)):
        want = generate(m, np.asarray(p), 4)
        assert_same_greedy(o.token_ids, want, greedy_step_logits(m, p, want), model_terms(cfg, 64),
                           name=f"request {i}, fused engine vs generate")
        assert len(o.token_ids) == 4
    assert_all_free(engine)

    engine.add_request(prompts[0], SamplingParams(max_tokens=4))
    engine.step()  # request 0 decodes next, request 1 prefills: one mixed step
    engine.add_request(prompts[1], SamplingParams(max_tokens=4))
    batch = engine.build_batch(engine.scheduler.schedule())
    assert batch.gather_idx.shape[0] >= 1

    def copy(cache):  # both programs donate the cache
        return jax.tree.map(lambda a: a.copy(), cache)

    graphdef, params = nnx.split(m)
    toks_a, logits_a, _ = step_fn(graphdef, params, copy(engine.cache), batch, return_logits=True)
    toks_b, logits_b, _ = engine._run(copy(engine.cache), batch, return_logits=True)
    np.testing.assert_array_equal(np.asarray(toks_a), np.asarray(toks_b))
    assert_close(logits_a, logits_b, terms=model_terms(cfg, int(np.max(batch.kv_lens))), name="step_fn vs FusedStep")


def test_serving_benchmark_interleaved_pair(model):
    """benchmarks/serving.py times static and continuous batching interleaved step by step: both engines finish the
    same requests with the same greedy tokens (batch invariance across the two schedules), static batching (a batch
    admitted only into an empty engine) takes more steps, and each mode's time is its own steps' sum (positive,
    the two together within the pair's wall time)."""
    import importlib.util
    import time
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    reqs = bench.mixed_workload(12, model.config.vocab_size, seed=1)
    engines = {m: make_engine(model, 4, 16) for m in ("static", "continuous")}
    t0 = time.perf_counter()
    res = bench.serve_interleaved(engines, reqs)
    wall = time.perf_counter() - t0
    for mode, e in engines.items():
        assert not e.has_unfinished() and len(e.requests) == len(reqs)
        assert all(r.output for r in e.requests.values())
        assert 0 < res[mode]["seconds"] < wall and res[mode]["steps"] == e.num_steps
        assert_all_free(e)
    outs = {m: {rid: r.output for rid, r in e.requests.items()} for m, e in engines.items()}
    assert outs["static"].keys() == outs["continuous"].keys()
    for rid, got in outs["continuous"].items():  # the same tokens, up to a near tie (helpers.assert_same_greedy)
        want, prompt = outs["static"][rid], engines["static"].requests[rid].prompt
        assert len(got) == len(want)
        assert_same_greedy(got, want, greedy_step_logits(model, prompt, want), TERMS, name=f"request {rid}")
    assert res["static"]["steps"] > res["continuous"]["steps"]
    assert res["static"]["seconds"] + res["continuous"]["seconds"] <= wall


def test_engine_device_benchmark_tiny(tmp_path):
    """benchmarks/engine_device.py on the tiny preset: its device-made random model has the model's own parameter
    shapes in bf16, and each row's roofline reads the closed-form bytes of its KV pages (whole 16-token pages of
    2 attention layers x K and V x 2 heads x 32 dims x 2 bytes per sequence)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "engine_device.py"
    spec = importlib.util.spec_from_file_location("bench_engine_device", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = tiny()
    made = nnx.state(bench.random_model(cfg))
    ref = nnx.state(Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    assert jax.tree.map(lambda a: a.shape, made) == jax.tree.map(lambda a: a.shape, ref)
    assert {a.dtype for a in jax.tree.leaves(made)} == {jnp.dtype(jnp.bfloat16)}
    out = bench.main(["--preset", "tiny", "--batches", "2", "--context", "16", "--new-tokens", "4",
                      "--block-size", "16", "--json", str(tmp_path / "ed.json")])
    (row,) = out["rows"]
    assert row["batch"] == 2 and row["decode_steps"] >= 1 and row["step_s"] > 0
    assert row["bytes"]["kv_cache"] == 2 * 32 * (cfg.num_full_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2)
    assert row["bytes"]["total"] == pytest.approx(sum(v for k, v in row["bytes"].items() if k != "total"))
    assert json.loads((tmp_path / "ed.json").read_text())["rows"][0]["batch"] == 2
