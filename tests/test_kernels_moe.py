"""The MoE kernels in TPU interpret mode with race detection: grouped matmul with fused SwiGLU
(`qwen35.kernels.grouped_matmul`) against its masked reference and the package's XLA path
(`qwen35.moe.grouped_swiglu`), token permute / unpermute (`qwen35.kernels.permute`) against XLA gather and
scatter-add, the three chained against the dense one-hot MoE (`qwen35.moe.experts_dense`), and TPU lowering.

Shapes are fixed per test group so that cases with different group sizes (data, not shape) share one compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import BF16_EPS, assert_close, moe_terms
from pallas_helpers import RACES, clean_interpreter, races_found  # noqa: F401 (autouse fixture)

from qwen35.kernels.grouped_matmul import (dequantize_fp8_activations, experts_sorted_pallas, group_metadata,
                                           grouped_swiglu, grouped_swiglu_reference, grouped_swiglu_w8a8_reference,
                                           quantize_fp8_activations)
from qwen35.kernels.permute import permute, permute_reference, unpermute, unpermute_reference
from qwen35.moe import experts_dense, sort_by_expert
from qwen35.moe import grouped_swiglu as grouped_swiglu_xla

M, E, H, I, TM = 21, 5, 16, 8, 8          # 21 rows: not a multiple of the 8-row tile


def weights(rng, E, H, I, dtype=np.float32):
    gate_up = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(dtype)
    down = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(dtype)
    return gate_up, down


GROUPS = {
    "empty_groups": [3, 0, 9, 9, 0],      # empty groups in the middle and at the end; 9 straddles tiles
    "one_expert": [0, 0, 21, 0, 0],
    "singletons": [1, 1, 1, 1, 17],       # five groups inside the first tile
    "first_only": [21, 0, 0, 0, 0],
    "no_rows": [0, 0, 0, 0, 0],           # a device whose tokens all go to other devices' experts: zeros
    "some_rows": [2, 0, 3, 0, 0],         # rows past the groups' sum (other devices' slots) come back zero
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(GROUPS))
def test_grouped_swiglu_matches_references(name):
    rng = np.random.default_rng(len(name))
    gs = np.array(GROUPS[name], np.int32)
    x = rng.standard_normal((M, H)).astype(np.float32)
    gate_up, down = weights(rng, E, H, I)
    out = grouped_swiglu(x, gs, gate_up, down, tm=TM, interpret=RACES)
    assert not races_found(), "the race detector flagged the kernel"
    # gate/up over H, then down over I
    assert_close(out, grouped_swiglu_reference(x, gs, gate_up, down), terms=H + I, name=name)
    assert_close(out, grouped_swiglu_xla(x, gs, gate_up, down), terms=H + I, name=f"{name} vs qwen35.moe")


def test_group_metadata_visits():
    """Each (row tile, expert) pair with rows in common is visited once; empty experts never."""
    gs = jnp.array(GROUPS["empty_groups"], jnp.int32)          # rows [0,3) e0, [3,12) e2, [12,21) e3; tiles of 8
    offsets, group, tile, nvis = group_metadata(gs, M, TM)
    n = int(nvis[0])
    assert list(zip(np.asarray(group)[:n], np.asarray(tile)[:n])) == [(0, 0), (2, 0), (2, 1), (3, 1), (3, 2)]
    assert group.shape[0] == -(-M // TM) + E - 1                     # the static bound
    assert list(np.asarray(offsets)) == [0, 3, 3, 12, 21, 21]
    _, group, tile, nvis = group_metadata(jnp.zeros(E, jnp.int32), M, TM)   # nothing to visit: no index below 0
    assert int(nvis[0]) == 0 and np.asarray(tile).min() == 0
    assert 0 <= np.asarray(group).min() <= np.asarray(group).max() < E


@pytest.mark.timeout(240)
def test_grouped_swiglu_tiled_bf16():
    """More than one tile along I and H (the fp32 accumulator carried over the H loop), bf16 in and out."""
    rng = np.random.default_rng(3)
    H2, I2, E2 = 256, 256, 3
    gs = np.array([13, 0, 7], np.int32)
    x = rng.standard_normal((20, H2)).astype(jnp.bfloat16)
    gate_up, down = weights(rng, E2, H2, I2, jnp.bfloat16)
    out = grouped_swiglu(x, gs, gate_up, down, tm=8, ti=128, th=128, interpret=RACES)
    assert not races_found(), "the race detector flagged the kernel"
    assert out.dtype == jnp.bfloat16
    ref = grouped_swiglu_reference(x.astype(np.float32), gs, gate_up.astype(np.float32), down.astype(np.float32))
    # float32 accumulation on both sides; the kernel rounds the SwiGLU activations and its output to bf16, half
    # a bf16 ulp each, relative to the output's scale
    ref = np.asarray(ref)
    assert_close(out.astype(np.float32), ref, atol=2 * BF16_EPS * float(np.max(np.abs(ref))), name="bf16 tiled")


def test_grouped_swiglu_edge_and_errors():
    rng = np.random.default_rng(0)
    gate_up, down = weights(rng, E, H, I)
    assert grouped_swiglu(np.zeros((0, H), np.float32), np.zeros(E, np.int32), gate_up, down).shape == (0, H)
    x = rng.standard_normal((M, H)).astype(np.float32)
    with pytest.raises(ValueError, match="group_sizes must be"):
        grouped_swiglu(x, np.array([M], np.int32), gate_up, down)
    with pytest.raises(ValueError, match="down must be"):
        grouped_swiglu(x, np.array(GROUPS["one_expert"], np.int32), gate_up, down[:, :, :2])
    with pytest.raises(ValueError, match="tm must be"):
        grouped_swiglu(x, np.array(GROUPS["one_expert"], np.int32), gate_up, down, tm=12)


N, K = 7, 3                                # 7 tokens to 3 of 5 experts: M = 21 slots, as above


def routing(rng):
    """k distinct experts per token among the first E - 1: the last expert's group is empty."""
    experts = np.stack([rng.permutation(E - 1)[:K] for _ in range(N)]).astype(np.int32)
    w = rng.random((N, K)).astype(np.float32)
    return w / w.sum(1, keepdims=True), experts


