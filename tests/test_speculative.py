"""Speculative decoding in the engine (`Engine(speculative_tokens=k)`, the MTP head as drafter).

Greedy: the tokens equal `qwen35.generate`'s (one token at a time, no drafts) on the small model trained here,
whose logits are far from ties, with chunked prefill, preemption, stop tokens and a data-parallel mesh; afterwards
every block is free. Sampling: `verify_drafts` emits tokens distributed as the target (a chi-square-sized bound over
many draws on a five-token vocabulary), and a seeded request gets the same tokens alone or in a batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_helpers import clean_interpreter  # noqa: F401 (autouse fixture: these tests run interpreted kernels)
from flax import nnx

from qwen35.execution import Execution
from qwen35 import Qwen35ForCausalLM, generate, load_trained, sharding, tiny
from qwen35.serving import Engine, SamplingParams, sampling_probs
from qwen35.serving.sampling import verify_drafts

NEW = 12
TEXTS = ["Return the", "If the file does not exist, raise", "The default value of", "Create a new",
         "This function is", "Raise ValueError if", "Return a list of the", "An optional"]


@pytest.fixture(scope="module")
def trained():
    return load_trained(mtp=True)


@pytest.fixture(scope="module")
def prompts(trained):
    _, tok = trained
    return [tok.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module")
def reference(trained, prompts):
    model, _ = trained
    return [generate(model, np.asarray(p), NEW).tolist() for p in prompts]


def engine(model, k, **kw):
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("max_model_len", 96)
    return Engine(model, block_size=16, speculative_tokens=k, min_batch_rows=4, **kw)


def assert_all_free(eng):
    for rank in eng.ranks:
        assert rank.blocks.num_free == eng.num_blocks - 1, "blocks leaked"
        assert not rank.blocks.tables and not rank.blocks.states


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain_greedy(trained, prompts, reference, k):
    """Eight requests, four at a time, 32 tokens a step (the longer prompts are prefilled in chunks beside verify
    rows): every request's tokens are generate's, drafts were accepted and rejected, nothing leaks. k = 1 runs the
    fused step (one program), k = 3 the per-layer programs (the CPU default)."""
    model, _ = trained
    eng = engine(model, k, fused=(k == 1))
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.token_ids for o in outs] == reference
    assert 0 < eng.num_accepted < eng.num_drafted, (eng.num_accepted, eng.num_drafted)
    kinds = {kind for h in eng.history for _, _, kind in h["rows"]}
    assert {"prefill", "verify"} <= kinds
    assert eng.num_steps < sum(NEW for _ in prompts) / 4 + 8  # fewer steps than one token at a time
    assert_all_free(eng)


def test_speculative_under_cache_pressure_stop_tokens_and_a_mesh(trained, prompts, reference):
    """k = 2 (a) with blocks for about two sequences (preemptions: the requests recompute, drafts and all), (b) with
    a stop token the drafts run past (the output ends at it), (c) on make_mesh(expert=8): eight data-parallel
    ranks, the experts split over them."""
    model, _ = trained
    k = 2
    state = engine(model, k).state_blocks
    eng = engine(model, k, num_blocks=1 + 2 * state + 2)
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.token_ids for o in outs] == reference
    assert eng.num_preemptions > 0
    assert_all_free(eng)

    stop = reference[0][5]
    cut = reference[0].index(stop) + 1
    out = engine(model, k).generate([prompts[0]], SamplingParams(max_tokens=NEW, stop_token_ids=(stop,)))[0]
    assert out.token_ids == reference[0][:cut] and out.finish_reason == "stop"

    eng = engine(model, k, mesh=sharding.make_mesh(expert=8), max_num_seqs=1)
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.token_ids for o in outs] == reference
    assert eng.num_accepted > 0
    assert {q for h in eng.history for q in h["row_ranks"]} == set(range(8))
    assert_all_free(eng)


@pytest.mark.timeout(600)
def test_speculative_with_the_pallas_backend(trained, prompts, reference):
    """`Execution(kernels="pallas")` (TPU kernels in interpret mode): the verify rows go through the ragged paged attention
    kernel as rows of k + 1 queries and the GDN decode kernel token by token; greedy tokens equal generate's (XLA
    backend), with drafts accepted. Three requests, 8 tokens: the interpreter's compiles dominate."""
    model, _ = trained
    pal = Qwen35ForCausalLM(model.config, rngs=nnx.Rngs(0), mtp=True,
                            execution=Execution(kernels="pallas"))
    nnx.update(pal, nnx.state(model))
    eng = engine(pal, 2, max_model_len=64)
    outs = eng.generate(prompts[:3], SamplingParams(max_tokens=8))
    assert [o.token_ids for o in outs] == [r[:8] for r in reference[:3]]
    assert eng.num_accepted > 0
    assert_all_free(eng)


