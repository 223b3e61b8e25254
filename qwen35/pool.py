"""The serving pool as the layers see it: its element format and where a GDN layer's states lie, from the model's
config. The layers' paged calls (`GatedAttention.paged`, `GatedDeltaNet.paged`) read and write the pool through
these; `qwen35.serving.cache` owns the pool itself (its allocator, its size, its layout explained), and
`qwen35.kernels.state_pool` the addressing in plain sizes that the kernels share.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35.config import Qwen35Config
from qwen35.kernels.state_pool import (PoolLayout, bits_dtype, conv_stride, read_conv_state, read_recurrent,
                                       value_dtype, write_conv_state, write_recurrent)

__all__ = ["SCRATCH_PAGE", "NO_BLOCK", "pool_dtype", "to_pool", "from_pool", "pool_layout", "layout_of", "read_rec",
           "read_conv", "read_state", "write_rec", "write_conv", "write_state"]

SCRATCH_PAGE = 0
NO_BLOCK = np.iinfo(np.int32).max  # the state block of a padding row: outside every pool (reads 0, writes dropped)


def pool_dtype(pool: jax.Array) -> jnp.dtype:
    """The cache dtype whose bits `pool` stores (float32 or bfloat16)."""
    return value_dtype(pool.dtype)


def to_pool(x: jax.Array, pool: jax.Array) -> jax.Array:
    """x as `pool` stores it: cast to the cache dtype, then its bits."""
    return jax.lax.bitcast_convert_type(x.astype(pool_dtype(pool)), pool.dtype)


def from_pool(bits: jax.Array, pool: jax.Array) -> jax.Array:
    """Bits read from `pool` as values of the cache dtype."""
    return jax.lax.bitcast_convert_type(bits, pool_dtype(pool))


def pool_layout(config: Qwen35Config, page_size: int, dtype, *, attention_layers: int | None = None) -> PoolLayout:
    """The pool's geometry for `config` with `page_size`-token pages in `dtype` (float32 or bfloat16).
    `attention_layers`: the layers with pages in the pool (default the model's full-attention layers; a
    speculative engine adds the MTP head's, whose pages follow the model's: units 2A and 2A + 1)."""
    c = config
    A, n_gdn = c.num_full_layers if attention_layers is None else attention_layers, c.num_linear_layers
    if A == 0:
        raise ValueError("the unified cache pool sizes its blocks by the attention layers' pages; this config has "
                         "no full-attention layer (layer_types), so it has nothing to page")
    if page_size < 1:
        raise ValueError(f"page_size (block_size) must be >= 1, got {page_size}")
    size = bits_dtype(dtype).itemsize
    unit = page_size * c.num_key_value_heads * c.head_dim
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * (4 // size)
    conv = c.linear_conv_kernel_dim * conv_stride(c.linear_conv_dim)  # tap-major, each tap whole 128-lane rows
    rec_u, conv_u = -(-rec // unit), -(-conv // unit)
    blocks = -(-n_gdn * (rec_u + conv_u) // (2 * A))
    return PoolLayout(A, n_gdn, page_size, unit, rec_u, conv_u, rec, conv, blocks, 4 // size)


def layout_of(config: Qwen35Config, pool: jax.Array) -> PoolLayout:
    """The layout of an existing pool (its page size, dtype and attention layers read from its shape)."""
    unit = pool.shape[-1]
    return pool_layout(config, unit // (config.num_key_value_heads * config.head_dim), pool_dtype(pool),
                       attention_layers=pool.shape[-3] // 2)


def read_rec(config: Qwen35Config, pool: jax.Array, j, blocks: jax.Array) -> jax.Array:
    """GDN layer j's recurrent states [R, Hv, Dk, Dv] float32 for rows with state blocks `blocks` [R, state_blocks]
    (rows at `NO_BLOCK` read zeros), from that layer's recurrent units."""
    c = config
    rec = read_recurrent(layout_of(config, pool), pool, j, blocks)
    return rec.reshape(blocks.shape[0], c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)


def read_conv(config: Qwen35Config, pool: jax.Array, j, blocks: jax.Array, conv_dtype) -> jax.Array:
    """GDN layer j's conv states [R, conv_dim, Kc] in conv_dtype for rows with state blocks `blocks` (rows at
    `NO_BLOCK` read zeros), from that layer's conv units."""
    c = config
    conv = read_conv_state(layout_of(config, pool), pool, j, blocks, c.linear_conv_dim, c.linear_conv_kernel_dim)
    return conv.astype(conv_dtype)


def read_state(config: Qwen35Config, pool: jax.Array, j, blocks: jax.Array, conv_dtype):
    """GDN layer j's (conv [R, conv_dim, Kc] in conv_dtype, recurrent [R, Hv, Dk, Dv] float32) for rows with state
    blocks `blocks` [R, state_blocks] (rows at `NO_BLOCK` read zeros). Reads only that layer's units: the recurrent
    and the conv units read apart (one gather feeding both would be computed twice, once per consumer)."""
    return read_conv(config, pool, j, blocks, conv_dtype), read_rec(config, pool, j, blocks)


def write_rec(config: Qwen35Config, pool: jax.Array, j, blocks: jax.Array, rec: jax.Array) -> jax.Array:
    """The pool with GDN layer j's recurrent states of rows `blocks` [R, state_blocks] replaced by rec [R, Hv, Dk,
    Dv] (writes of rows at `NO_BLOCK` are dropped), into that layer's recurrent units."""
    return write_recurrent(layout_of(config, pool), pool, j, blocks, rec)


def write_conv(config: Qwen35Config, pool: jax.Array, j, blocks: jax.Array, conv: jax.Array) -> jax.Array:
    """The pool with GDN layer j's conv states of rows `blocks` replaced by conv [R, conv_dim, Kc] (writes of rows
    at `NO_BLOCK` are dropped), into that layer's conv units."""
    return write_conv_state(layout_of(config, pool), pool, j, blocks, conv)


def write_state(config: Qwen35Config, pool: jax.Array, j, blocks: jax.Array, conv: jax.Array,
                rec: jax.Array) -> jax.Array:
    """The pool with GDN layer j's states of rows `blocks` [R, state_blocks] replaced by conv and rec (writes of
    rows at `NO_BLOCK` are dropped). Writes only that layer's units: the recurrent and the conv units in a scatter
    each, with no concatenated copy of the two. Both scatters update the pool in place when the new recurrent
    state depends on the conv state read (as the GDN rule's does); otherwise XLA may copy the pool to order the
    conv read before the first write."""
    return write_conv(config, write_rec(config, pool, j, blocks, rec), j, blocks, conv)