@pytest.mark.timeout(240)
def test_permute_and_unpermute_match_xla():
    rng = np.random.default_rng(1)
    _, experts = routing(rng)
    assert all(len(set(row)) == K for row in experts)
    w = rng.random((N, K)).astype(np.float32)
    order, _ = sort_by_expert(jnp.asarray(experts), E)
    x = rng.standard_normal((N, H)).astype(np.float32)
    x_sorted = permute(x, order, K, interpret=RACES)
    assert not races_found(), "the race detector flagged permute"
    assert_close(x_sorted, permute_reference(x, order, K), atol=0, name="permute")
    y_sorted = rng.standard_normal((N * K, H)).astype(np.float32)
    y = unpermute(y_sorted, order, w, interpret=RACES)
    assert not races_found(), "the race detector flagged unpermute"
    assert_close(y, unpermute_reference(y_sorted, order, w), terms=K, name="unpermute")  # a K-term weighted sum


@pytest.mark.timeout(240)
def test_moe_on_kernels_matches_dense():
    """permute -> grouped SwiGLU -> unpermute equals the dense one-hot MoE (an independent formulation)."""
    rng = np.random.default_rng(2)
    w, experts = routing(rng)
    assert np.bincount(experts.reshape(-1), minlength=E)[E - 1] == 0   # an empty expert group
    x = rng.standard_normal((N, H)).astype(np.float32)
    gate_up, down = weights(rng, E, H, I)
    y = experts_sorted_pallas(x, w, experts, gate_up, down, tm=TM, interpret=RACES)
    assert not races_found(), "the race detector flagged a MoE kernel"
    assert_close(y, experts_dense(x, w, experts, gate_up, down), terms=H + I + K, name="MoE on kernels")


def fp8_weights(rng, E, H, I):
    """Random experts quantised the official way: (gate_up, down) float8 + their block scales, and the dequantised
    float32 weights they stand for."""
    from qwen35.weights import fp8_block_dequantize, fp8_block_quantize

    gate_up, down = weights(rng, E, H, I)
    (gq, gs), (dq, ds) = fp8_block_quantize(gate_up), fp8_block_quantize(down)
    return (gq, gs, dq, ds), (fp8_block_dequantize(gq, gs), fp8_block_dequantize(dq, ds))


