"""The expert-parallel exchange: packed routing metadata, hierarchical collectives, the tensor-parallel
regrouping of gate_up, the dropless ragged all-to-all, `moe_ep` (its own `shard_map`) and `moe_ep_local` (inside a
caller's), and expert placement by load."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from qwen35.kernels.fp8 import ACT_BLOCK
from qwen35.kernels import grouped_matmul as gmm_kernels  # called through the module: tests spy on its functions
from qwen35.kernels.permute import rank_in_expert, sort_by_expert
from qwen35.execution import Execution
from qwen35.moe import capacity as moe_capacity
from qwen35.moe import experts_dense, experts_sorted, grouped_swiglu
from qwen35.sharding.mesh import LOGICAL_RULES, ShardingError, _axes_desc, _axes_size, mesh_axes_for


# Backends whose XLA implements the ragged-all-to-all HLO (XLA:CPU does not: "not supported by XLA:CPU").
NATIVE_RAGGED_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")


def native_ragged(mesh: Mesh) -> bool:
    """Whether `mesh`'s devices run `lax.ragged_all_to_all` natively (else the padded transport stands in)."""
    return mesh.devices.flat[0].platform in NATIVE_RAGGED_PLATFORMS


# ------------------------------------------------------------------------------------------------------------
# Packed routing metadata: expert ids and weights in one int32 array, so one all-gather moves both
def pack_routing(experts: jax.Array, weights: jax.Array) -> jax.Array:
    """experts [N, k] int32, weights [N, k] float32 -> [N, 2k] int32: ids, then the weights' bits
    (`lax.bitcast_convert_type`, no rounding)."""
    experts, weights = jnp.asarray(experts), jnp.asarray(weights)
    if experts.ndim != 2 or experts.shape != weights.shape:
        raise ValueError(f"experts and weights must both be [N, k], got {experts.shape} and {weights.shape}")
    if weights.dtype != jnp.float32:
        raise ValueError(f"weights must be float32 (bit-cast into int32), got {weights.dtype}")
    bits = jax.lax.bitcast_convert_type(weights, jnp.int32)
    return jnp.concatenate([experts.astype(jnp.int32), bits], axis=-1)


