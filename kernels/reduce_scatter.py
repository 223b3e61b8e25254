"""Hierarchical reduce-scatter with remote DMAs on a 2-level mesh (cores inside a chip, then chips), in one Pallas
TPU kernel, beside its references `lax.psum_scatter` and `qwen35.sharding.hierarchical_psum_scatter`.

Call inside `jax.shard_map` over a mesh with an outer axis (chips, b devices) and an inner axis (cores of a chip, a
devices). Each device holds x [M, D]; the device at (outer o, inner i) gets block o·a + i (M / (a·b) rows) of the
sum over all a·b devices: exactly `lax.psum_scatter(x, (outer, inner), scatter_dimension=0, tiled=True)`.

How (seen as x [b, a, R, D], R = M / (a·b); block (o', i') = x[o', i']):
  phase 1, inner ring over the a cores: reduce-scatter the a column groups {x[:, i']} so core i holds
           y[o'] = Σ_inner x[o', i] for every o' (b·R rows; all traffic on the fast on-chip links);
  phase 2, outer ring over the b chips: reduce-scatter y's b blocks so chip o keeps Σ_outer y[o] (R rows: only
           1/a of the data crosses chips).
Each phase is a ring of n − 1 steps: at step s a device sends its partial sum of block (me − s − 1) mod n to the
next device, receives block (me − s − 2) mod n from the previous one and adds its own copy of that block; after
n − 1 steps it holds the full sum of block `me`. Every block is split into `micro_batches` pieces sent as separate
DMAs, so while a device adds piece j the DMA of piece j + 1 is still in flight (transfer overlaps the adds).
Each step and piece has its own receive slot and semaphores, so nothing is overwritten while a neighbour might
still read it (no races; the race detector agrees), at the price of (n − 1)/n of a block of VMEM per phase. An
entry barrier with the four neighbours makes sure nobody writes into a device's VMEM before it runs the kernel.

Bytes each device sends (X = M·D·itemsize): (a − 1)/a·X on chip + (b − 1)/(a·b)·X across chips, the same as
`hierarchical_psum_scatter`, against (ab − 1)/(ab)·X for a flat ring of which most would cross chips.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35.kernels.interpret import default_interpret

__all__ = ["hierarchical_reduce_scatter", "reduce_scatter_bytes"]


def reduce_scatter_bytes(M: int, D: int, itemsize: int, inner: int, outer: int) -> dict[str, float]:
    """Bytes one device sends in each phase (ring model) and for a flat ring over all inner·outer devices."""
    X = M * D * itemsize
    a, b = inner, outer
    return {"on_chip": (a - 1) / a * X, "cross_chip": (b - 1) / (a * b) * X, "flat_ring": (a * b - 1) / (a * b) * X}


def _ring_phase(n, me, neighbour, local_piece, recv, send, recv_sems, send_sems, write_result, m):
    """One ring reduce-scatter over n devices. local_piece(blk, j) -> this device's ref view of piece j of block
    blk; recv/send: VMEM [n-1, m, *piece]; write_result(j, value) stores the finished piece j of block `me`."""
    if n == 1:
        for j in range(m):
            write_result(j, local_piece(me, j)[...])
        return
    right = neighbour((me + 1) % n)

    def copy(src, s, j):
        return pltpu.make_async_remote_copy(src, recv.at[s, j], send_sems.at[s, j], recv_sems.at[s, j],
                                            device_id=right, device_id_type=pl.DeviceIdType.MESH)

    sends = []
    blk0 = jax.lax.rem(me + n - 1, n)
    for j in range(m):  # step 0: send our own copy of block me - 1
        cp = copy(local_piece(blk0, j), 0, j)
        cp.start()
        sends.append(cp)
    for s in range(1, n):
        blk = jax.lax.rem(me + 2 * n - s - 1, n)  # the block that arrived at step s - 1
        for j in range(m):
            copy(recv.at[s - 1, j], s - 1, j).wait_recv()  # piece j; piece j + 1 may still be in flight
            acc = recv[s - 1, j] + local_piece(blk, j)[...]
            if s < n - 1:
                send[s, j] = acc
                cp = copy(send.at[s, j], s, j)
                cp.start()
                sends.append(cp)
            else:
                write_result(j, acc)
    for cp in sends:
        cp.wait_send()


def _rs_kernel(x_ref, o_ref, y_ref, recv1, send1, rsem1, ssem1, recv2, send2, rsem2, ssem2, *, inner_axis, outer_axis,
               a, b, m, mb):
    i = jax.lax.axis_index(inner_axis)
    o = jax.lax.axis_index(outer_axis)
    # Entry barrier: tell both ring neighbours on both axes that we are here, wait until all four told us.
    barrier = pltpu.get_barrier_semaphore()
    for axis, me, n in ((inner_axis, i, a), (outer_axis, o, b)):
        for step in (1, n - 1):
            pltpu.semaphore_signal(barrier, 1, device_id={axis: jax.lax.rem(me + step, n)},
                                   device_id_type=pl.DeviceIdType.MESH)
    pltpu.semaphore_wait(barrier, 4)

    rows = lambda j: pl.ds(j * mb, mb)  # noqa: E731

    def y_write(j, val):
        y_ref[:, rows(j)] = val

    _ring_phase(a, i, lambda d: {inner_axis: d}, lambda blk, j: x_ref.at[:, blk, rows(j)], recv1, send1, rsem1, ssem1,
                y_write, m)

    def o_write(j, val):
        o_ref[rows(j)] = val.astype(o_ref.dtype)

    _ring_phase(b, o, lambda d: {outer_axis: d}, lambda blk, j: y_ref.at[blk, rows(j)], recv2, send2, rsem2, ssem2,
                o_write, m)


def hierarchical_reduce_scatter(x, inner_axis: str, outer_axis: str, *, micro_batches: int = 2, interpret=None,
                                collective_id: int = 7):
    """Reduce-scatter x [M, D] (rows) over (outer_axis, inner_axis) with remote DMAs; call inside `jax.shard_map`.
    Returns this device's [M / (a·b), D] block o·a + i of the sum, like `lax.psum_scatter(x, (outer_axis,
    inner_axis), scatter_dimension=0, tiled=True)`. M must be a multiple of a·b·micro_batches."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, D] (scattered over rows), got shape {tuple(x.shape)}")
    a, b = jax.lax.axis_size(inner_axis), jax.lax.axis_size(outer_axis)
    M, D = x.shape
    m = int(micro_batches)
    if m < 1 or M % (a * b * m):
        raise ValueError(f"rows M={M} must be a multiple of {outer_axis}×{inner_axis}×micro_batches = {b}×{a}×{m}; "
                         f"pad x or change micro_batches")
    R = M // (a * b)
    mb = R // m
    xs = x.reshape(b, a, R, D)
    vmem = pltpu.MemorySpace.VMEM
    kernel = functools.partial(_rs_kernel, inner_axis=inner_axis, outer_axis=outer_axis, a=a, b=b, m=m, mb=mb)
    return pl.pallas_call(
        kernel,
        in_specs=[pl.BlockSpec(memory_space=vmem)],
        out_specs=pl.BlockSpec(memory_space=vmem),
        out_shape=jax.ShapeDtypeStruct((R, D), x.dtype),
        scratch_shapes=[
            pltpu.VMEM((b, R, D), x.dtype),  # y: the inner phase's result
            pltpu.VMEM((max(1, a - 1), m, b, mb, D), x.dtype), pltpu.VMEM((max(1, a - 1), m, b, mb, D), x.dtype),
            pltpu.SemaphoreType.DMA((max(1, a - 1), m)), pltpu.SemaphoreType.DMA((max(1, a - 1), m)),
            pltpu.VMEM((max(1, b - 1), m, mb, D), x.dtype), pltpu.VMEM((max(1, b - 1), m, mb, D), x.dtype),
            pltpu.SemaphoreType.DMA((max(1, b - 1), m)), pltpu.SemaphoreType.DMA((max(1, b - 1), m)),
        ],
        compiler_params=pltpu.CompilerParams(collective_id=collective_id, has_side_effects=True),
        interpret=default_interpret() if interpret is None else interpret,
    )(xs)
