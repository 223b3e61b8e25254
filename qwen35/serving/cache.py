"""The serving cache: one pool of equal-sized blocks per device, holding both the attention layers' K/V pages and
the Gated DeltaNet layers' states.

Why one pool: a hybrid model's sequence needs two kinds of memory, KV that grows with its context and a GDN
state of fixed size. Two fixed pools (pages, and one state slot per possible sequence) strand memory whenever the
workload's mix differs from the one they were sized for: many short requests run out of state slots with pages
free; a few long ones run out of pages with slots free. With one pool, a block is a page or a piece of a state,
whichever the running sequences need (vLLM's hybrid allocator does the same for Mamba-style layers).

Layout (`PagedHybridCache.pool`, per device; with the engine on a mesh every rank's pool is a slice of a leading
[ranks] axis):

    pool [2·A, num_blocks, page_size·Hkv·Dh]   (A = attention layers; stored as unsigned integers of the cache
                                               dtype's width: uint16 for bfloat16, uint32 for float32)

  * block b is column b: 2·A *units* of page_size·Hkv·Dh elements each, one K and one V page for every attention
    layer. Attention layer i's K pages are pool[2i] and its V pages pool[2i + 1], each a free view
    [num_blocks, page_size, Hkv, Dh]: a page id means the same block in every attention layer, as before.
  * a GDN state takes `state_blocks` whole blocks (a list of block ids, not necessarily adjacent). Its units,
    numbered u = 0, 1, ... across its blocks (unit u is pool[u mod 2A, blocks[u div 2A]]), hold every GDN layer's
    state in turn: layer j's recurrent state (Hv·Dk·Dv float32, in the order [Hv, Dk, Dv]; in a 16-bit pool
    stored as two planes, the high 16 bits of every float32, then the low 16 bits) then its conv state (its Kc
    taps one after another, each conv_dim values in the cache dtype padded to whole rows of 128 lanes), each
    rounded up to whole units, so no unit holds two layers' data. A layer
    reads and writes only its data: whole units, and the used prefix of a part-filled last unit (a conv state
    often fills a small share of its unit; reading the whole unit would move several times its bytes). Planes,
    not interleaved halves: a kernel that DMAs a state into VMEM rebuilds each float32 from two same-shaped tiles
    with a shift and an or (`join_halves`), where interleaved halves would need a lane shuffle; tap-major conv
    rows likewise shift the conv window by whole rows (`kernels/paged_gdn_decode.py` reads and writes both states
    in place that way; `qwen35.kernels.state_pool` holds the addressing, `qwen35.pool` reads it by the model's config).
  * the pool holds bits, not numbers: K/V and states are bitcast in and out, so a float32 state survives a trip
    through 16-bit storage bit for bit. (Moving bfloat16 *values* is not safe for that: XLA:CPU computes bf16
    copies, pads and scatters through float32 and flushes the subnormal halves of a float32 to zero.)
  * block 0 is scratch: the padding tokens of a bucketed step write their K/V there. Padding rows' GDN states
    are addressed at `NO_BLOCK`, outside the pool: they read zeros and their writes are dropped.

A sequence holds its pages (grown as it runs) and its state blocks (taken when it is admitted); all return to the
free list together when it finishes or is preempted.

Bytes (`layout_bytes`; `Qwen35Config.cache_bytes_per_sequence` is the same napkin math without the rounding):
  block = 2 · A · page_size · Hkv · Dh · bytes(dtype)           one page of every attention layer
  KV    = ceil(tokens / page_size) blocks                       grows with context (the last page part-used)
  GDN   = state_blocks blocks                                    fixed per sequence
The GDN state is rounded up twice (each layer's parts to whole units, the whole state to whole blocks): that is the
padding the shared pool costs. For the 397B model in bf16 with 256-token pages a block is 7.5 MiB (15 attention
layers) and a state 184.2 MiB of data in 26 blocks (195 MiB: 5.9% padding, mostly each layer's 96 KiB conv state
rounded up to a 256 KiB unit); with 16-token pages it fills 393 blocks exactly. For the tiny preset in float32 with
16-token pages a state is 51 KiB of data in 5 blocks of 16 KiB (see `layout_bytes`, and notebook 09).
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen35.config import Qwen35Config
from qwen35.kernels.state_pool import PoolLayout, bits_dtype
from qwen35.pool import pool_layout

__all__ = ["CacheFullError", "BlockAllocator", "PagedHybridCache", "init_paged_cache", "pool_blocks", "layout_bytes"]

class CacheFullError(RuntimeError):
    """Not enough free blocks (the scheduler catches it and preempts)."""


class BlockAllocator:
    """One free list of pool blocks for both kinds of memory: each sequence's block table (its KV pages, grown as
    it runs) and its GDN state blocks (`state_blocks` of them, taken when it is admitted). Block 0 is scratch and
    never handed out."""

    def __init__(self, num_blocks: int, block_size: int, state_blocks: int = 0):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if state_blocks < 0:
            raise ValueError(f"state_blocks must be >= 0, got {state_blocks}")
        self.num_blocks, self.block_size, self.state_blocks = num_blocks, block_size, state_blocks
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.tables: dict[int, list[int]] = {}  # seq_id -> KV pages
        self.states: dict[int, list[int]] = {}  # seq_id -> GDN state blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the pool holds with no GDN state in it."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra pages sequence `seq_id` needs to hold `num_tokens` tokens in total."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, math.ceil(num_tokens / self.block_size) - have)

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free

    def can_admit(self, seq_id: int, num_tokens: int) -> bool:
        """Whether a new sequence fits: its GDN state blocks plus the pages of its first `num_tokens` tokens."""
        state = 0 if seq_id in self.states else self.state_blocks
        return state + self.blocks_needed(seq_id, num_tokens) <= self.num_free

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow the block table of `seq_id` to cover `num_tokens` tokens; returns the table."""
        n = self.blocks_needed(seq_id, num_tokens)
        if n > self.num_free:
            raise CacheFullError(f"sequence {seq_id} needs {n} more blocks, {self.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(n))
        return table

    def allocate_state(self, seq_id: int) -> list[int]:
        """The GDN state blocks of `seq_id` (taken on the first call)."""
        if seq_id not in self.states:
            if self.state_blocks > self.num_free:
                raise CacheFullError(f"sequence {seq_id} needs {self.state_blocks} blocks for its GDN state, "
                                     f"{self.num_free} free")
            self.states[seq_id] = [self.free_blocks.popleft() for _ in range(self.state_blocks)]
        return self.states[seq_id]

    def free(self, seq_id: int) -> None:
        """Return every block of `seq_id` (pages and state) to the free list."""
        self.free_blocks.extend(self.tables.pop(seq_id, ()))
        self.free_blocks.extend(self.states.pop(seq_id, ()))


class PagedHybridCache(NamedTuple):
    """`pool`: the one array of the serving cache (see the module docstring)."""

    pool: jax.Array

    def nbytes(self) -> int:
        return int(self.pool.nbytes)


def init_paged_cache(config: Qwen35Config, num_blocks: int, page_size: int, dtype=jnp.float32, *,
                     ranks: int | None = None, sharding=None, attention_layers: int | None = None
                     ) -> PagedHybridCache:
    """A zero pool of `num_blocks` blocks of `page_size`-token pages (`pool_layout`).

    With `ranks` (the engine on a mesh), the pool gets a leading [ranks] axis: rank r's own blocks, numbered from 0
    as on one device. `sharding` (a `NamedSharding` splitting that axis) creates each rank's share on its own
    device, so no device ever holds another rank's cache."""
    lay = pool_layout(config, page_size, dtype, attention_layers=attention_layers)
    shape = (() if ranks is None else (ranks,)) + (lay.units_per_block, num_blocks, lay.unit)

    def make():
        return PagedHybridCache(jnp.zeros(shape, bits_dtype(dtype)))

    return make() if sharding is None else jax.jit(make, out_shardings=sharding)()


def pool_blocks(lay: PoolLayout, seqs: int, context: int, state_groups: int = 1) -> int:
    """The blocks a pool needs to hold `seqs` sequences of up to `context` tokens at once: each sequence's pages
    (ceil(context / page_size)) and its GDN state (`state_groups` copies of `state_blocks`: a speculative engine
    keeps one per verified position), plus the scratch block."""
    return seqs * (-(-context // lay.page_size) + state_groups * lay.state_blocks) + 1


def layout_bytes(config: Qwen35Config, num_tokens: int, page_size: int, dtype_bytes: int = 2) -> dict:
    """Bytes one sequence of `num_tokens` tokens holds in the pool: its pages (the last one part-used) and its GDN
    state blocks, with the padding of each."""
    c = config
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bfloat16) or 4 (float32), got {dtype_bytes}")
    lay = pool_layout(c, page_size, {2: jnp.bfloat16, 4: jnp.float32}[dtype_bytes])
    block = lay.units_per_block * lay.unit * dtype_bytes
    pages = math.ceil(num_tokens / page_size)
    conv = c.num_linear_layers * c.linear_conv_dim * c.linear_conv_kernel_dim * dtype_bytes
    rec = c.num_linear_layers * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    state = lay.state_blocks * block
    return {"block_bytes": block, "pages": pages, "kv_bytes_per_page": block, "kv_bytes": pages * block,
            "kv_waste_bytes": (pages * page_size - num_tokens) * block // page_size,
            "state_blocks": lay.state_blocks, "gdn_conv_bytes": conv, "gdn_recurrent_bytes": rec,
            "gdn_state_bytes": state, "gdn_waste_bytes": state - conv - rec,
            "total": pages * block + state}