def unpack_routing(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[N, 2k] int32 -> (experts [N, k] int32, weights [N, k] float32), bit-exact inverse of `pack_routing`."""
    packed = jnp.asarray(packed)
    if packed.ndim != 2 or packed.shape[1] % 2 or packed.dtype != jnp.int32:
        raise ValueError(f"packed routing must be int32 [N, 2k], got {packed.dtype} {packed.shape}")
    k = packed.shape[1] // 2
    return packed[:, :k], jax.lax.bitcast_convert_type(packed[:, k:], jnp.float32)


# ------------------------------------------------------------------------------------------------------------
# Hierarchical reduce-scatter
def hierarchical_psum_scatter(x: jax.Array, inner_axis: str, outer_axis: str, *, scatter_dimension: int = 0):
    """Reduce-scatter over two mesh axes in two steps: inside the inner group first (the cores of one chip, fast
    links), then across the outer one (chips) with 1/a of the data. Call inside `shard_map`.

    Equal to the flat `lax.psum_scatter(x, (outer_axis, inner_axis), scatter_dimension=..., tiled=True)`:
    the device at (outer o, inner i) gets block o·a + i of the sum (a = inner size; outer-major, the order of
    the flat version and of `all_gather(..., (outer_axis, inner_axis), tiled=True)`). A plain inner-then-outer
    pair of psum_scatters would give it block i·b + o; the blocks are permuted first so the orders agree.

    Bytes each device sends (ring model, x of X bytes, b = outer size): (a-1)/a·X on-chip + (b-1)/(a·b)·X across
    chips, against (ab-1)/(ab)·X for the flat version, most of which would cross chips."""
    a, b = jax.lax.axis_size(inner_axis), jax.lax.axis_size(outer_axis)
    x = jnp.moveaxis(x, scatter_dimension, 0)
    M = x.shape[0]
    if M % (a * b):
        raise ValueError(f"dimension {scatter_dimension} of size {M} must be a multiple of {outer_axis}×{inner_axis}"
                         f" = {a * b} to be scattered")
    rest = x.shape[1:]
    x = x.reshape(b, a, M // (a * b), *rest).swapaxes(0, 1).reshape(M, *rest)  # block o·a+i -> position i·b+o
    y = jax.lax.psum_scatter(x, inner_axis, scatter_dimension=0, tiled=True)  # [M/a]: blocks (o, i) for all o
    y = jax.lax.psum_scatter(y, outer_axis, scatter_dimension=0, tiled=True)  # [M/(ab)]: block (o, i)
    return jnp.moveaxis(y, 0, scatter_dimension)


# ------------------------------------------------------------------------------------------------------------
# Hierarchical all-gather (the mirror image of the reduce-scatter)
def hierarchical_all_gather(x: jax.Array, inner_axis: str, outer_axis: str, *, axis: int = 0):
    """All-gather over two mesh axes in two steps: across the outer group (chips) first, while the data is still
    small, then inside the inner group (the cores of a chip, fast links). Call inside `shard_map`.

    Equal to the flat `lax.all_gather(x, (outer_axis, inner_axis), axis=axis, tiled=True)` (block o·a + i comes
    from the device at (outer o, inner i)); the gathered blocks are reordered at the end so the orders agree.

    Bytes each device sends (ring model, x of X bytes, a = inner size, b = outer size): (b-1)·X across chips +
    (a-1)·b·X on-chip, against (ab-1)·X for the flat version, most of which would cross chips."""
    a, b = jax.lax.axis_size(inner_axis), jax.lax.axis_size(outer_axis)
    x = jnp.moveaxis(x, axis, 0)
    t, rest = x.shape[0], x.shape[1:]
    y = jax.lax.all_gather(x, outer_axis, axis=0, tiled=True)  # [b·t]: blocks (o', i) for all o'
    y = jax.lax.all_gather(y, inner_axis, axis=0, tiled=True)  # [a·b·t]: position i'·b + o' holds block (o', i')
    y = y.reshape(a, b, t, *rest).swapaxes(0, 1).reshape(a * b * t, *rest)  # -> position o'·a + i'
    return jnp.moveaxis(y, 0, axis)


# ------------------------------------------------------------------------------------------------------------
# Tensor-parallel experts: gate_up rows regrouped so a contiguous split gives each device [gate_j; up_j]
def tp_interleave_gate_up(gate_up: jax.Array, m: int) -> jax.Array:
    """[E, 2I, H] in the checkpoint's layout (all gate rows, then all up rows) -> the same rows regrouped as
    [gate_0; up_0; gate_1; up_1; ...], each piece I/m rows. Split contiguously over m devices, device j then
    holds [gate_j; up_j]: the column split of both projections, and `experts_*`'s split of the 2I rows into
    halves gives (gate_j, up_j) locally. Inverse: `tp_deinterleave_gate_up`."""
    E, I2, H = gate_up.shape
    if I2 % (2 * m):
        raise ShardingError(f"expert width I = {I2 // 2} cannot be split over a tensor-parallel group of {m}; "
                            f"use a group size that divides {I2 // 2}")
    return gate_up.reshape(E, 2, m, I2 // (2 * m), H).swapaxes(1, 2).reshape(E, I2, H)


def tp_deinterleave_gate_up(gate_up: jax.Array, m: int) -> jax.Array:
    """Inverse of `tp_interleave_gate_up`."""
    E, I2, H = gate_up.shape
    return gate_up.reshape(E, m, 2, I2 // (2 * m), H).swapaxes(1, 2).reshape(E, I2, H)


# ------------------------------------------------------------------------------------------------------------
# Expert-parallel (and tensor-parallel) MoE
class EPStats(NamedTuple):
    """dropped: slots past capacity over all devices (int32; 0 for "allgather" and "ragged"); drop_rate:
    dropped / (N·k); capacity: C, rows per (source device, expert) buffer (None for "allgather" and "ragged")."""

    dropped: jax.Array
    drop_rate: jax.Array
    capacity: int | None


def _local_experts(x, weights, experts, gate_up, down, impl, act_block=None, scales=None, w8a8=False):
    El, k = gate_up.shape[0], experts.shape[1]
    if k > El:  # fewer local experts than slots (e.g. 8 experts on 8 devices, top-2): one column per local expert
        # (top-k ids are distinct, so each column holds at most one slot's weight: the sum is exact)
        weights = jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, El, dtype=weights.dtype))
        experts = jnp.broadcast_to(jnp.arange(El, dtype=jnp.int32), weights.shape)
    if impl == "dense":
        return experts_dense(x, weights, experts, gate_up, down, act_block=act_block)
    if impl == "pallas":  # the grouped matmul + SwiGLU kernels (`kernels="pallas"`); with `scales`, FP8 weights
        # read as FP8 tiles with their 128x128 block scales, and with `w8a8` FP8 x FP8 products (W8A8)
        gs, ds = scales if scales is not None else (None, None)
        return gmm_kernels.experts_sorted_pallas(x, weights, experts, gate_up, down, gate_up_scale=gs,
                                                 down_scale=ds, w8a8=w8a8)
    return experts_sorted(x, weights, experts, gate_up, down, act_block=act_block)


def _allgather_body(x, packed, gate_up, down, *, ex_axes, tp_axes, impl, hierarchical, chunks, act_block=None,
                    scales=None, w8a8=False):
    """Per device: x [t, H], packed [t, 2k]; gate_up/down hold this device's E/n experts (and, with tensor-
    parallel experts, its I/m slice of each: gate_up [E/n, 2I/m, H] as [gate_j; up_j], down [E/n, H, I/m]).

    With `chunks` K > 1 the t tokens go through in K independent pieces (gather, experts, scatter per piece): no
    piece waits on another's compute, so a scheduler with asynchronous collectives (TPU, GPU) overlaps piece
    j+1's all-gather and piece j-1's reduce-scatter with piece j's expert matmuls."""
    El = gate_up.shape[0]
    lo = jax.lax.axis_index(ex_axes) * El if ex_axes else 0
    gather = (functools.partial(hierarchical_all_gather, inner_axis=ex_axes[1], outer_axis=ex_axes[0])
              if hierarchical else functools.partial(jax.lax.all_gather, axis_name=ex_axes, axis=0, tiled=True))
    scatter = (functools.partial(hierarchical_psum_scatter, inner_axis=ex_axes[1], outer_axis=ex_axes[0])
               if hierarchical else functools.partial(jax.lax.psum_scatter, axis_name=ex_axes, scatter_dimension=0,
                                                      tiled=True))
    outs = []
    for x_c, p_c in zip(jnp.split(x, chunks), jnp.split(packed, chunks)):
        if ex_axes:
            x_c, p_c = gather(x_c), gather(p_c)  # [N_g, H], [N_g, 2k]: one all-gather moves ids and weights
        e, w = unpack_routing(p_c)
        local = (e >= lo) & (e < lo + El)
        # Slots routed to another device's experts: weight 0, so they add nothing here, and for the sorted paths the
        # id El, one past the local experts: they sort after every local group and no group counts them, so no
        # matmul runs on them. (Given local expert 0 instead, the (n - 1)/n of the slots that are not local would
        # all run through it: on the 397B layout, EP = 8, 7x the useful expert FLOPs.) The dense path reads every
        # local expert anyway: id 0.
        off = El if impl in ("sorted", "pallas") else 0
        y = _local_experts(x_c, jnp.where(local, w, 0.0).astype(x.dtype), jnp.where(local, e - lo, off), gate_up,
                           down, impl, act_block, scales, w8a8)
        if ex_axes:
            y = scatter(y)
        if tp_axes:  # each device of a TP group summed over its I/m channels: add the partial sums
            y = jax.lax.psum(y, tp_axes)
        outs.append(y)
    return jnp.concatenate(outs) if chunks > 1 else outs[0], jnp.zeros((), jnp.int32)


