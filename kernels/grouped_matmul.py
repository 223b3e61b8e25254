"""Grouped matmul with fused SwiGLU: the expert MLP of a sorted MoE batch, as two Pallas TPU kernels.

Rows of `x_sorted [M, H]` are sorted by expert; `group_sizes [E]` (Σ = M, zeros allowed) says how many rows each
expert owns, in order. Expert e maps its rows through

    a = silu(x G_eᵀ) ⊙ (x U_eᵀ)      gate_up [E, 2I, H] = [G_e; U_e]  (the checkpoint's layout, rows gate then up)
    y = a D_eᵀ                        down [E, H, I]

`grouped_swiglu_reference` is the plain-JAX reference (a loop over experts with masks, written to be obviously
right; `qwen35.moe.grouped_swiglu` is the package's fast XLA path). `grouped_swiglu` runs the kernels:

  1. `gmm_swiglu`: grid (I / ti, visits, H / tk). A *visit* is one (row tile, expert) pair whose rows intersect
     (megablox's schedule): a row tile of `tm` rows that straddles a group boundary is visited once per expert,
     and each visit writes only its expert's rows. Gate and up tiles of the same expert are fetched in the same
     step (two BlockSpecs on the packed gate_up, the up one offset by I rows) and accumulated in fp32 VMEM
     scratch over the H loop; on the last H step SiLU(gate) ⊙ up is applied and written: the [M, 2I]
     intermediate never exists.
  2. `gmm`: the down projection [M, I] x [E, H, I] -> [M, H] with the same visit schedule.

Empty groups produce no visits; the visit list has a static bound (row tiles + E - 1) and the unused tail
repeats the last visit with its compute skipped. Inputs may be bf16; products accumulate in fp32.

FP8 experts (the official release's float8_e4m3fn weights with one scale per 128×128 block; `fp8="keep"` in the
loader): pass `gate_up_scale` / `down_scale` and the kernels read the FP8 weights as they are — one byte per weight
from HBM, half of bf16's — and convert each [t, 128] weight tile to x's dtype in VMEM (exact: e4m3 fits in bf16).
The contraction then runs in steps of one 128-wide scale block, so a step's partial product [tm, t] needs only
one scale per output column: Σ_k x_k·(q_jk·s_j,kb) = s_j,kb·Σ_k x_k·q_jk. `expand_fp8_scales` lays the block
scales out as [E, K/128, 1, N] (each block's scale repeated over its 128 output rows, 1/32 of the FP8 bytes) so a
step reads its (1, t) row of them with an ordinary BlockSpec.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35.kernels.fp8 import (ACT_BLOCK, FP8_BLOCK, dequantize_fp8_activations, fp8_dequantize,
                                fp8_round_activations, quantize_fp8_activations)
from qwen35.kernels.interpret import default_interpret
from qwen35.kernels.permute import permute, sort_by_expert, unpermute

__all__ = ["check_routed", "check_expert_weights",
           "grouped_swiglu", "grouped_swiglu_reference", "experts_sorted_pallas", "gmm_swiglu", "gmm",
           "group_metadata", "gmm_cost", "expand_fp8_scales", "quantize_fp8_activations",
           "dequantize_fp8_activations", "expand_act_scales", "grouped_swiglu_w8a8_reference", "ACT_BLOCK"]


def _shape_of(x) -> tuple:
    return tuple(x.shape)


def check_expert_weights(gate_up, down, H: int | None = None):
    """gate_up [E, 2I, H] and down [E, H, I] agree (and with x's H if given). Returns (E, I)."""
    if gate_up.ndim != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [E, 2I, H] (rows: gate then up), got shape {_shape_of(gate_up)}")
    E, I2, Hw = gate_up.shape
    if H is not None and Hw != H:
        raise ValueError(f"gate_up {_shape_of(gate_up)} has hidden size {Hw} but x has {H}")
    if _shape_of(down) != (E, Hw, I2 // 2):
        raise ValueError(f"down must be [E, H, I] = {(E, Hw, I2 // 2)} to match gate_up {_shape_of(gate_up)}, "
                         f"got {_shape_of(down)}")
    return E, I2 // 2


def check_routed(x, weights, experts, gate_up, down):
    """Shape checks of a routed MoE call (x [N, H], weights and experts [N, k], gate_up [E, 2I, H], down [E, H, I]):
    errors name the tensor and the expected shape. Returns (N, H, E, k)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [N, H] (flatten batch and time first), got shape {_shape_of(x)}")
    N, H = x.shape
    E, _ = check_expert_weights(gate_up, down, H)
    if weights.ndim != 2 or weights.shape[0] != N:
        raise ValueError(f"weights must be [N, k] with N = {N} (x's tokens), got shape {_shape_of(weights)}")
    if _shape_of(experts) != _shape_of(weights):
        raise ValueError(f"experts {_shape_of(experts)} and weights {_shape_of(weights)} must both be [N, k]")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"experts must hold integer expert ids, got dtype {experts.dtype}")
    if weights.shape[1] > E:
        raise ValueError(f"k = {weights.shape[1]} experts per token cannot exceed E = {E} experts")
    return N, H, E, weights.shape[1]


def _check(x_sorted, group_sizes, gate_up, down):
    if x_sorted.ndim != 2:
        raise ValueError(f"x_sorted must be [M, H], got shape {tuple(x_sorted.shape)}")
    if gate_up.ndim != 3 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [E, 2I, H] (rows: gate then up), got shape {tuple(gate_up.shape)}")
    E, I2, H = gate_up.shape
    if H != x_sorted.shape[1]:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} has hidden size {H} but x_sorted has {x_sorted.shape[1]}")
    if tuple(down.shape) != (E, H, I2 // 2):
        raise ValueError(f"down must be [E, H, I] = {(E, H, I2 // 2)}, got {tuple(down.shape)}")
    if tuple(group_sizes.shape) != (E,):
        raise ValueError(f"group_sizes must be [E] = [{E}], got shape {tuple(group_sizes.shape)}")
    return E, H, I2 // 2


def grouped_swiglu_reference(x_sorted, group_sizes, gate_up, down) -> jax.Array:
    """Each expert on every row, keep the rows it owns (masks from the cumulative group sizes); fp32 math,
    result in x's dtype. E times the useful FLOPs: a reference, not a fast path."""
    E, H, I = _check(x_sorted, group_sizes, gate_up, down)
    M = x_sorted.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    row_group = jnp.sum(jnp.arange(M)[:, None] >= ends[None, :], axis=1)          # [M]
    owner = jax.nn.one_hot(row_group, E, dtype=jnp.float32)                       # [M, E]; 0 for rows >= Σ
    x = x_sorted.astype(jnp.float32)
    g = jnp.einsum("mh,eih->mei", x, gate_up[:, :I].astype(jnp.float32))
    u = jnp.einsum("mh,eih->mei", x, gate_up[:, I:].astype(jnp.float32))
    a = jax.nn.silu(g) * u * owner[:, :, None]
    return jnp.einsum("mei,ehi->mh", a, down.astype(jnp.float32)).astype(x_sorted.dtype)


def group_metadata(group_sizes, M: int, tm: int):
    """The visit schedule. Returns (group_offsets [E+1], visit_group [V], visit_tile [V], num_visits [1]) with the
    static bound V = ceil(M/tm) + E - 1: the (row tile, expert) pairs whose rows intersect, by expert then tile."""
    E = group_sizes.shape[0]
    gs = group_sizes.astype(jnp.int32)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(gs)])
    first_tile = offsets[:-1] // tm
    last_tile = (offsets[1:] - 1) // tm
    n_vis = jnp.where(gs > 0, last_tile - first_tile + 1, 0)                      # visits of each expert
    vis_end = jnp.cumsum(n_vis)
    num_visits = vis_end[-1]
    V = -(-M // tm) + E - 1
    # The tail repeats the last visit; with no rows at all (a device whose tokens all go to other devices' experts)
    # every visit is the skipped visit 0 of tile 0, so no block index goes below zero.
    v = jnp.minimum(jnp.arange(V, dtype=jnp.int32), jnp.maximum(num_visits - 1, 0))
    group = jnp.sum(v[:, None] >= vis_end[None, :], axis=1).astype(jnp.int32)
    group = jnp.minimum(group, E - 1)
    tile = first_tile[group] + v - (vis_end[group] - n_vis[group])
    return offsets, group, tile.astype(jnp.int32), num_visits.reshape(1).astype(jnp.int32)


def _row_mask(offsets_ref, group, tile, tm):
    rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    return (rows >= offsets_ref[group]) & (rows < offsets_ref[group + 1])


def _weight_tile(w_ref, x):
    """A weight tile as the matmul takes it: as stored, or FP8 converted to x's dtype in VMEM (exact)."""
    w = w_ref[...]
    return w.astype(x.dtype) if w.dtype != x.dtype else w


def _gmm_swiglu_kernel(offsets_ref, group_ref, tile_ref, nvis_ref, x_ref, g_ref, u_ref, *rest):
    """rest = (o_ref, acc_g, acc_u), or with FP8 weights (sg_ref, su_ref, o_ref, acc_g, acc_u): the [1, ti] scales
    of this step's 128-wide block, which multiply its partial products; with FP8 activations too (sg_ref, su_ref,
    xs_ref, o_ref, acc_g, acc_u): xs_ref [tm, 1], each row's scale for this block (W8A8: FP8 x FP8 on the MXU)."""
    xs_ref = None
    if len(rest) == 6:
        sg_ref, su_ref, xs_ref, o_ref, acc_g, acc_u = rest
    else:
        sg_ref, su_ref, o_ref, acc_g, acc_u = rest if len(rest) == 5 else (None, None, *rest)
    v, k = pl.program_id(1), pl.program_id(2)
    tm = x_ref.shape[0]

    @pl.when(v < nvis_ref[0])
    def _visit():
        @pl.when(k == 0)
        def _init():
            acc_g[...] = jnp.zeros(acc_g.shape, jnp.float32)
            acc_u[...] = jnp.zeros(acc_u.shape, jnp.float32)

        x = x_ref[...]
        nt = (((1,), (1,)), ((), ()))                                              # x [tm, tk] · w [ti, tk]ᵀ
        pg = jax.lax.dot_general(x, _weight_tile(g_ref, x), nt, preferred_element_type=jnp.float32)
        pu = jax.lax.dot_general(x, _weight_tile(u_ref, x), nt, preferred_element_type=jnp.float32)
        if sg_ref is not None:
            pg, pu = pg * sg_ref[...], pu * su_ref[...]
        if xs_ref is not None:
            pg, pu = pg * xs_ref[...], pu * xs_ref[...]
        acc_g[...] += pg
        acc_u[...] += pu

        @pl.when(k == pl.num_programs(2) - 1)
        def _write():
            a = (jax.nn.silu(acc_g[...]) * acc_u[...]).astype(o_ref.dtype)
            mask = _row_mask(offsets_ref, group_ref[v], tile_ref[v], tm)
            o_ref[...] = jnp.where(mask, a, o_ref[...])


def _gmm_kernel(offsets_ref, group_ref, tile_ref, nvis_ref, x_ref, w_ref, *rest):
    """rest = (o_ref, acc), or with FP8 weights (s_ref, o_ref, acc), or with FP8 activations too (s_ref, xs_ref,
    o_ref, acc)."""
    xs_ref = None
    if len(rest) == 4:
        s_ref, xs_ref, o_ref, acc = rest
    else:
        s_ref, o_ref, acc = rest if len(rest) == 3 else (None, *rest)
    v, k = pl.program_id(1), pl.program_id(2)
    tm = x_ref.shape[0]

    @pl.when(v < nvis_ref[0])
    def _visit():
        @pl.when(k == 0)
        def _init():
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

        x = x_ref[...]
        p = jax.lax.dot_general(x, _weight_tile(w_ref, x), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        if xs_ref is not None:
            p = p * xs_ref[...]
        acc[...] += p * s_ref[...] if s_ref is not None else p

        @pl.when(k == pl.num_programs(2) - 1)
        def _write():
            mask = _row_mask(offsets_ref, group_ref[v], tile_ref[v], tm)
            o_ref[...] = jnp.where(mask, acc[...].astype(o_ref.dtype), o_ref[...])


def expand_fp8_scales(scale_inv, rows: int) -> jax.Array:
    """Block scales [E, ceil(N/128), ceil(K/128)] of an FP8 weight [E, N, K] -> [E, ceil(K/128), 1, N] float32: for
    each 128-wide block of the contracted K, the scale of every output row (its block's, repeated). The FP8
    kernels read the (1, t) row of the current K block."""
    s = jnp.repeat(scale_inv.astype(jnp.float32), FP8_BLOCK, axis=1)[:, :rows, :]  # [E, N, Kb]
    return jnp.swapaxes(s, 1, 2)[:, :, None, :]


def expand_act_scales(scale, block: int = ACT_BLOCK) -> jax.Array:
    """Activation scales [M, K/block] -> [K/128, M, 1]: for each 128-wide step of the contraction, every row's scale
    (its block's, repeated block/128 times), read by the kernels as a (tm, 1) column."""
    s = jnp.repeat(scale.astype(jnp.float32), block // FP8_BLOCK, axis=1)  # [M, K/128]
    return jnp.swapaxes(s, 0, 1)[:, :, None]


def grouped_swiglu_w8a8_reference(x_sorted, group_sizes, gate_up, down, gate_up_scale, down_scale,
                                  block: int = ACT_BLOCK) -> jax.Array:
    """W8A8 written plainly: each row's expert found from group_sizes, the FP8 weights dequantised, x quantised and
    dequantised per 512-block (`quantize_fp8_activations`), the SwiGLU output likewise, all products in float32."""
    M = x_sorted.shape[0]
    E = gate_up.shape[0]
    eid = jnp.repeat(jnp.arange(E), group_sizes, total_repeat_length=M)  # each row's expert
    gu = fp8_dequantize(gate_up, gate_up_scale, jnp.float32)[eid]  # [M, 2I, H]
    dn = fp8_dequantize(down, down_scale, jnp.float32)[eid]  # [M, H, I]
    x = fp8_round_activations(x_sorted.astype(jnp.float32), block)
    hp = jax.lax.Precision.HIGHEST
    g, u = jnp.split(jnp.einsum("mh,mih->mi", x, gu, precision=hp), 2, axis=-1)
    a = fp8_round_activations(jax.nn.silu(g) * u, block)
    return jnp.einsum("mi,mhi->mh", a, dn, precision=hp).astype(x_sorted.dtype)


def _tiles(name, size, t):
    """The tile for a dimension: t if it divides size, else the largest multiple of 128 below t that does, else
    the whole dimension (always legal on TPU: a block equal to the array's dimension)."""
    if t is None or t >= size:
        return size
    if t < 1:
        raise ValueError(f"{name} tile must be positive, got {t}")
    for c in range(t, 0, -1):
        if size % c == 0 and (c % 128 == 0 or c == t):
            return c
    return size


def _params(interpret):
    return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
                interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tm", "ti", "tk", "interpret", "out_dtype"))
def gmm_swiglu(x_padded, meta, gate_up, scales=None, x_scales=None, *, tm, ti, tk, interpret, out_dtype=None):
    """x_padded [Mp, H] (Mp a multiple of tm) -> silu(x G_eᵀ) ⊙ (x U_eᵀ) [Mp, I] per row's expert. With `scales`
    (`expand_fp8_scales` of gate_up's, [E, H/128, 1, 2I]) gate_up is FP8 and tk must be 128; with `x_scales`
    (`expand_act_scales`, [H/128, Mp, 1]) x is FP8 too. out_dtype: default x's."""
    Mp, H = x_padded.shape
    E, I2, _ = gate_up.shape
    I = I2 // 2
    V = meta[1].shape[0]
    nI = I // ti
    in_specs = [
        pl.BlockSpec((tm, tk), lambda n, v, k, off, grp, til, nv: (til[v], k)),
        pl.BlockSpec((None, ti, tk), lambda n, v, k, off, grp, til, nv: (grp[v], n, k)),       # gate
        pl.BlockSpec((None, ti, tk), lambda n, v, k, off, grp, til, nv: (grp[v], n + nI, k)),  # up
    ]
    args = [x_padded, gate_up, gate_up]
    if scales is not None:  # FP8: this step's (1, ti) scales of the gate and the up rows
        assert tk == FP8_BLOCK, tk
        in_specs += [pl.BlockSpec((None, None, 1, ti), lambda n, v, k, off, grp, til, nv: (grp[v], k, 0, n)),
                     pl.BlockSpec((None, None, 1, ti), lambda n, v, k, off, grp, til, nv: (grp[v], k, 0, n + nI))]
        args += [scales, scales]
    if x_scales is not None:
        in_specs.append(pl.BlockSpec((None, tm, 1), lambda n, v, k, off, grp, til, nv: (k, til[v], 0)))
        args.append(x_scales)
    return pl.pallas_call(
        _gmm_swiglu_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(nI, V, H // tk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, ti), lambda n, v, k, off, grp, til, nv: (til[v], n)),
            scratch_shapes=[pltpu.VMEM((tm, ti), jnp.float32), pltpu.VMEM((tm, ti), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((Mp, I), out_dtype or x_padded.dtype),
        **_params(interpret),
    )(*meta, *args)


@functools.partial(jax.jit, static_argnames=("tm", "tn", "tk", "interpret", "out_dtype"))
def gmm(a_padded, meta, w, scales=None, x_scales=None, *, tm, tn, tk, interpret, out_dtype=None):
    """a_padded [Mp, K] x w [E, N, K] (each row by its expert's w_e, contracting K) -> [Mp, N]. With `scales`
    (`expand_fp8_scales` of w's, [E, K/128, 1, N]) w is FP8 and tk must be 128; with `x_scales`
    (`expand_act_scales`, [K/128, Mp, 1]) a is FP8 too. out_dtype: default a's."""
    Mp, K = a_padded.shape
    E, N, _ = w.shape
    V = meta[1].shape[0]
    in_specs = [
        pl.BlockSpec((tm, tk), lambda n, v, k, off, grp, til, nv: (til[v], k)),
        pl.BlockSpec((None, tn, tk), lambda n, v, k, off, grp, til, nv: (grp[v], n, k)),
    ]
    args = [a_padded, w]
    if scales is not None:
        assert tk == FP8_BLOCK, tk
        in_specs.append(pl.BlockSpec((None, None, 1, tn), lambda n, v, k, off, grp, til, nv: (grp[v], k, 0, n)))
        args.append(scales)
    if x_scales is not None:
        in_specs.append(pl.BlockSpec((None, tm, 1), lambda n, v, k, off, grp, til, nv: (k, til[v], 0)))
        args.append(x_scales)
    return pl.pallas_call(
        _gmm_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(N // tn, V, K // tk),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((tm, tn), lambda n, v, k, off, grp, til, nv: (til[v], n)),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((Mp, N), out_dtype or a_padded.dtype),
        **_params(interpret),
    )(*meta, *args)


def grouped_swiglu(x_sorted, group_sizes, gate_up, down, *, tm: int = 128, ti: int | None = 512,
                   th: int | None = 512, gate_up_scale=None, down_scale=None, w8a8: bool = False,
                   interpret=None) -> jax.Array:
    """Pallas grouped SwiGLU: same arguments and result as `grouped_swiglu_reference` (and
    `qwen35.moe.grouped_swiglu`). x_sorted [M, H], group_sizes [E], gate_up [E, 2I, H], down [E, H, I] -> [M, H].

    tm: rows per tile (a multiple of 8; capped at M rounded up to 8); ti: tile of the expert width I; th: tile of
    the hidden size H (None = the whole dimension; a tile that does not divide its dimension is lowered to one
    that does). Weights are cast to x's dtype.

    FP8 experts: gate_up and down float8_e4m3fn with their 128x128 block scales `gate_up_scale` [E, 2I/128,
    H/128] and `down_scale` [E, H/128, I/128] (both or neither); the result is that of the dequantised weights.
    H and I must be multiples of 128; the contraction runs in 128-wide steps (th then tiles only the output).

    W8A8 (`w8a8=True`, FP8 experts only): the activations are quantised too, x before the gate/up projection and
    the SwiGLU output before the down projection, each per row and 512-wide block of its columns
    (`quantize_fp8_activations`, e4m3 with fp32 scales; H and I multiples of 512), so both operands of every
    matmul are FP8 and the MXU runs at its FP8 rate. Each 128-wide step's partial product is scaled by its row's
    activation scale and its column's weight scale. The result is `grouped_swiglu_w8a8_reference`'s.

    Rows past sum(group_sizes) (slots that no group counts) are zero, and no matmul runs on them.
    """
    x_sorted, group_sizes, gate_up, down = (jnp.asarray(t) for t in (x_sorted, group_sizes, gate_up, down))
    E, H, I = _check(x_sorted, group_sizes, gate_up, down)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got dtype {group_sizes.dtype}")
    if tm < 8 or tm % 8:
        raise ValueError(f"tm must be a positive multiple of 8 (TPU sublanes), got {tm}")
    M = x_sorted.shape[0]
    if M == 0:
        return jnp.zeros_like(x_sorted)
    fp8 = gate_up_scale is not None
    if fp8 != (down_scale is not None):
        raise ValueError("pass both gate_up_scale and down_scale (FP8 experts) or neither")
    if w8a8 and not fp8:
        raise ValueError("w8a8=True (FP8 activations) needs FP8 experts: pass gate_up_scale and down_scale")
    if w8a8 and (H % ACT_BLOCK or I % ACT_BLOCK):
        raise ValueError(f"W8A8 quantises activations in {ACT_BLOCK}-wide blocks: H and I must be multiples of "
                         f"{ACT_BLOCK}, got H={H}, I={I}")
    if fp8:
        if H % FP8_BLOCK or I % FP8_BLOCK:
            raise ValueError(f"the FP8 kernels need H and I to be multiples of {FP8_BLOCK}, got H={H}, I={I}; "
                             f"dequantise the experts instead (qwen35.moe.Experts.dequantized)")
        b = FP8_BLOCK
        for name, sc, want in (("gate_up_scale", gate_up_scale, (E, 2 * I // b, H // b)),
                               ("down_scale", down_scale, (E, H // b, I // b))):
            if tuple(sc.shape) != want:
                raise ValueError(f"{name} must be [E, rows/128, cols/128] = {want}, got {tuple(sc.shape)}")
    tm = min(tm, -(-M // 8) * 8)
    ti, th = _tiles("ti", I, ti), _tiles("th", H, th)
    interpret = default_interpret(interpret)
    dtype = x_sorted.dtype
    Mp = -(-M // tm) * tm
    meta = group_metadata(group_sizes, M, tm)
    x_p = jnp.pad(x_sorted, ((0, Mp - M), (0, 0)))
    if w8a8:  # W8A8: FP8 x FP8 products, each 128-wide step scaled by row (activation) and column (weight)
        xq, xs = quantize_fp8_activations(x_p)
        a = gmm_swiglu(xq, meta, gate_up, expand_fp8_scales(gate_up_scale, 2 * I), expand_act_scales(xs), tm=tm,
                       ti=ti, tk=FP8_BLOCK, interpret=interpret, out_dtype=jnp.float32)
        aq, as_ = quantize_fp8_activations(a)
        y = gmm(aq, meta, down, expand_fp8_scales(down_scale, H), expand_act_scales(as_), tm=tm, tn=th,
                tk=FP8_BLOCK, interpret=interpret, out_dtype=dtype)
        return _only_grouped_rows(y[:M], group_sizes)
    if fp8:  # FP8 tiles straight from HBM, converted in VMEM; contraction in 128-wide scale blocks
        a = gmm_swiglu(x_p, meta, gate_up, expand_fp8_scales(gate_up_scale, 2 * I), tm=tm, ti=ti, tk=FP8_BLOCK,
                       interpret=interpret)
        y = gmm(a, meta, down, expand_fp8_scales(down_scale, H), tm=tm, tn=th, tk=FP8_BLOCK, interpret=interpret)
        return _only_grouped_rows(y[:M], group_sizes)
    a = gmm_swiglu(x_p, meta, gate_up.astype(dtype), tm=tm, ti=ti, tk=th, interpret=interpret)
    y = gmm(a, meta, down.astype(dtype), tm=tm, tn=th, tk=ti, interpret=interpret)
    return _only_grouped_rows(y[:M], group_sizes)


def _only_grouped_rows(y, group_sizes):
    """y with the rows past sum(group_sizes) zeroed: no group counts them, so no tile writes them (the kernels'
    output there is whatever the buffer held). Slots sorted past every group (an expert id E, e.g. another device's
    expert in the expert-parallel exchange) then come back as zeros."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(group_sizes))[:, None], y, jnp.zeros((), y.dtype))


def gmm_cost(M: int, H: int, I: int, E_used: int, dtype_bytes: int = 2) -> dict:
    """Napkin math: FLOPs 2·M·3IH; bytes = the used experts' weights (3IH each) + x, the [M, I] activation
    written and read back, and y."""
    flops = 2 * M * 3 * I * H
    w_bytes = E_used * 3 * I * H * dtype_bytes
    act_bytes = (2 * M * H + 2 * M * I) * dtype_bytes
    return {"flops": flops, "bytes": w_bytes + act_bytes, "weight_bytes": w_bytes}


def experts_sorted_pallas(x, weights, experts, gate_up, down, *, tm: int = 128, ti: int | None = 512,
                          th: int | None = 512, block_rows: int = 8, gate_up_scale=None, down_scale=None,
                          w8a8: bool = False, interpret=None) -> jax.Array:
    """`qwen35.moe.experts_sorted` on the kernels: sort the N·k slots by expert, permute (row-gather kernel),
    grouped SwiGLU (the two gmm kernels; FP8 experts with their block scales and W8A8 with `w8a8`, see
    `grouped_swiglu`), weighted
    unpermute (gather-combine kernel). x [N, H], weights [N, k], experts [N, k] -> [N, H] in x's dtype. The
    model's MoE uses it when `Execution(kernels="pallas")`."""
    x, weights, experts = jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts)
    check_routed(x, weights, experts, gate_up, down)
    N, k = experts.shape
    order, group_sizes = sort_by_expert(experts, gate_up.shape[0])
    x_sorted = permute(x, order, k, block_rows=block_rows, interpret=interpret)
    y_sorted = grouped_swiglu(x_sorted, group_sizes, gate_up, down, tm=tm, ti=ti, th=th, gate_up_scale=gate_up_scale,
                              down_scale=down_scale, w8a8=w8a8, interpret=interpret)
    return unpermute(y_sorted, order, weights.astype(x.dtype), block_rows=block_rows, interpret=interpret)
