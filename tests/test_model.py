"""The hybrid model's own API: cache phases, generation, errors. (Logit parity with transformers lives in
test_parity.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, assert_same_greedy, model_terms

import qwen35
from qwen35.model import HybridCache, Qwen35ForCausalLM


@pytest.fixture(scope="module")
def model():
    return Qwen35ForCausalLM(qwen35.tiny(num_hidden_layers=4), rngs=nnx.Rngs(0))  # one [L, L, L, F] period


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(0, 512, (2, 7)).astype(np.int32)


def test_structure_mirrors_checkpoint_names(model):
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names and "model.norm.weight" in names
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.layers.3.self_attn.q_proj.weight" in names
    assert "model.layers.3.mlp.experts.gate_up_proj" in names
    assert model.num_params() == model.config.param_counts()["total"]


def test_cache_phases_equal_one_forward(model, prompt):
    full = np.concatenate([prompt, prompt[:, ::-1]], axis=1)  # 14 tokens
    ref, none = model(full)
    assert none is None and ref.shape == (2, 14, 512) and ref.dtype == jnp.float32
    cache = model.init_cache(2, 16)
    assert isinstance(cache, HybridCache) and int(cache.index) == 0 and cache.max_len == 16
    got = []
    lg, cache = model(full[:, :7], cache)  # prefill
    got.append(lg)
    for t in range(7, 10):  # decode
        lg, cache = model(full[:, t:t + 1], cache)
        got.append(lg)
    lg, cache = model(full[:, 10:14], cache)  # multi-token continuation
    got.append(lg)
    assert int(cache.index) == 14
    assert_close(np.concatenate(got, axis=1), ref, terms=model_terms(model.config, 14), name="cached phases")


def test_generate_greedy_is_argmax_of_the_model(model, prompt):
    out = qwen35.generate(model, prompt, 5)
    assert out.shape == (2, 5) and out.dtype == np.int32
    lg, _ = model(np.concatenate([prompt, out], axis=1))
    for b in range(2):  # the argmax of the full forward pass, up to a near tie (helpers.assert_same_greedy)
        assert_same_greedy(out[b], np.argmax(lg[b, 6:-1], axis=-1), np.asarray(lg[b, 6:-1], np.float64),
                           model_terms(model.config, 12), name=f"row {b}, generate vs argmax")
    one = qwen35.generate(model, prompt[0], 5)  # 1-D prompt in, 1-D tokens out
    np.testing.assert_array_equal(one, out[0])


def test_generate_sampling_is_seeded_and_eos_sticks(model, prompt):
    a = qwen35.generate(model, prompt, 6, temperature=1.0, seed=3)
    b = qwen35.generate(model, prompt, 6, temperature=1.0, seed=3)
    np.testing.assert_array_equal(a, b)
    greedy = qwen35.generate(model, prompt, 6)
    eos = int(greedy[0, 1])
    out = qwen35.generate(model, prompt, 6, eos_token_id=eos)
    first = int(np.argmax(out[0] == eos))
    assert (out[0, first:] == eos).all()


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda m: m(np.zeros((2, 0), np.int32)), "empty"),
        (lambda m: m(np.full((1, 3), 512, np.int32)), r"must lie in \[0, 512\)"),
        (lambda m: m(np.zeros((1, 3), np.float32)), "integers"),
        (lambda m: m(np.zeros((1, 9), np.int32), m.init_cache(1, 8)), "does not fit the cache of 8 tokens"),
        (lambda m: m(np.zeros((2, 3), np.int32), m.init_cache(1, 8)), "batch"),
        (lambda m: m.init_cache(1, 10**6), "max_position_embeddings"),
        (lambda m: qwen35.generate(m, [], 3), "non-empty"),
        (lambda m: qwen35.generate(m, [1, 2], 5000), "exceeds the model's context"),
    ],
)
def test_bad_input_is_a_clear_error(model, call, match):
    with pytest.raises(ValueError, match=match):
        call(model)


def test_full_cache_rejects_more_tokens_and_keeps_state(model, prompt):
    cache = model.init_cache(2, 8)
    _, cache = model(prompt, cache)
    _, cache = model(prompt[:, :1], cache)
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError, match="continuation of 2 tokens at position 8"):
        model(prompt[:, :2], cache)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, cache))


def test_tied_embeddings_and_bf16():
    cfg = qwen35.tiny(tie_word_embeddings=True)
    m = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(1), param_dtype=jnp.bfloat16)
    assert m.lm_head is None
    ids = np.arange(10, dtype=np.int32)[None]
    lg, _ = m(ids)
    assert lg.dtype == jnp.float32 and np.isfinite(np.asarray(lg)).all()
    m32 = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(1), param_dtype=jnp.float32)
    nnx.update(m32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(m, nnx.Param)))
    lg32, _ = m32(ids)
    assert np.max(np.abs(np.asarray(lg) - np.asarray(lg32))) < 0.1


def test_calls_follow_value_and_structure_changes(prompt):
    """`model(ids)` keeps its split between calls (no per-call graph walk by nnx); it must still see new values of
    its Variables and re-split when the graph changes. Checked against the eager, untraced `model.forward`."""
    import gc
    import weakref

    m = Qwen35ForCausalLM(qwen35.tiny(num_hidden_layers=4), rngs=nnx.Rngs(1))
    ids = jnp.asarray(prompt)

    def check(name):
        with jax.default_matmul_precision("highest"):
            got, want = m(prompt)[0], m.forward(ids).logits
        assert_close(got, want, terms=model_terms(m.config, ids.shape[1]), name=name)
        return got

    ref = check("first call")
    m.lm_head.weight[...] = 2 * m.lm_head.weight[...]  # a new value in the same Variable
    # doubling a weight is exact in float32, so the logits double up to the two evaluations' rounding
    assert_close(check("new value"), 2 * ref, terms=model_terms(m.config, ids.shape[1]), name="logits x 2")
    m.model.norm.weight = nnx.Param(jnp.full_like(m.model.norm.weight[...], 0.5))  # a new Variable
    check("new Variable")
    m.model.layers[0].mlp.shared_expert = None  # a submodule removed: a different graph
    no_shared = check("submodule removed")
    assert float(jnp.max(jnp.abs(no_shared - ref))) > 1e-3
    for layer in m.model.layers:  # a static attribute
        layer.mlp.execution = qwen35.Execution(experts="dense")
    check("static attribute")
    qwen35.model.clear_programs()  # what the suite does between files: the next call rebuilds its program
    check("after clear_programs")
    alive = weakref.ref(m)
    del m
    gc.collect()
    assert alive() is None, "the remembered split must not keep the model alive"


def test_bf16_activations_stay_bf16_through_gdn(prompt):
    """The GDN rules compute in float32 (q, k normalised in it); the mixer's output returns to the activations'
    dtype, in the model and in the serving runner: a bf16 model keeps bf16 hidden states (half the bytes)."""
    from qwen35.serving import Engine, SamplingParams

    m = Qwen35ForCausalLM(qwen35.tiny(), rngs=nnx.Rngs(2), param_dtype=jnp.bfloat16)
    gdn = m.model.layers[0].linear_attn
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, m.config.hidden_size)), jnp.bfloat16)
    y, st = gdn(x)  # prefill (chunked rule)
    y1, _ = gdn(x[:, :1], st)  # decode (single-token rule)
    assert y.dtype == y1.dtype == jnp.bfloat16
    eng = Engine(m, max_num_seqs=2, max_num_batched_tokens=64, block_size=16, max_model_len=64)
    eng.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=2))
    eng.add_request([6], SamplingParams(max_tokens=2))
    batch = jax.device_put(eng.build_batch(eng.scheduler.schedule()))  # a prefill row and a one-token row
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((batch.tokens.shape[0], m.config.hidden_size)),
                     jnp.bfloat16)
    ys, pool = gdn.paged(xs, eng.cache.pool, 0, batch)  # GDN layer 0 on the engine's cache pool
    assert ys.dtype == jnp.bfloat16 and pool.dtype == jnp.uint16  # the pool keeps bf16's bits