def _alltoall_body(x, weights, experts, gate_up, down, *, ex_axes, tp_axes, all_axes, C, chunks):
    t, H = x.shape
    k = experts.shape[1]
    El = gate_up.shape[0]
    n = jax.lax.axis_size(ex_axes)
    E = n * El
    dtype = x.dtype
    rank = rank_in_expert(experts, E)
    keep = rank < C
    row = jnp.where(keep, rank, C)  # out of bounds: dropped on the way in, 0 on the way out
    token = jnp.broadcast_to(jnp.arange(t)[:, None], (t, k))
    buf = jnp.zeros((E, C, H), dtype).at[experts, row].set(x[token], mode="drop")  # expert e = d·El + l
    buf = buf.reshape(n, El, C, H)
    backs = []
    # K chunks over the local experts: piece j carries experts [j·El/K, (j+1)·El/K) of every device, independent
    # of the other pieces, so its all-to-alls can overlap their expert matmuls.
    for j, (b_c, gu_c, dn_c) in enumerate(zip(jnp.split(buf, chunks, axis=1), jnp.split(gate_up, chunks),
                                               jnp.split(down, chunks))):
        recv = jax.lax.all_to_all(b_c, ex_axes, 0, 0, tiled=True)  # [n source, El/K, C, H]
        h = jnp.einsum("slch,lih->slci", recv, gu_c.astype(dtype))
        g, u = jnp.split(h, 2, axis=-1)
        out = jnp.einsum("slci,lhi->slch", jax.nn.silu(g) * u, dn_c.astype(dtype))
        backs.append(jax.lax.all_to_all(out, ex_axes, 0, 0, tiled=True))  # [n target, El/K, C, H]
    back = (jnp.concatenate(backs, axis=1) if chunks > 1 else backs[0]).reshape(E, C, H)
    y_slots = back.at[experts, row].get(mode="fill", fill_value=0)  # [t, k, H]
    y = jnp.einsum("nk,nkh->nh", (weights * keep).astype(dtype), y_slots)
    if tp_axes:
        y = jax.lax.psum(y, tp_axes)
    dropped = jax.lax.psum(jnp.sum(~keep, dtype=jnp.int32), all_axes)
    if tp_axes:  # every device of a TP group saw the same tokens: count them once
        dropped = dropped // _axes_size_traced(tp_axes)
    return y.astype(dtype), dropped