@pytest.mark.timeout(240)
def test_grouped_swiglu_fp8_reads_fp8_tiles_and_matches_dequantised():
    """FP8 experts (two 128-blocks of H, an empty group, groups straddling 8-row tiles): the kernels that convert
    FP8 tiles in VMEM and scale each 128-wide step give the reference on the dequantised weights."""
    rng = np.random.default_rng(8)
    Ef, Hf, If, Mf = 3, 256, 128, 20
    gs = np.array([7, 0, 13], np.int32)
    (gq, gsc, dq, dsc), (gu, dn) = fp8_weights(rng, Ef, Hf, If)
    x = rng.standard_normal((Mf, Hf)).astype(np.float32)
    out = grouped_swiglu(x, gs, gq, dq, tm=TM, ti=128, th=128, gate_up_scale=gsc, down_scale=dsc, interpret=RACES)
    assert not races_found(), "the race detector flagged an FP8 kernel"
    # the kernel scales each 128-wide step's partial sum (exact in float32 up to rounding): gate/up over H, down over I
    assert_close(out, grouped_swiglu_reference(x, gs, gu, dn), terms=Hf + If, name="fp8 grouped swiglu")
    with pytest.raises(ValueError, match="both"):
        grouped_swiglu(x, gs, gq, dq, gate_up_scale=gsc)
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_swiglu(x[:, :40], gs, gq[:, :, :40], dq[:, :40], gate_up_scale=gsc, down_scale=dsc)


def test_fp8_activation_quantisation_per_512_block():
    """One scale per row and 512 columns: amax / 448, so the largest value of each block lands on e4m3's maximum;
    each value comes back to within half an e4m3 step (3 mantissa bits: 2^-4 relative) of its block's scale."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 1024)).astype(np.float32) * np.array([1.0, 100.0])[None].repeat(512, 1)
    x[2, :512] = 0.0  # an all-zero block: scale 1, values 0
    q, scale = quantize_fp8_activations(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (4, 2)
    want = np.abs(x).reshape(4, 2, 512).max(-1) / 448.0
    np.testing.assert_allclose(np.asarray(scale), np.where(want > 0, want, 1.0), rtol=1e-6)
    back = np.asarray(dequantize_fp8_activations(q, scale))
    err = np.abs(back - x).reshape(4, 2, 512)
    assert np.all(err <= 2.0 ** -4 * np.abs(x).reshape(4, 2, 512) + np.asarray(scale)[..., None] * 2.0 ** -9)
    with pytest.raises(ValueError, match="multiple of 512"):
        quantize_fp8_activations(jnp.zeros((2, 640)))


@pytest.mark.timeout(240)
def test_grouped_swiglu_w8a8_matches_its_reference_and_costs_a_few_percent():
    """FP8 activations x FP8 weights (512-wide activation scales, 128x128 weight scales), an empty group and groups
    straddling tiles: the kernels equal the plain W8A8 reference. The kernel and the reference compute the SwiGLU
    output in float32 in different orders before quantising it, so an element may round to the neighbouring e4m3
    value in one of them: most outputs agree to float32 rounding, none by more than a few such steps. Against
    FP8 weights with float32 activations (W8A16) the error is the activations' rounding, a few percent."""
    rng = np.random.default_rng(10)
    Ef, Hf, If, Mf = 3, 512, 512, 40
    gs = np.array([17, 0, 23], np.int32)
    (gq, gsc, dq, dsc), (gu, dn) = fp8_weights(rng, Ef, Hf, If)
    x = rng.standard_normal((Mf, Hf)).astype(np.float32)
    out = np.asarray(grouped_swiglu(x, gs, gq, dq, tm=16, gate_up_scale=gsc, down_scale=dsc, w8a8=True,
                                    interpret=RACES))
    assert not races_found(), "the race detector flagged a W8A8 kernel"
    ref = np.asarray(grouped_swiglu_w8a8_reference(jnp.asarray(x), jnp.asarray(gs), gq, dq, gsc, dsc))
    diff, top = np.abs(out - ref), np.max(np.abs(ref))
    assert np.median(diff) <= 1e-5 * top and diff.max() <= 0.02 * top, (np.median(diff), diff.max(), top)
    w8a16 = np.asarray(grouped_swiglu_reference(x, gs, gu, dn))
    rel = np.linalg.norm(ref - w8a16) / np.linalg.norm(w8a16)
    assert 0.005 < rel < 0.1, rel  # e4m3 keeps 3 mantissa bits: activations rounded twice, a few percent
    with pytest.raises(ValueError, match="needs FP8 experts"):
        grouped_swiglu(x, gs, gu, dn, w8a8=True)


