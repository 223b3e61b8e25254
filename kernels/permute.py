"""Token permute / unpermute for the MoE: gather tokens into expert order, and the weighted combine back.

With N tokens routed to k experts each (M = N·k slots) and `order [M]` the slots sorted by expert
(`sort_by_expert`: order[m] = n·k + j of the m-th sorted slot):

    permute:    x_sorted[m] = x[order[m] // k]                                   [N, H] -> [M, H]
    unpermute:  y[n] = Σ_j w[n, j] · y_sorted[inv[n·k + j]],  inv = order⁻¹       [M, H] -> [N, H]

The references use XLA's gather and a scatter-add (`.at[token].add`). The kernels are row-gather DMA engines,
the job the Ironwood post hands to the SparseCore: a grid over row blocks, the source row of every output row read
from the index array in SMEM (scalar prefetch), one DMA per row from HBM into the output block. The combine
gathers the k rows of each token the same way (by the inverse permutation, so it is a gather, not a scatter:
no write conflicts, deterministic), then sums them weighted in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35.kernels.interpret import default_interpret

__all__ = ["sort_by_expert", "rank_in_expert", "permute", "permute_reference", "unpermute", "unpermute_reference",
           "inverse_order"]


@functools.partial(jax.jit, static_argnames="num_experts")
def sort_by_expert(experts: jax.Array, num_experts: int):
    """Sort the M = N·k (token, slot) pairs by expert id (stable, so token order inside each group).

    Returns (order [M] — flat slot index n·k + j of each sorted row, group_sizes [E] int32).

    When (E + 1)·M fits in int32, this sorts ONE int32 key per slot, expert·M + slot: the keys are distinct and
    ordered by expert, then by slot, so the sorted keys mod M are the stable order. XLA's CPU sort of a single
    array is several times faster than the comparator sort behind a stable `argsort` (which sorts (key, index)
    pairs). Larger M·E falls back to `argsort`."""
    flat = experts.reshape(-1).astype(jnp.int32)
    M = flat.shape[0]
    if (num_experts + 1) * M < 2**31:
        order = jnp.sort(flat * M + jnp.arange(M, dtype=jnp.int32)) % M
    else:
        order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order.astype(jnp.int32), group_sizes


def rank_in_expert(experts: jax.Array, num_experts: int) -> jax.Array:
    """[N, k] position of each slot among the slots sent to the same expert, counting in token order."""
    order, group_sizes = sort_by_expert(experts, num_experts)
    starts = jnp.cumsum(group_sizes) - group_sizes
    flat = experts.reshape(-1)
    M = flat.shape[0]
    rank_sorted = jnp.arange(M, dtype=jnp.int32) - starts[flat[order]]
    return jnp.zeros((M,), jnp.int32).at[order].set(rank_sorted).reshape(experts.shape)


def _check(x, order, k):
    if x.ndim != 2:
        raise ValueError(f"x must be [N, H] (flatten batch and time first), got shape {tuple(x.shape)}")
    if order.ndim != 1 or order.shape[0] != x.shape[0] * k:
        raise ValueError(f"order must be [N·k] = [{x.shape[0] * k}] for N = {x.shape[0]} tokens and k = {k}, "
                         f"got shape {tuple(order.shape)}")


def permute_reference(x, order, k: int) -> jax.Array:
    """x_sorted = x[order // k] (XLA gather)."""
    _check(x, order, k)
    return x[order // k]


def unpermute_reference(y_sorted, order, weights) -> jax.Array:
    """y[n] = Σ_j weights[n, j] · y_sorted[sorted position of slot n·k + j], as a weighted scatter-add in fp32."""
    N, k = weights.shape
    if y_sorted.ndim != 2 or y_sorted.shape[0] != N * k or order.shape != (N * k,):
        raise ValueError(f"y_sorted must be [N·k, H] and order [N·k] with N·k = {N * k} (weights {weights.shape}), "
                         f"got {tuple(y_sorted.shape)} and {tuple(order.shape)}")
    w_sorted = weights.reshape(-1)[order].astype(jnp.float32)
    y = jnp.zeros((N, y_sorted.shape[1]), jnp.float32).at[order // k].add(y_sorted.astype(jnp.float32)
                                                                         * w_sorted[:, None])
    return y.astype(y_sorted.dtype)


def inverse_order(order) -> jax.Array:
    """inv[order[m]] = m: the sorted position of each slot."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _gather_rows_kernel(src_ref, x_hbm, o_ref, sem, *, rows):
    """o_ref[r] = x_hbm[src[i·rows + r]] for the rows of block i: one DMA per row, all in flight, then waited."""
    base = pl.program_id(0) * rows

    def copy(r):
        return pltpu.make_async_copy(x_hbm.at[pl.ds(src_ref[base + r], 1)], o_ref.at[pl.ds(r, 1)], sem)

    def start(r, c):
        copy(r).start()
        return c

    def wait(r, c):
        copy(r).wait()
        return c

    jax.lax.fori_loop(0, rows, start, 0)
    jax.lax.fori_loop(0, rows, wait, 0)


@functools.partial(jax.jit, static_argnames=("rows", "interpret"))
def _gather_rows(x, src, *, rows, interpret):
    """out[m] = x[src[m]] for m < len(src), via the row-DMA kernel; len(src) is padded to a multiple of rows."""
    M, H = src.shape[0], x.shape[1]
    nb = -(-M // rows)
    src_p = jnp.pad(src.astype(jnp.int32), (0, nb * rows - M))                    # pad rows copy row 0
    out = pl.pallas_call(
        functools.partial(_gather_rows_kernel, rows=rows),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(nb,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((rows, H), lambda i, src: (i, 0)),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct((nb * rows, H), x.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(src_p, x)
    return out[:M]


def permute(x, order, k: int, *, block_rows: int = 8, interpret=None) -> jax.Array:
    """Kernel version of `permute_reference`: x [N, H], order [N·k] -> x_sorted [N·k, H]."""
    x, order = jnp.asarray(x), jnp.asarray(order)
    _check(x, order, k)
    if order.shape[0] == 0:
        return jnp.zeros((0, x.shape[1]), x.dtype)
    return _gather_rows(x, order // k, rows=block_rows, interpret=default_interpret(interpret))


def _combine_kernel(inv_ref, y_hbm, w_ref, o_ref, buf, sem, *, rows, k):
    """o[t] = Σ_j w[t, j] · y[inv[(i·rows + t)·k + j]]: gather the k·rows source rows, then a weighted sum."""
    base = pl.program_id(0) * rows * k

    def copy(r):   # r = t·k + j
        t, j = jax.lax.div(r, k), jax.lax.rem(r, k)   # lax.div/rem: % and // lower through sign(), TPU-only
        return pltpu.make_async_copy(y_hbm.at[pl.ds(inv_ref[base + r], 1)], buf.at[j, pl.ds(t, 1)], sem)

    def start(r, c):
        copy(r).start()
        return c

    def wait(r, c):
        copy(r).wait()
        return c

    jax.lax.fori_loop(0, rows * k, start, 0)
    jax.lax.fori_loop(0, rows * k, wait, 0)
    w = w_ref[...].astype(jnp.float32)                                              # [rows, k]
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(k):
        acc += w[:, j:j + 1] * buf[j].astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("rows", "interpret"))
def _combine(y_sorted, inv, weights, *, rows, interpret):
    N, k = weights.shape
    H = y_sorted.shape[1]
    nb = -(-N // rows)
    inv_p = jnp.pad(inv.astype(jnp.int32), (0, (nb * rows - N) * k))
    w_p = jnp.pad(weights, ((0, nb * rows - N), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_combine_kernel, rows=rows, k=k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(nb,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((rows, k), lambda i, inv: (i, 0))],
            out_specs=pl.BlockSpec((rows, H), lambda i, inv: (i, 0)),
            scratch_shapes=[pltpu.VMEM((k, rows, H), y_sorted.dtype), pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=jax.ShapeDtypeStruct((nb * rows, H), y_sorted.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(inv_p, y_sorted, w_p)
    return out[:N]


def unpermute(y_sorted, order, weights, *, block_rows: int = 8, interpret=None) -> jax.Array:
    """Kernel version of `unpermute_reference`: y_sorted [N·k, H], order [N·k], weights [N, k] -> y [N, H]."""
    y_sorted, order, weights = jnp.asarray(y_sorted), jnp.asarray(order), jnp.asarray(weights)
    N, k = weights.shape
    if y_sorted.ndim != 2 or y_sorted.shape[0] != N * k or order.shape != (N * k,):
        raise ValueError(f"y_sorted must be [N·k, H] and order [N·k] with N·k = {N * k} (weights {weights.shape}), "
                         f"got {tuple(y_sorted.shape)} and {tuple(order.shape)}")
    if N == 0:
        return jnp.zeros((0, y_sorted.shape[1]), y_sorted.dtype)
    return _combine(y_sorted, inverse_order(order), weights, rows=block_rows,
                    interpret=default_interpret(interpret))