# ------------------------------------------------------------------------------------------------------------
# The dropless exchange: a ragged all-to-all of exactly the routed slots
def ragged_all_to_all_padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                             axis_name, max_slice: int):
    """`lax.ragged_all_to_all`'s result (same arguments, same semantics: see its docstring) from a dense
    `lax.all_to_all` of slices padded to `max_slice` rows, for backends whose XLA has no ragged-all-to-all (CPU).
    Call inside `shard_map`. Every slice must hold at most `max_slice` rows.

    Each of the N slices (N/n per destination device) is cut from `operand` at its offset as `max_slice` rows,
    the [N, max_slice, ...] block goes through one tiled all-to-all, the receiver learns where its slices go from
    an all-to-all of `output_offsets`, and writes the first recv_sizes[i] rows of slice i there. It moves
    N·max_slice rows per device whatever the sizes; the native op moves only the slices' rows."""
    N = input_offsets.shape[0]
    rows = jnp.arange(max_slice, dtype=jnp.int32)
    padded = jnp.concatenate([operand, jnp.zeros((max_slice, *operand.shape[1:]), operand.dtype)])
    pieces = padded[input_offsets[:, None] + rows[None, :]]  # [N, max_slice, ...]: slice i, to device i // (N/n)
    got = jax.lax.all_to_all(pieces, axis_name, 0, 0, tiled=True)  # slice i now from device i // (N/n)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each received slice goes here
    dest = jnp.where(rows[None, :] < recv_sizes[:, None], at[:, None] + rows[None, :], output.shape[0])
    return output.at[dest.reshape(-1)].set(got.reshape(N * max_slice, *got.shape[2:]), mode="drop")


def _ragged_body(x, weights, experts, gate_up, down, *scales, ex_axes, tp_axes, native, kernels, act_block=None,
                 w8a8=False):
    """Per device: x [t, H], weights/experts [t, k]; gate_up/down hold this device's E/n experts (and, with
    tensor-parallel experts, its I/m slice of each).

    1. Sort the t·k slots by expert (`sort_by_expert`): the rows for device d's experts are then contiguous, one
       slice per expert. All-gather the [E] slot counts (n·E int32): every device then knows every slice's size
       and where it lands: on device d, expert l's rows from all sources, source after source, then expert l+1's.
    2. Ragged all-to-all forward: E slices (E/n per device) of exactly the routed rows. The receiver's buffer is
       grouped by local expert, so the grouped SwiGLU runs on it as it is (rows past the groups stay zero).
    3. Ragged all-to-all back (the offsets swapped), then each slot's output times its routing weight is added to
       its token. No capacity, nothing dropped: equal to the single-device MoE.
    The receive buffer is static: n·t·min(k, E/n) rows, the most a device can get (each token sends at most
    min(k, E/n) slots to one device). `kernels`: the grouped matmul + SwiGLU kernels, which read FP8 experts as
    stored when their block `scales` (gate_up's, down's) are given, and with `w8a8` multiply FP8 activations by
    them; else `qwen35.moe.grouped_swiglu`. `native`: `lax.ragged_all_to_all`, else its padded stand-in."""
    t, H = x.shape
    k = experts.shape[1]
    El = gate_up.shape[0]
    n = _axes_size_traced(ex_axes)
    E = n * El
    me = jax.lax.axis_index(ex_axes)
    order, counts = sort_by_expert(experts, E)  # order [t·k] flat slot ids, counts [E] int32
    token = order // k
    x_sorted = x[token]  # [t·k, H], grouped by expert, so by destination device
    every = jax.lax.all_gather(counts, ex_axes, axis=0, tiled=False).reshape(n, E)  # [source, expert]
    in_off = jnp.cumsum(counts) - counts  # [E] where expert e's rows start here
    per_dev = every.sum(0).reshape(n, El)  # rows each expert gets from everyone, by device
    group_start = (jnp.cumsum(per_dev, axis=1) - per_dev).reshape(E)  # its group's start on its device
    earlier = (jnp.cumsum(every, axis=0) - every)[me]  # [E] rows that sources before this one send it
    out_off = group_start + earlier  # where this device's slice for expert e lands on e's device
    recv = jax.lax.dynamic_slice_in_dim(every, me * El, El, axis=1).reshape(n * El)  # slice (source s, expert l)
    group_sizes = jax.lax.dynamic_index_in_dim(per_dev, me, keepdims=False)  # [El]
    R = n * t * min(k, El)
    if native:
        move = functools.partial(jax.lax.ragged_all_to_all, axis_name=ex_axes)
    else:  # one slice holds at most t rows: a token routes at most one slot to each expert
        move = functools.partial(ragged_all_to_all_padded, axis_name=ex_axes, max_slice=t)
    x_recv = move(x_sorted, jnp.zeros((R, H), x.dtype), in_off, counts, out_off, recv)
    if kernels:
        gs, ds = scales if scales else (None, None)
        y_recv = gmm_kernels.grouped_swiglu(x_recv, group_sizes, gate_up, down, gate_up_scale=gs, down_scale=ds,
                                            w8a8=w8a8)  # [R, H]
    else:
        y_recv = grouped_swiglu(x_recv, group_sizes, gate_up, down, act_block=act_block)
    # Back: this device's slices go to their sources; offsets here are where they landed (the all-to-all of the
    # sources' out_off), offsets there are where the sources took them from (the all-to-all of their in_off).
    here = jax.lax.all_to_all(out_off, ex_axes, 0, 0, tiled=True)
    there = jax.lax.all_to_all(in_off, ex_axes, 0, 0, tiled=True)
    y_sorted = move(y_recv, jnp.zeros((t * k, H), x.dtype), here, recv, there, counts)
    w_sorted = weights.reshape(-1)[order].astype(x.dtype)
    y = jnp.zeros((t, H), x.dtype).at[token].add(y_sorted * w_sorted[:, None])
    if tp_axes:
        y = jax.lax.psum(y, tp_axes)
    return y, jnp.zeros((), jnp.int32)


