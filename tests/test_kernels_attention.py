"""The ragged paged attention kernel (`qwen35.kernels.ragged_paged_attention`) in TPU interpret mode with race
detection, against the gather-then-attend reference and, per sequence, against a float64 NumPy causal attention;
its TPU lowering; the attention layer and the whole tiny model with `Execution(kernels="pallas")`
against `kernels="xla"`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import BF16_EPS, assert_close, attention_terms, model_terms
from pallas_helpers import RACES, clean_interpreter, races_found  # noqa: F401 (autouse fixture)
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import qwen35
from qwen35.execution import Execution
from qwen35.attention import GatedAttention
from qwen35.config import FULL, LINEAR
from qwen35.kernels.ragged_paged_attention import (ragged_paged_attention, ragged_paged_attention_pool,
                                                   ragged_paged_attention_reference)
from qwen35.model import Qwen35ForCausalLM



def _racy_kernel(x_hbm, o_ref, buf, sem):
    cp = pltpu.make_async_copy(x_hbm, buf, sem)
    cp.start()
    buf[...] = jnp.zeros(buf.shape, buf.dtype)     # BUG: writes the DMA's destination while it is in flight
    cp.wait()
    o_ref[...] = buf[...]


@pytest.mark.timeout(120)
def test_race_detector_flags_a_racy_kernel():
    """The race flag the kernel tests assert on does fire: a write into a buffer with a DMA in flight."""
    out = pl.pallas_call(
        _racy_kernel, in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, 128), lambda: (0, 0)), out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
        interpret=RACES)(jnp.ones((8, 128), jnp.float32))
    jax.block_until_ready(out)
    assert races_found()


def make_batch(rng, q_lens, kv_lens, *, page_size, slots=None, pages_per_seq=None, num_q=None, Hq=4, Hkv=2,
               D=8, num_seqs=None, extra_pages=3, dtype=np.float32):
    """Random paged inputs: each sequence's pages are scattered through the pool (a random permutation).

    slots / pages_per_seq / num_q fix the array shapes (S, P, Tq) so that batches with different ragged
    structure share one compiled kernel: raggedness is data, not shape. Unused slots get q_len = kv_len = 0."""
    S = slots or len(q_lens)
    q_lens, kv_lens = list(q_lens) + [0] * (S - len(q_lens)), list(kv_lens) + [0] * (S - len(kv_lens))
    P = pages_per_seq or max(1, max(-(-kv // page_size) for kv in kv_lens))
    assert all(kv <= P * page_size for kv in kv_lens)
    num_pages = S * P + extra_pages
    page_indices = rng.permutation(num_pages)[: S * P].reshape(S, P).astype(np.int32)
    k_pages = rng.standard_normal((num_pages, page_size, Hkv, D)).astype(dtype)
    v_pages = rng.standard_normal((num_pages, page_size, Hkv, D)).astype(dtype)
    cu = np.cumsum([0, *q_lens]).astype(np.int32)
    Tq = num_q or int(cu[-1]) + 1
    assert Tq >= cu[-1]
    q = rng.standard_normal((Tq, Hq, D)).astype(dtype)
    ns = np.array([len([x for x in q_lens]) if num_seqs is None else num_seqs], np.int32)
    return q, k_pages, v_pages, np.array(kv_lens, np.int32), page_indices, cu, ns


def check_per_sequence(args, out):
    """Independent check in float64 numpy: each sequence's rows equal causal softmax attention over its own
    gathered keys (query i of a q_len-token chunk sits at position kv_len - q_len + i)."""
    q, kp, vp, kv_lens, pt, cu, ns = (np.asarray(a, np.float64) if i < 3 else np.asarray(a)
                                      for i, a in enumerate(args))
    G = q.shape[1] // kp.shape[2]
    for s in range(int(ns[0])):
        a, b = cu[s], cu[s + 1]
        if a == b:
            continue
        k = np.repeat(kp[pt[s]].reshape(-1, *kp.shape[2:])[: kv_lens[s]], G, axis=1)    # [L, Hq, D]
        v = np.repeat(vp[pt[s]].reshape(-1, *vp.shape[2:])[: kv_lens[s]], G, axis=1)
        pos = kv_lens[s] - (b - a) + np.arange(b - a)
        sc = np.einsum("thd,lhd->htl", q[a:b], k) / np.sqrt(q.shape[-1])
        sc = np.where(np.arange(kv_lens[s])[None, None, :] <= pos[None, :, None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        ref = np.einsum("htl,lhd->thd", p / p.sum(-1, keepdims=True), v)
        # float32 kernel vs float64: scores over D, then values over the sequence's keys
        assert_close(out[a:b], ref, terms=q.shape[-1] + int(kv_lens[s]), name=f"sequence {s}")


# name: (q_lens, kv_lens, num_seqs). Per page size the array shapes are fixed (S slots, P pages each, Tq query
# rows; see SHAPES), so each page size compiles the kernel once and the cases differ only in their ragged data.
CASES_16 = {
    "mixed": ([6, 1, 1, 3], [6, 32, 17, 40], None),       # a prefill, a decode ending on a page boundary, a decode,
                                                          # a 3-token chunk of a 40-token sequence
    "length_one": ([1], [1], None),
    "unused_slots": ([2, 1, 3, 2], [9, 20, 3, 48], 2),    # slots 2, 3 >= num_seqs: their rows are 0
    "one_long_chunk": ([11], [47], None),                 # rows span 3 query blocks; not a multiple of block_q
}
CASES_256 = {
    "chunk_over_two_pages": ([5, 1], [260, 256], None),   # the decode ends exactly on a page boundary
    "decodes": ([1, 1], [1, 300], None),
}
SHAPES = {16: dict(slots=4, pages_per_seq=3, num_q=12, block_q=4, pages_per_block=2),
          256: dict(slots=2, pages_per_seq=2, num_q=8, block_q=4, pages_per_block=1)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page_size,name", [(16, n) for n in CASES_16] + [(256, n) for n in CASES_256])
def test_kernel_matches_reference(page_size, name):
    q_lens, kv_lens, ns = (CASES_16 if page_size == 16 else CASES_256)[name]
    shp = SHAPES[page_size]
    rng = np.random.default_rng(len(name))
    args = make_batch(rng, q_lens, kv_lens, page_size=page_size, num_seqs=ns, slots=shp["slots"],
                      pages_per_seq=shp["pages_per_seq"], num_q=shp["num_q"])
    out = np.asarray(ragged_paged_attention(*args, block_q=shp["block_q"], pages_per_block=shp["pages_per_block"],
                                            interpret=RACES))
    assert not races_found(), "the race detector flagged the kernel"
    ref = np.asarray(ragged_paged_attention_reference(*args))
    # online softmax in blocks vs one softmax: scores over D, values (and the blocks' rescaling) over the keys
    assert_close(out, ref, terms=args[0].shape[-1] + int(np.max(args[3])), name=name)
    check_per_sequence(args, out)
    used = int(args[5][args[6][0]])
    assert np.all(out[used:] == 0), "rows of unused slots and padding must be 0"


@pytest.mark.timeout(240)
def test_kernel_bf16_and_scale():
    rng = np.random.default_rng(7)
    args = make_batch(rng, [4, 1], [4, 19], page_size=16, Hq=8, Hkv=2, dtype=jnp.bfloat16)
    out = ragged_paged_attention(*args, sm_scale=0.5, block_q=8)
    assert out.dtype == jnp.bfloat16
    ref = ragged_paged_attention_reference(*args, sm_scale=0.5)
    # both round bf16 intermediates (probabilities, outputs) in their own order: a few bf16 ulps of the output
    ref32 = np.asarray(ref.astype(np.float32))
    assert_close(out.astype(np.float32), ref32, atol=4 * BF16_EPS * float(np.max(np.abs(ref32))), name="bf16")


def test_bad_input_errors():
    rng = np.random.default_rng(0)
    q, kp, vp, kv, pt, cu, ns = make_batch(rng, [2], [2], page_size=16)
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_paged_attention(q[:, :3], kp, vp, kv, pt, cu, ns)
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(q, kp, vp, kv, pt, cu[:1], ns)
    with pytest.raises(ValueError, match="block_q"):
        ragged_paged_attention(q, kp, vp, kv, pt, cu, ns, block_q=0)


@pytest.mark.timeout(240)
def test_kernel_reads_a_layer_of_the_serving_pool():
    """`ragged_paged_attention_pool`: the K and V pages of one layer of the serving engine's pool (bits of float32
    in uint32, [2A, num_pages, page_size, Hkv, D]), the layer's index traced, equal the reference on that layer's
    pages as values, for each of three layers through one compiled kernel."""
    rng = np.random.default_rng(11)
    q, kp, vp, kv, pt, cu, ns = make_batch(rng, [3, 1], [3, 21], page_size=16)
    pages = rng.standard_normal((6, *kp.shape)).astype(np.float32)  # 3 layers' K and V pages
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint32)
    run = jax.jit(lambda ki: ragged_paged_attention_pool(q, bits, ki, kv, pt, cu, ns, kv_dtype=jnp.float32,
                                                         block_q=4, interpret=RACES))
    for layer in range(3):
        out = np.asarray(run(np.int32(2 * layer)))
        ref = np.asarray(ragged_paged_attention_reference(q, pages[2 * layer], pages[2 * layer + 1], kv, pt, cu, ns))
        assert_close(out, ref, terms=q.shape[-1] + int(np.max(kv)), name=f"layer {layer} of the pool")
    assert run._cache_size() == 1 and not races_found()


@pytest.mark.parametrize("page_size", [16, 256])
def test_lowers_for_tpu(page_size):
    """The Mosaic lowering (TPU layout rules interpret mode does not check) on serving-like shapes."""
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    S, P = 8, 4096 // page_size
    shapes = (sd((64, 16, 128), bf), sd((S * P, page_size, 2, 128), bf), sd((S * P, page_size, 2, 128), bf),
              sd((S,), i32), sd((S, P), i32), sd((S + 1,), i32), sd((1,), i32))
    f = jax.jit(lambda *a: ragged_paged_attention(*a, block_q=8, interpret=False))
    exported = jax.export.export(f, platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in exported.mlir_module()
    # the serving engine's pool: 4 layers' pages as bf16 bits, the layer's index traced
    pool = sd((8, S * P, page_size, 2, 128), jnp.uint16)
    g = jax.jit(lambda q, pool, ki, *a: ragged_paged_attention_pool(q, pool, ki, *a, kv_dtype=bf, block_q=8,
                                                                     interpret=False))
    exported = jax.export.export(g, platforms=["tpu"])(shapes[0], pool, sd((), i32), *shapes[3:])
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.timeout(300)
def test_attention_layer_without_cache():
    """The cache-free path: the just-computed K/V viewed as pages, pallas == xla."""
    cfg = qwen35.tiny()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 5, cfg.hidden_size)), jnp.float32)
    layer_xla = GatedAttention(cfg, rngs=nnx.Rngs(0))
    layer_pal = GatedAttention(cfg, rngs=nnx.Rngs(0), execution=Execution(kernels="pallas"))
    assert "name=_rpa" in str(jax.make_jaxpr(lambda x: layer_pal(x)[0])(x))   # the kernel is on the path
    y_xla, _ = layer_xla(x)
    y_pal, none = layer_pal(x)
    assert none is None
    assert_close(y_pal, y_xla, terms=attention_terms(cfg, 5), name="attention layer without cache")


@pytest.mark.timeout(600)
def test_model_pallas_backend_matches_xla():
    """Prefill into the cache and two cached decode steps: pallas logits == xla logits. Two layers (one GDN, one
    attention, both with the MoE) keep the interpreter's compile time down."""
    cfg = qwen35.tiny(num_hidden_layers=2, layer_types=(LINEAR, FULL))
    m_xla = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    m_pal = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0), execution=Execution(kernels="pallas"))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    # Not a self-comparison: the pallas model's program does go through the kernels (by their jitted wrappers).
    jaxpr = str(jax.make_jaxpr(lambda i: m_pal.forward(i, m_pal.init_cache(2, 16)).logits)(ids[:, :5]))
    used = set(re.findall(r"name=(\w+)", jaxpr))
    assert "pallas_call" in jaxpr and {"_rpa", "_gather_rows", "gmm_swiglu", "gmm", "_combine"} <= used, used
    assert "pallas_call" not in str(jax.make_jaxpr(lambda i: m_xla.forward(i).logits)(ids[:, :5]))
    c_xla, c_pal = m_xla.init_cache(2, 16), m_pal.init_cache(2, 16)
    for step, tok in enumerate([ids[:, :5], ids[:, 5:6], ids[:, 6:7]]):   # prefill, then two decode steps
        l_xla, c_xla = m_xla(tok, c_xla)
        l_pal, c_pal = m_pal(tok, c_pal)
        assert_close(l_pal, l_xla, terms=model_terms(cfg, 7), name=f"step {step}")
    assert int(c_pal.index) == 7
