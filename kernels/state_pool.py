"""The block pool's state addressing, in plain sizes: where a GDN layer's state units live among a row's state
blocks, and the bits of a float32 state in a 16- or 32-bit pool. The serving cache (`qwen35.serving.cache`, whose
docstring draws the whole layout) and the paged GDN decode kernel both address the pool through these.

  pool [2A, num_blocks, unit]: a block is a column of 2A units. GDN layer j's state is units
  u = j·layer_units + 0 .. layer_units − 1 of its row's state, unit u at pool[u mod 2A, blocks[u div 2A]]:
  first the recurrent state's units (float32 values as one plane of bits in a uint32 pool, as two planes — the
  high 16 bits of every value, then the low 16 bits — in a uint16 pool), then the conv state's: its Kc taps one
  after another (tap-major, [Kc, conv_dim]), each padded to whole rows of 128 lanes (`conv_stride`), in the cache
  dtype's bits. Tap-major rows let a kernel shift the window (drop the oldest tap, append the token) by moving
  whole rows of VMEM; channel-major [conv_dim, Kc] would need a lane shuffle.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PoolLayout", "LANES", "value_dtype", "bits_dtype", "conv_stride", "state_units", "gather_units", "scatter_units",
           "join_halves", "split_halves", "rec_from_bits", "rec_to_bits", "read_recurrent", "write_recurrent",
           "read_conv_state", "write_conv_state"]

LANES = 128  # a TPU vector register's lanes: a VMEM row
_VALUE = {jnp.dtype(jnp.uint32): jnp.dtype(jnp.float32), jnp.dtype(jnp.uint16): jnp.dtype(jnp.bfloat16)}


def value_dtype(bits_dtype) -> jnp.dtype:
    """The cache dtype a pool of `bits_dtype` stores: float32 in uint32, bfloat16 in uint16."""
    try:
        return _VALUE[jnp.dtype(bits_dtype)]
    except KeyError:
        raise ValueError(f"a pool holds uint32 (float32) or uint16 (bfloat16) bits, got "
                         f"{jnp.dtype(bits_dtype)}") from None


def bits_dtype(cache_dtype) -> jnp.dtype:
    """The unsigned integers a pool stores `cache_dtype` (float32 or bfloat16) as: its bits, of the same width."""
    for bits, value in _VALUE.items():
        if value == jnp.dtype(cache_dtype):
            return bits
    raise ValueError(f"the cache dtype must be float32 or bfloat16, got {jnp.dtype(cache_dtype)}")


def conv_stride(conv_dim: int) -> int:
    """Pool elements one conv tap takes: conv_dim rounded up to whole rows of `LANES`."""
    return -(-conv_dim // LANES) * LANES


class PoolLayout(NamedTuple):
    """Where everything lives in the pool (see the module docstring); sizes in pool elements. Plain integers: the
    serving cache computes them from the model's config (`qwen35.pool.pool_layout`)."""

    attention_layers: int  # A: the pool has 2A units per block
    gdn_layers: int
    page_size: int
    unit: int              # elements of one unit: page_size · Hkv · Dh (one K or V page of one attention layer)
    rec_units: int         # units of one GDN layer's recurrent state
    conv_units: int        # units of one GDN layer's conv state
    rec_elems: int         # pool elements of one recurrent state (Hv·Dk·Dv float32, times 2 in a 16-bit pool)
    conv_elems: int        # pool elements of one conv state
    state_blocks: int      # blocks one sequence's GDN state takes
    planes: int            # 16-bit planes of one float32 recurrent value: 1 in a uint32 pool, 2 in a uint16 pool

    @property
    def units_per_block(self) -> int:
        return 2 * self.attention_layers

    @property
    def layer_units(self) -> int:
        return self.rec_units + self.conv_units