def _axes_size_traced(axes) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes)


@functools.lru_cache(maxsize=64)
def _ep_fn(mesh: Mesh, scheme: str, tok_axes, ex_axes, tp_axes, C, impl, hierarchical, chunks, interleave,
           native, act_block, fp8_tiles, w8a8):
    tok = P(tok_axes or None, None)
    tp = tp_axes or None
    gu_spec, dn_spec = P(ex_axes or None, tp, None), P(ex_axes or None, None, tp)
    all_axes = tuple(mesh.axis_names)
    m = _axes_size(mesh, tp_axes)

    def prep(gate_up):
        return tp_interleave_gate_up(gate_up, m) if interleave and m > 1 else gate_up

    if scheme == "allgather":
        # With `fp8_tiles`, the FP8 experts' block scales follow them as two more operands, split like the experts
        def body(x, packed, gate_up, down, *scales):
            return _allgather_body(x, packed, gate_up, down, ex_axes=ex_axes, tp_axes=tp_axes, impl=impl,
                                   hierarchical=hierarchical, chunks=chunks, act_block=act_block,
                                   scales=scales or None, w8a8=w8a8)
        f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, gu_spec, dn_spec) + (gu_spec, dn_spec) * fp8_tiles,
                          out_specs=(tok, P()), check_vma=False)

        def run(x, weights, experts, gate_up, down, *scales):
            return f(x, pack_routing(experts, weights.astype(jnp.float32)), prep(gate_up), down, *scales)
    elif scheme == "ragged":
        body = functools.partial(_ragged_body, ex_axes=ex_axes, tp_axes=tp_axes, native=native,
                                 kernels=impl == "pallas", act_block=act_block, w8a8=w8a8)
        f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, gu_spec, dn_spec) + (gu_spec, dn_spec) * fp8_tiles,
                          out_specs=(tok, P()), check_vma=False)

        def run(x, weights, experts, gate_up, down, *scales):
            return f(x, weights, experts, prep(gate_up), down, *scales)
    else:
        body = functools.partial(_alltoall_body, ex_axes=ex_axes, tp_axes=tp_axes, all_axes=all_axes, C=C,
                                 chunks=chunks)
        f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, gu_spec, dn_spec), out_specs=(tok, P()),
                          check_vma=False)

        def run(x, weights, experts, gate_up, down):
            return f(x, weights, experts, prep(gate_up), down)
    return jax.jit(run)


