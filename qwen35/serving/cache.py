"""The serving cache: paged K/V for the attention layers, recycled state slots for the Gated DeltaNet layers.

Layout (one `PagedHybridCache`, a pytree the jitted step reads and writes in place):

    layers[i]  attention layer:  KVCache(k, v),     k, v  [num_pages, page_size, Hkv, Dh]   (activation dtype)
               GDN layer:        GDNState(conv, recurrent),
                                                    conv       [num_slots, conv_dim, Kc]    (activation dtype)
                                                    recurrent  [num_slots, Hv, Dk, Dv]      (float32)

Page 0 and slot `num_slots - 1` are scratch: the padding tokens and padding sequences of a bucketed step write
there, so real pages are 1 .. num_pages - 1 and real slots 0 .. num_slots - 2. A sequence owns a block table (the
list of its pages, logical page j holds tokens j·page_size .. (j+1)·page_size - 1) and one slot index, used by
every GDN layer. Pages are allocated as the sequence grows and all freed, with the slot, when it finishes or is
preempted.

Bytes per sequence (what `layout_bytes` returns; `Qwen35Config.cache_bytes_per_sequence` is the same napkin math):
  KV    = ceil(tokens / page_size) · page_size · n_attention_layers · 2 · Hkv · Dh · bytes(dtype)   grows with context,
          wasting at most page_size - 1 tokens' worth in the last page
  GDN   = n_gdn_layers · (conv_dim · Kc · bytes(dtype) + Hv · Dk · Dv · 4)                          fixed per sequence
For the 397B model in bf16 at 8K + 1K tokens: KV 15 layers · 2 · 2 · 256 · 2 B = 30 KiB/token → 270 MiB; GDN
45 · (12,288 · 4 · 2 + 64 · 128 · 128 · 4) B ≈ 184 MiB, fixed: the GDN state is why hybrid models serve long
contexts cheaply, and also why a slot costs as much as ~6.3K tokens of KV.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qwen35.attention import KVCache
from qwen35.config import LINEAR, Qwen35Config
from qwen35.gdn import GDNState

__all__ = ["CacheFullError", "BlockAllocator", "SlotAllocator", "PagedHybridCache", "init_paged_cache",
           "layout_bytes", "SCRATCH_PAGE"]

SCRATCH_PAGE = 0


class CacheFullError(RuntimeError):
    """Not enough free pages (the scheduler catches it and preempts)."""


class BlockAllocator:
    """A free list of KV pages and one block table per sequence. Page 0 is scratch and never handed out."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (page 0 is scratch), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(1, num_blocks))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra pages sequence `seq_id` needs to hold `num_tokens` tokens in total."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, math.ceil(num_tokens / self.block_size) - have)

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.num_free

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Grow the block table of `seq_id` to cover `num_tokens` tokens; returns the table."""
        n = self.blocks_needed(seq_id, num_tokens)
        if n > self.num_free:
            raise CacheFullError(f"sequence {seq_id} needs {n} more pages, {self.num_free} free")
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(n))
        return table

    def free(self, seq_id: int) -> None:
        self.free_blocks.extend(self.tables.pop(seq_id, ()))


class SlotAllocator:
    """A free list of GDN state slots; slot `num_slots - 1` is scratch (padding rows) and never handed out."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (one is scratch), got {num_slots}")
        self.num_slots = num_slots
        self.scratch = num_slots - 1
        self.free_slots: deque[int] = deque(range(num_slots - 1))
        self.owner: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self, seq_id: int) -> int:
        if seq_id in self.owner:
            return self.owner[seq_id]
        if not self.free_slots:
            raise CacheFullError(f"no free GDN state slot for sequence {seq_id}")
        self.owner[seq_id] = slot = self.free_slots.popleft()
        return slot

    def free(self, seq_id: int) -> None:
        if seq_id in self.owner:
            self.free_slots.append(self.owner.pop(seq_id))


class PagedHybridCache(NamedTuple):
    """`layers[i]`: `KVCache` of pages (attention) or `GDNState` of slots (GDN); see the module docstring."""

    layers: tuple

    def nbytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(self.layers)))


def init_paged_cache(config: Qwen35Config, num_pages: int, page_size: int, num_slots: int, dtype=jnp.float32, *,
                     ranks: int | None = None, sharding=None) -> PagedHybridCache:
    """Zeros: K/V pages for every attention layer, conv + recurrent slots for every GDN layer.

    With `ranks` (the engine on a mesh), every array gets a leading [ranks] axis: rank r's own pages and slots,
    numbered from 0 as on one device. `sharding` (a `NamedSharding` splitting that axis) creates each rank's share
    on its own device, so no device ever holds another rank's cache."""
    c = config
    lead = () if ranks is None else (ranks,)

    def make():
        layers = []
        for kind in c.layer_types:
            if kind == LINEAR:
                layers.append(GDNState(
                    conv=jnp.zeros(lead + (num_slots, c.linear_conv_dim, c.linear_conv_kernel_dim), dtype),
                    recurrent=jnp.zeros(lead + (num_slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                                c.linear_value_head_dim), jnp.float32)))
            else:
                shape = lead + (num_pages, page_size, c.num_key_value_heads, c.head_dim)
                layers.append(KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))
        return PagedHybridCache(tuple(layers))

    return make() if sharding is None else jax.jit(make, out_shardings=sharding)()


def layout_bytes(config: Qwen35Config, num_tokens: int, page_size: int, dtype_bytes: int = 2) -> dict:
    """Bytes one sequence of `num_tokens` tokens holds in this layout (KV rounded up to whole pages)."""
    c = config
    pages = math.ceil(num_tokens / page_size)
    kv_page = page_size * c.num_full_layers * 2 * c.num_key_value_heads * c.head_dim * dtype_bytes
    conv = c.num_linear_layers * c.linear_conv_dim * c.linear_conv_kernel_dim * dtype_bytes
    rec = c.num_linear_layers * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    return {"pages": pages, "kv_bytes_per_page": kv_page, "kv_bytes": pages * kv_page,
            "kv_waste_bytes": (pages * page_size - num_tokens) * kv_page // page_size,
            "gdn_conv_bytes": conv, "gdn_recurrent_bytes": rec, "total": pages * kv_page + conv + rec}