def test_verify_drafts_keeps_the_target_distribution():
    """Two drafts per row over a 5-token vocabulary: a likely one and an unlikely one, at temperature 0.7 with and
    without top-k = 3. Over N draws (one seed each) the first emitted token follows the target's distribution at
    position 0, and given that it was the first draft, the second follows position 1's: each frequency within
    5 standard errors. A greedy row accepts exactly while the draft is the argmax."""
    V, N = 5, 20000
    logits = jnp.asarray([[1.0, 2.0, 0.5, -1.0, 0.0], [0.0, 0.3, 2.5, 1.0, -0.5], [1.5, 0.0, 0.0, 0.7, 0.2]])
    for top_k in (0, 3):
        t, tk, tp = jnp.full(3, 0.7), jnp.full(3, top_k, jnp.int32), jnp.ones(3)
        target = np.asarray(sampling_probs(logits, t, tk, tp))
        for drafts in ([1, 2], [3, 4]):  # likely under the target, then unlikely (the residual does the work)
            d = jnp.asarray([drafts])

            def draw(seed):
                return verify_drafts(logits[None], d, t[:1], tk[:1], tp[:1], seed[None], jnp.zeros(1, jnp.int32))

            toks, counts = jax.vmap(draw)(jnp.arange(N, dtype=jnp.uint32))
            toks, counts = np.asarray(toks)[:, 0], np.asarray(counts)[:, 0]
            assert counts.min() >= 1 and counts.max() <= 3
            for pos, given in ((0, np.ones(N, bool)), (1, toks[:, 0] == drafts[0])):
                sub = toks[given & (counts > pos), pos]
                if len(sub) < 500:
                    continue
                freq = np.bincount(sub, minlength=V) / len(sub)
                se = np.sqrt(target[pos] * (1 - target[pos]) / len(sub)) + 1e-3
                assert np.all(np.abs(freq - target[pos]) <= 5 * se), (top_k, drafts, pos, freq, target[pos])
                assert np.all(freq[target[pos] == 0] == 0)  # never outside the top-k set
    greedy = np.argmax(np.asarray(logits), -1)
    d = jnp.asarray([[greedy[0], 4], [greedy[0], greedy[1]]])
    toks, counts = verify_drafts(jnp.stack([logits, logits]), d, jnp.zeros(2), jnp.zeros(2, jnp.int32),
                                 jnp.ones(2), jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32))
    assert counts.tolist() == [2, 3] and toks[0, :2].tolist() == greedy[:2].tolist()
    assert toks[1].tolist() == greedy.tolist()


def test_speculative_sampling_is_seeded_and_batch_invariant(trained, prompts):
    """A seeded request at temperature 0.8 gets the same tokens alone and beside seven others (its drafts,
    acceptance tests and replacement tokens depend on its own seed and logits only)."""
    model, _ = trained
    p = SamplingParams(max_tokens=NEW, temperature=0.8, top_k=50, seed=7)
    alone = engine(model, 2).generate([prompts[2]], p)[0].token_ids
    batch = engine(model, 2).generate(prompts, [SamplingParams(max_tokens=NEW, temperature=0.8, seed=i)
                                                for i in range(len(prompts))][:2] + [p] + [
        SamplingParams(max_tokens=NEW, temperature=0.8, seed=i) for i in range(3, len(prompts))])
    assert len(alone) == NEW and batch[2].token_ids == alone


def test_speculative_needs_the_mtp_head():
    m = Qwen35ForCausalLM(tiny(), rngs=nnx.Rngs(0), execution=Execution(experts="dense"))
    with pytest.raises(ValueError, match="mtp=True"):
        Engine(m, speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_tokens"):
        Engine(m, speculative_tokens=-1)