@pytest.mark.timeout(240)
def test_moe_block_with_fp8_experts_on_the_kernels():
    """`SparseMoeBlock` with FP8 experts and kernels="pallas" hands the FP8 weights and scales to the kernels;
    its output equals kernels="xla"'s, which dequantises them first."""
    from flax import nnx

    from qwen35.config import tiny
    from qwen35.execution import Execution
    from qwen35.moe import SparseMoeBlock

    cfg = tiny(hidden_size=128, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2)
    rng = np.random.default_rng(9)
    (gq, gsc, dq, dsc), _ = fp8_weights(rng, 4, 128, 128)
    x = jnp.asarray(rng.standard_normal((1, 6, 128)), jnp.float32)
    outs = {}
    for kernels in ("xla", "pallas"):
        block = SparseMoeBlock(cfg, rngs=nnx.Rngs(0), fp8_experts=True, execution=Execution(kernels=kernels))
        ex = block.experts
        for name, value in (("gate_up_proj", gq), ("down_proj", dq), ("gate_up_proj_scale_inv", gsc),
                            ("down_proj_scale_inv", dsc)):
            getattr(ex, name).set_value(jnp.asarray(value))
        outs[kernels] = np.asarray(block(x)[0])
    assert_close(outs["pallas"], outs["xla"], terms=moe_terms(cfg), name="fp8 MoE block, pallas vs xla")


def test_permute_errors():
    with pytest.raises(ValueError, match="order must be"):
        permute(np.zeros((4, 8), np.float32), np.arange(7, dtype=np.int32), 2)
    with pytest.raises(ValueError, match="y_sorted must be"):
        unpermute(np.zeros((7, 8), np.float32), np.arange(8, dtype=np.int32), np.ones((4, 2), np.float32))


def test_moe_kernels_lower_for_tpu():
    """Mosaic lowering on 397B-like per-chip shapes: H = 4096, I = 1024 (bf16, and FP8 experts), 128-row tiles."""
    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    Hr, Ir, Er, Nr, kr = 4096, 1024, 16, 256, 10
    cases = [
        (lambda x, g, gu, d: grouped_swiglu(x, g, gu, d, tm=128, ti=512, th=512, interpret=False),
         (sd((Nr * kr, Hr), bf), sd((Er,), i32), sd((Er, 2 * Ir, Hr), bf), sd((Er, Hr, Ir), bf))),
        (lambda x, g, gu, d, gs, ds: grouped_swiglu(x, g, gu, d, tm=128, ti=512, th=512, gate_up_scale=gs,
                                                     down_scale=ds, interpret=False),
         (sd((Nr * kr, Hr), bf), sd((Er,), i32), sd((Er, 2 * Ir, Hr), jnp.float8_e4m3fn),
          sd((Er, Hr, Ir), jnp.float8_e4m3fn), sd((Er, 2 * Ir // 128, Hr // 128), jnp.float32),
          sd((Er, Hr // 128, Ir // 128), jnp.float32))),
        (lambda x, g, gu, d, gs, ds: grouped_swiglu(x, g, gu, d, tm=128, ti=512, th=512, gate_up_scale=gs,
                                                     down_scale=ds, w8a8=True, interpret=False),
         (sd((Nr * kr, Hr), bf), sd((Er,), i32), sd((Er, 2 * Ir, Hr), jnp.float8_e4m3fn),
          sd((Er, Hr, Ir), jnp.float8_e4m3fn), sd((Er, 2 * Ir // 128, Hr // 128), jnp.float32),
          sd((Er, Hr // 128, Ir // 128), jnp.float32))),
        (lambda x, o: permute(x, o, kr, interpret=False), (sd((Nr, Hr), bf), sd((Nr * kr,), i32))),
        (lambda y, o, w: unpermute(y, o, w, interpret=False),
         (sd((Nr * kr, Hr), bf), sd((Nr * kr,), i32), sd((Nr, kr), bf))),
    ]
    for f, shapes in cases:
        exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*shapes)
        assert "tpu_custom_call" in exported.mlir_module()