def moe_ep(x, weights, experts, gate_up, down, execution: Execution, *, gate_up_scale=None, down_scale=None,
           return_stats: bool = False):
    """Expert-parallel (and/or tensor-parallel) routed-expert sum: the same `(x [N, H], weights [N, k],
    experts [N, k], gate_up [E, 2I, H], down [E, H, I]) -> y [N, H]` as `qwen35.moe.experts_*`, as a `shard_map`
    over `execution.mesh` (its rules `execution.rules`, default `LOGICAL_RULES`).

    Experts split over the mesh axes of the "experts" rule (`expert`, or `chip`×`core`): EP, E/n whole experts
    per device. Each expert's width I split over the axes of the "expert_mlp" rule (empty by default; map it to
    "model" for TP-MoE, e.g. `rules_with(expert_mlp=("model",))`): gate/up column-split, down row-split, partial
    outputs summed by an all-reduce over the TP group. Both at once is the EP × TP hybrid. Tokens split over the
    "batch" axes (which must include the expert axes; devices of one TP group hold the same tokens).
    `execution.exchange`:
      "allgather"  all-gather tokens + packed routing over the expert axes, local experts, reduce-scatter back.
                   Exact (no capacity). The local experts: `execution.experts` "dense" (every local expert on every
                   gathered token), else the grouped path (the gathered slots of this device's experts only; the
                   others sort past its groups and no matmul runs on them), on the grouped matmul + SwiGLU kernels
                   with `kernels="pallas"`. With two expert axes the all-gather and the reduce-scatter are
                   hierarchical (inner axis first, then outer).
      "alltoall"   capacity buffers [n, E/n, C, H], C = ceil(capacity_factor·t·k/E) (`execution.capacity`, default
                   1.25, capped at t), all_to_all, local experts, all_to_all back. Equal to "allgather" when nothing
                   is dropped (capacity_factor >= E/k guarantees it); otherwise each device drops its own slots past
                   C per expert, in token order, like `experts_capacity` on its shard.
      "ragged"     dropless all-to-all: slots sorted by expert, their counts all-gathered, exactly the routed rows
                   sent in a ragged all-to-all (one slice per expert), grouped SwiGLU on the receiver, a ragged
                   all-to-all back. Equal to the single-device MoE at any load. The transport is
                   `lax.ragged_all_to_all` on TPU and GPU, and on XLA:CPU, which has no ragged all-to-all,
                   `ragged_all_to_all_padded`: the same result through a dense all-to-all of slices padded to t
                   rows. Per slot, not per token: a token whose k slots go to one device is sent k times, so it
                   moves k/n of "allgather"'s bytes (more when k > n, as for the released model's k = 10 on 8
                   devices; see `moe_comm_bytes`).
    With no expert axis and no expert_mlp axis (e.g. `make_mesh(data=8)`: pure data parallelism, the experts
    replicated) there is nothing to exchange: each device runs its own tokens through all the experts
    ("allgather" only).
    `execution.moe_chunks` K: exchange and compute in K independent pieces (tokens for "allgather", local experts
    for "alltoall") so asynchronous collectives can overlap the expert matmuls; same result.
    `execution.w8a8`: the local experts round their activations through FP8 per row and 512 columns ("allgather"
    and "ragged"; with TP-MoE each device's I/m must hold whole blocks); with `gate_up_scale` and `down_scale`
    (gate_up and down FP8 with these 128x128 block scales, `Experts.fp8_tiles`, read as stored by the kernels in
    "allgather" and "ragged" without tensor-parallel experts: one byte a weight from HBM) the kernels multiply FP8
    activations by them. The other paths take dequantised weights (`Experts.dequantized`).
    With `return_stats`, returns (y, EPStats)."""
    if not isinstance(execution, Execution) or execution.mesh is None:
        raise ValueError("moe_ep runs on a mesh: pass an Execution with one, e.g. Execution(mesh=make_mesh(expert=8))")
    ex = execution
    fp8_tiles = gate_up_scale is not None or down_scale is not None
    if fp8_tiles and (gate_up_scale is None or down_scale is None or ex.kernels != "pallas"
                      or ex.exchange not in ("allgather", "ragged") or ex.experts == "dense"):
        raise ValueError("FP8 experts with their block scales (gate_up_scale and down_scale, both) are read as "
                         "stored by the kernels (Execution(kernels='pallas')) in the exchanges 'allgather' and "
                         "'ragged'; for the other paths pass the dequantised weights (Experts.dequantized)")
    act_block = ACT_BLOCK if ex.w8a8 and not fp8_tiles else None
    return _exchange(x, weights, experts, gate_up, down, ex, _local_path(ex, act_block), interleaved=False,
                     act_block=act_block, scales=(gate_up_scale, down_scale) if fp8_tiles else None,
                     w8a8=ex.w8a8 and fp8_tiles, return_stats=return_stats)


def _local_path(ex: Execution, act_block) -> str:
    """The local experts' path in an exchange: "dense", the kernels ("pallas"; not with the XLA paths' W8A8
    rounding `act_block`, and not in the all-to-all, whose capacity buffers run their own), or "sorted"."""
    if ex.experts == "dense":
        return "dense"
    return "pallas" if ex.pallas and act_block is None and ex.exchange != "alltoall" else "sorted"