def state_units(lay: PoolLayout, j, blocks: jax.Array):
    """(unit index within a block [U], block id [R, U]) of GDN layer j's units for rows with state blocks
    `blocks` [R, state_blocks]; j may be traced (one program serves every GDN layer)."""
    u = j * lay.layer_units + jnp.arange(lay.layer_units)
    return u % lay.units_per_block, jnp.take(blocks, u // lay.units_per_block, axis=1)


def gather_units(lay: PoolLayout, pool, which, ids, first: int, elems: int):
    """[R, elems]: the first `elems` elements of a GDN layer's state part that starts at unit `first`, for every
    row (rows at an id past the pool, `NO_BLOCK`, read zeros). Only the used part of a last, part-filled unit is
    read (a conv state often fills a small share of its unit): the whole units in one gather, the used prefix of
    the last in another."""
    full, rest = divmod(elems, lay.unit)
    R, parts = ids.shape[0], []
    if full:
        sl = slice(first, first + full)
        parts.append(pool.at[which[None, sl], ids[:, sl]].get(mode="fill", fill_value=0).reshape(R, full * lay.unit))
    if rest:
        k = first + full
        parts.append(pool.at[which[k], ids[:, k], :rest].get(mode="fill", fill_value=0))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def scatter_units(lay: PoolLayout, pool, which, ids, first: int, x):
    """`pool` with the state part that starts at unit `first` set to x [R, elems] for every row (rows at an id past
    the pool, `NO_BLOCK`, dropped): whole units in one scatter, the used prefix of a last, part-filled unit in another (the rest of
    that unit is never read, so it is not written)."""
    R, elems = x.shape
    full, rest = divmod(elems, lay.unit)
    if full:
        sl = slice(first, first + full)
        pool = pool.at[which[None, sl], ids[:, sl]].set(x[:, :full * lay.unit].reshape(R, full, lay.unit),
                                                         mode="drop")
    if rest:
        k = first + full
        pool = pool.at[which[k], ids[:, k], :rest].set(x[:, full * lay.unit:], mode="drop")
    return pool


def join_halves(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """float32 values from their high and low 16 bits (uint16 arrays of one shape)."""
    return jax.lax.bitcast_convert_type((hi.astype(jnp.uint32) << 16) | lo.astype(jnp.uint32), jnp.float32)


def split_halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The high and low 16 bits (uint16) of float32 values x."""
    u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return (u >> 16).astype(jnp.uint16), (u & 0xFFFF).astype(jnp.uint16)


def rec_from_bits(bits: jax.Array) -> jax.Array:
    """Recurrent states [..., n] float32 from their pool bits [..., planes · n] (uint32: one plane; uint16: the high
    halves, then the low halves). Integer shifts only: exact on every backend, and Mosaic-friendly (same-shaped
    tiles, one same-width bitcast)."""
    if bits.dtype == jnp.uint32:
        return jax.lax.bitcast_convert_type(bits, jnp.float32)
    n = bits.shape[-1] // 2
    return join_halves(bits[..., :n], bits[..., n:])


def rec_to_bits(rec: jax.Array, pool_dtype_bits) -> jax.Array:
    """The pool bits [..., planes · n] of float32 recurrent states rec [..., n] (the inverse of `rec_from_bits`)
    for a pool of `pool_dtype_bits` (uint32 or uint16)."""
    if jnp.dtype(pool_dtype_bits) == jnp.uint32:
        return jax.lax.bitcast_convert_type(rec.astype(jnp.float32), jnp.uint32)
    return jnp.concatenate(split_halves(rec), axis=-1)


def read_recurrent(lay: PoolLayout, pool: jax.Array, j, blocks: jax.Array) -> jax.Array:
    """GDN layer j's recurrent states [R, Hv·Dk·Dv] float32 (flat) for rows with state blocks `blocks`
    [R, state_blocks] (rows at an id past the pool read zeros): a gather of that layer's recurrent units."""
    which, ids = state_units(lay, j, blocks)
    return rec_from_bits(gather_units(lay, pool, which, ids, 0, lay.rec_elems))


def write_recurrent(lay: PoolLayout, pool: jax.Array, j, blocks: jax.Array, rec: jax.Array) -> jax.Array:
    """The pool with GDN layer j's recurrent states of rows `blocks` replaced by rec [R, ...] float32 (flattened per
    row; writes of rows at an id past the pool are dropped): a scatter into that layer's recurrent units."""
    which, ids = state_units(lay, j, blocks)
    return scatter_units(lay, pool, which, ids, 0, rec_to_bits(rec.reshape(blocks.shape[0], -1), pool.dtype))


def read_conv_state(lay: PoolLayout, pool: jax.Array, j, blocks: jax.Array, conv_dim: int, Kc: int) -> jax.Array:
    """GDN layer j's conv states [R, conv_dim, Kc] in the cache dtype for rows with state blocks `blocks` (rows at
    an id past the pool read zeros): a gather of that layer's conv units, tap-major in the pool."""
    which, ids = state_units(lay, j, blocks)
    bits = gather_units(lay, pool, which, ids, lay.rec_units, lay.conv_elems)
    taps = jax.lax.bitcast_convert_type(bits, value_dtype(pool.dtype)).reshape(-1, Kc, conv_stride(conv_dim))
    return jnp.swapaxes(taps[:, :, :conv_dim], 1, 2)


def write_conv_state(lay: PoolLayout, pool: jax.Array, j, blocks: jax.Array, conv: jax.Array) -> jax.Array:
    """The pool with GDN layer j's conv states of rows `blocks` replaced by conv [R, conv_dim, Kc] (cast to the cache
    dtype; writes of rows at an id past the pool are dropped): a scatter into that layer's conv units."""
    R, C, _ = conv.shape
    taps = jnp.pad(jnp.swapaxes(conv.astype(value_dtype(pool.dtype)), 1, 2), ((0, 0), (0, 0), (0, conv_stride(C) - C)))
    which, ids = state_units(lay, j, blocks)
    bits = jax.lax.bitcast_convert_type(taps, pool.dtype).reshape(R, -1)
    return scatter_units(lay, pool, which, ids, lay.rec_units, bits)