def _exchange(x, weights, experts, gate_up, down, ex: Execution, local: str, *, interleaved, act_block, scales,
              w8a8, return_stats=False):
    """`moe_ep` after its choices: `local` (`_local_path`), `interleaved` (gate_up's rows already regrouped for
    TP-MoE by `tp_interleave_gate_up`, as `shard_model` stores them)."""
    mesh, scheme, chunks = ex.mesh, ex.exchange, ex.moe_chunks
    rules = LOGICAL_RULES if ex.rules is None else ex.rules
    fp8_tiles = scales is not None
    x, weights, experts, gate_up, down = (jnp.asarray(a) for a in (x, weights, experts, gate_up, down))
    if x.ndim != 2 or weights.shape != experts.shape or weights.ndim != 2 or weights.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [N, H], weights and experts [N, k]; got {x.shape}, {weights.shape}, "
                         f"{experts.shape}")
    N, _ = x.shape
    k = experts.shape[1]
    E, I = gate_up.shape[0], down.shape[2]
    ex_axes = mesh_axes_for("experts", mesh, rules)
    tp_axes = mesh_axes_for("expert_mlp", mesh, rules)
    tok_axes = mesh_axes_for("batch", mesh, rules)
    if not ex_axes and not tp_axes and scheme != "allgather":
        raise ShardingError(f"mesh {dict(mesh.shape)} has no axis the 'experts' rule maps to "
                            f"({mesh_axes_for('experts', None, rules)}): the experts are replicated and there are "
                            f"no tokens to exchange, so exchange {scheme!r} does not apply; use exchange 'allgather' "
                            f"(each device runs its own tokens) or a mesh with an expert axis, e.g. "
                            f"make_mesh(expert=8)")
    overlap = set(ex_axes) & set(tp_axes) | set(tok_axes) & set(tp_axes)
    if overlap:
        raise ShardingError(f"mesh axes {sorted(overlap)} cannot split both experts/tokens and the expert width; "
                            f"give tensor-parallel experts their own axis (e.g. 'model')")
    missing = [a for a in ex_axes if a not in tok_axes]
    if missing:
        raise ShardingError(f"tokens must be split over the expert axes too, but the 'batch' rule lacks {missing}")
    n = _axes_size(mesh, ex_axes)
    if E % n:
        raise ShardingError(f"{E} experts cannot be split over {_axes_desc(mesh, ex_axes)}; use an expert-axis "
                            f"size that divides {E}")
    m = _axes_size(mesh, tp_axes)
    if I % m:
        raise ShardingError(f"expert width I = {I} cannot be split over {_axes_desc(mesh, tp_axes)} (expert_mlp); "
                            f"use a tensor-parallel size that divides {I}")
    if act_block is not None and scheme == "alltoall":
        raise ValueError("W8A8 runs with the exact exchanges 'allgather' and 'ragged', not 'alltoall'")
    if act_block is not None and (I // m) % act_block:
        raise ShardingError(f"W8A8 quantises the expert activations in {act_block}-wide blocks, but each device holds "
                            f"I/m = {I // m} columns of the expert width; use a tensor-parallel size m with I/m a "
                            f"multiple of {act_block}")
    n_tok = _axes_size(mesh, tok_axes)
    if N % n_tok:
        raise ShardingError(f"{N} tokens cannot be split over {_axes_desc(mesh, tok_axes)} = {n_tok} devices; pad "
                            f"the batch to a multiple of {n_tok}")
    t = N // n_tok
    hierarchical = len(ex_axes) == 2  # two expert axes (chip x core): the inner one first, then the outer
    if scheme != "allgather" and not ex_axes:
        raise ShardingError(f"exchange {scheme!r} moves tokens between expert-parallel devices; with tensor-"
                            f"parallel experts only (no expert axis) use exchange 'allgather'")
    if scheme == "alltoall":
        C = moe_capacity(t, E, k, ex.capacity)
        if (E // n) % chunks:
            raise ShardingError(f"moe_chunks={chunks} must divide the {E // n} local experts per device for 'alltoall'")
    elif scheme == "ragged":
        if chunks != 1:
            raise ValueError("Execution(moe_chunks) applies to the exchanges 'allgather' and 'alltoall'; 'ragged' "
                             "runs in one piece")
        if local == "dense":
            raise ValueError("exchange 'ragged' receives rows grouped by expert and runs the grouped SwiGLU on them: "
                             "use experts='sorted'")
        C = None
    else:
        C = None
        if t % chunks:
            raise ShardingError(f"moe_chunks={chunks} must divide the {t} tokens per device for 'allgather'")
    if fp8_tiles and tp_axes:
        raise ShardingError("FP8 experts read as stored need whole experts per device: with tensor-parallel experts "
                            "(an 'expert_mlp' axis) pass the dequantised weights")
    f = _ep_fn(mesh, scheme, tok_axes, ex_axes, tp_axes, C, local, bool(hierarchical), int(chunks),
               not interleaved, scheme == "ragged" and native_ragged(mesh), act_block, fp8_tiles, bool(w8a8))
    scales = tuple(jnp.asarray(a) for a in scales) if fp8_tiles else ()
    y, dropped = f(x, weights, experts.astype(jnp.int32), gate_up, down, *scales)
    if not return_stats:
        return y
    return y, EPStats(dropped, dropped / (N * k), C)


def moe_on_mesh(block, x, weights, experts):
    """The MoE exchange of a placed model (`qwen35.sharding.PlacedLM` hands it to every `SparseMoeBlock` as its
    `routed_fn`): `moe_ep` as `block.execution` says, on the block's own experts (FP8 experts read as stored by
    the kernels where each device holds whole experts: a 128x128 scale block does not split over I/m; TP-MoE
    experts in the regrouped gate_up layout `shard_model` stores)."""
    ex = block.execution
    whole = not mesh_axes_for("expert_mlp", ex.mesh, LOGICAL_RULES if ex.rules is None else ex.rules)
    gate_up, down, scales, act, local, w8a8 = expert_operands(block, x.dtype, whole)
    return _exchange(x, weights, experts, gate_up, down, ex, local, interleaved=not whole,
                     act_block=act, scales=scales or None, w8a8=w8a8)


def moe_ep_local(block, x, weights, experts, *, expert_axes: tuple[str, ...]):
    """`moe_on_mesh` as code that runs *inside* a `shard_map` over the mesh: what the serving engine's
    data-parallel step (`qwen35.serving.runner`, every device running its own rank's sequences) hands
    `SparseMoeBlock.__call__` as `routed_fn`. The same bodies as `moe_ep`'s exact exchanges
    (`block.execution.exchange` "allgather" or "ragged"), whose `shard_map` cannot nest inside the step's own.

    x [t, H], weights, experts [t, k]: this device's tokens; `block.experts` holds this device's E/n experts. The
    tokens and packed routing metadata are all-gathered over `expert_axes` (hierarchically for two axes), each
    device sums its own experts' share (`expert_operands`: the execution's local path), and a
    reduce-scatter returns each device its own tokens' sums; or the ragged all-to-all's two trips. With no expert
    axis the experts are whole on every device and this is the block's own `routed`."""
    if not expert_axes:
        return block.routed(x, weights, experts)
    ex = block.execution
    if ex.exchange not in ("allgather", "ragged"):
        raise ValueError(f"moe_ep_local runs the exact exchanges 'allgather' and 'ragged', not {ex.exchange!r}")
    gate_up, down, scales, act, local, w8a8 = expert_operands(block, x.dtype, True)
    if ex.exchange == "ragged":
        y, _ = _ragged_body(x, weights, experts, gate_up, down, *scales, ex_axes=tuple(expert_axes), tp_axes=(),
                            native=native_ragged(ex.mesh), kernels=local == "pallas", act_block=act, w8a8=w8a8)
        return y
    y, _ = _allgather_body(x, pack_routing(experts, weights.astype(jnp.float32)), gate_up, down,
                           ex_axes=tuple(expert_axes), tp_axes=(), impl=local, hierarchical=len(expert_axes) == 2,
                           chunks=1, act_block=act, scales=scales or None, w8a8=w8a8)
    return y


def expert_operands(block, dtype, whole: bool):
    """How a MoE block's local experts enter an exchange, as its `execution` says: (gate_up, down, scales,
    act_block, local path "sorted" | "dense" | "pallas", w8a8 in the kernels). On the kernels FP8 experts are read
    as stored, with their block scales (gate_up's, down's) and, with `w8a8`, FP8 x FP8 products; otherwise (or
    not `whole`: tensor-parallel experts, whose I/m slices split the 128x128 scale blocks) they are dequantised to
    `dtype`, and W8A8 is the XLA paths' activation rounding (`act_block`), which the kernels do not take."""
    ex = block.execution
    tiles = block.experts.fp8_tiles() if whole and _local_path(ex, None) == "pallas" else None
    if tiles is not None:  # 1 byte a weight from HBM
        gate_up, down, *scales = tiles
        return gate_up, down, tuple(scales), None, "pallas", ex.w8a8
    gate_up, down = block.experts.dequantized(dtype)
    act = ACT_BLOCK if ex.w8a8 else None
    return gate_up, down, (), act, _local_path(ex, act), False


# ------------------------------------------------------------------------------------------------------------
# Expert placement by load
def balanced_expert_placement(load, n_devices: int) -> np.ndarray:
    """A permutation of the E experts that spreads load over `n_devices` expert-parallel devices holding E/n
    contiguous experts each: experts sorted by load (heaviest first), each placed on the least-loaded device
    that still has room (greedy longest-processing-time). Returns `perm` [E] int: new slot i holds old expert
    perm[i], so device d gets experts perm[d·E/n:(d+1)·E/n]. Apply it to a checkpoint by permuting the router
    rows (`gate.weight[perm]`) and the expert weights (`gate_up_proj[perm]`, `down_proj[perm]`): the model's
    output is unchanged (routing picks the same experts under new ids) and the busiest device's load drops.

    `load`: tokens per expert [E] (e.g. `qwen35.moe.expert_load(...).tokens_per_expert` measured on traffic)."""
    load = np.asarray(load, dtype=np.float64)
    E = load.shape[0]
    if load.ndim != 1 or E % n_devices:
        raise ShardingError(f"need a load vector [E] with E a multiple of n_devices={n_devices}, got {load.shape}")
    per = E // n_devices
    bins: list[list[int]] = [[] for _ in range(n_devices)]
    totals = np.zeros(n_devices)
    for e in np.argsort(-load, kind="stable"):
        open_ = [d for d in range(n_devices) if len(bins[d]) < per]
        d = min(open_, key=lambda d: (totals[d], d))
        bins[d].append(int(e))
        totals[d] += load[e]
    return np.array([e for b in bins for e in sorted(b)], dtype=np.int64)
