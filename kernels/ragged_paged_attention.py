"""Ragged paged attention: one call attends a mixed batch of prefill chunks and decode tokens over a paged KV cache.

This module holds the pure-JAX reference (gather the pages, then attend) and the Pallas TPU kernel
`ragged_paged_attention`. Both share one signature, so the serving engine and the model can switch between them by
`backend`.

Layouts (S = number of sequence slots, Tq = total query tokens of the step, P = pages per sequence):
  q            [Tq, Hq, D]             queries of all sequences, packed back to back (sequence s owns
                                        q[cu_q_lens[s]:cu_q_lens[s+1]])
  k_pages      [num_pages, page_size, Hkv, D]   keys, already normed and rotated, as the cache stores them
  v_pages      [num_pages, page_size, Hkv, D]
  kv_lens      [S] int32               tokens in the cache for sequence s *including* this step's queries
  page_indices [S, P] int32            page table: logical page j of sequence s lives in k_pages[page_indices[s, j]]
  cu_q_lens    [S + 1] int32           cumulative query lengths, cu_q_lens[0] = 0
  num_seqs     [1] int32               sequences in use (slots >= num_seqs are ignored; their queries, if any, give 0)

Causality: the query tokens of sequence s are its last q_len = cu_q_lens[s+1] - cu_q_lens[s] tokens, so query i
sits at position kv_len - q_len + i and sees keys 0 .. kv_len - q_len + i. Query head h reads KV head
h // (Hq / Hkv) (GQA). Scores and softmax are float32; the output has q's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from qwen35.kernels.interpret import default_interpret

__all__ = ["ragged_paged_attention", "ragged_paged_attention_pool", "ragged_paged_attention_reference", "check_ragged_inputs", "default_interpret",
           "rpa_cost"]


def check_ragged_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    """Shape checks shared by the reference and the kernel; errors name the tensor and the expected shape."""
    if q.ndim != 3:
        raise ValueError(f"q must be [Tq, Hq, D], got shape {tuple(q.shape)}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [num_pages, page_size, Hkv, D]; got "
                         f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}")
    Hq, D = q.shape[1:]
    Hkv = k_pages.shape[2]
    if k_pages.shape[3] != D:
        raise ValueError(f"head dim of q ({D}) and k_pages ({k_pages.shape[3]}) differ")
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    S = kv_lens.shape[0]
    if page_indices.ndim != 2 or page_indices.shape[0] != S:
        raise ValueError(f"page_indices must be [S={S}, pages_per_seq], got {tuple(page_indices.shape)}")
    if cu_q_lens.shape != (S + 1,):
        raise ValueError(f"cu_q_lens must be [S + 1 = {S + 1}], got {tuple(cu_q_lens.shape)}")
    if num_seqs.shape != (1,):
        raise ValueError(f"num_seqs must be [1], got {tuple(num_seqs.shape)}")


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                     sm_scale: float | None = None) -> jax.Array:
    """Gather each sequence's pages into a contiguous [P·page_size] KV, then attend causally. Returns [Tq, Hq, D].

    Written for clarity, not speed: every query token is matched against the whole (padded) KV of its sequence.
    """
    check_ragged_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    Tq, Hq, D = q.shape
    _, page_size, Hkv, _ = k_pages.shape
    S, P = page_indices.shape
    G = Hq // Hkv
    scale = D ** -0.5 if sm_scale is None else sm_scale

    # Which sequence does each query token belong to, and at which position is it?
    t = jnp.arange(Tq, dtype=jnp.int32)
    seq = jnp.sum(t[:, None] >= cu_q_lens[None, 1:], axis=1).astype(jnp.int32)   # [Tq]
    valid = (seq < num_seqs[0]) & (t < cu_q_lens[S])
    seq_c = jnp.minimum(seq, S - 1)
    q_len = cu_q_lens[seq_c + 1] - cu_q_lens[seq_c]
    pos = kv_lens[seq_c] - q_len + (t - cu_q_lens[seq_c])                      # [Tq]

    k = k_pages[page_indices].reshape(S, P * page_size, Hkv, D)                 # [S, L, Hkv, D]
    v = v_pages[page_indices].reshape(S, P * page_size, Hkv, D)
    kq = k[seq_c].astype(jnp.float32)                                           # [Tq, L, Hkv, D]
    vq = v[seq_c].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(Tq, Hkv, G, D)
    s = jnp.einsum("tkgd,tlkd->tkgl", qg, kq) * scale
    key_pos = jnp.arange(P * page_size, dtype=jnp.int32)
    mask = (key_pos[None, :] <= pos[:, None]) & valid[:, None]                  # [Tq, L]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None, :], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("tkgl,tlkd->tkgd", p / jnp.where(denom > 0, denom, 1.0), vq)
    return o.reshape(Tq, Hq, D).astype(q.dtype)


# ------------------------------------------------------------------------------------------------------------
# The Pallas TPU kernel.
#
# Schedule (the design of jax's / tpu-inference's ragged paged attention, written small):
#   * grid = (Tq / block_q,): the packed query axis is cut into fixed blocks of `block_q` tokens, *ignoring*
#     sequence boundaries. A block of decode tokens therefore holds `block_q` different sequences (the "batched"
#     decode: several sequences per grid step), a block of a long prefill chunk holds one.
#   * per block, a loop over the sequences that overlap it (their range comes from scalar prefetch); for each, a
#     loop over its KV pages in groups of `pages_per_block`, each page fetched from HBM by its own DMA (the page
#     table is read from SMEM), double-buffered: group b+1 is in flight while group b is multiplied.
#   * only the pages up to the block's last visible position are fetched (causal skip); online softmax in fp32
#     per KV head, the G = Hq/Hkv query heads of that KV head stacked as rows [block_q·G, D] of one matmul (GQA).
#   * the rows of the block that belong to the sequence are written at the end of its loop; rows of no sequence
#     (padding, slots >= num_seqs) stay 0, as in the reference.
#   * VMEM layout: the pages are viewed (a free reshape) as [num_pages, page_size·Hkv, D] and land as rows of a
#     [pages_per_block·page_size·Hkv, D] buffer, D on the lanes with no padding of the small Hkv axis; KV head h's
#     keys are every Hkv-th row, read with a strided load (as tpu-inference's kernel does).
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def _rpa_kernel(kv_idx_ref, kv_lens_ref, pt_ref, cu_ref, seq_lo_ref, seq_hi_ref,   # scalar prefetch (SMEM)
                q_ref, *refs,   # inputs: q block (VMEM), pages (HBM: k and v, or one pool holding both); output; scratch
                block_q, pages_per_block, page_size, pages_per_seq, sm_scale, kv_dtype, one_source):
    if one_source:  # the serving pool: K and V pages are both in it
        kv_hbm, o_ref, k_buf, v_buf, sems = refs
        k_hbm = v_hbm = kv_hbm
    else:
        k_hbm, v_hbm, o_ref, k_buf, v_buf, sems = refs
    bq, Hkv, G, D = q_ref.shape
    ppb, ps, P = pages_per_block, page_size, pages_per_seq
    L = ppb * ps                      # keys per KV block
    rows = bq * G
    i = pl.program_id(0)
    blk_start = i * bq
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    q = q_ref[...]
    tok_row = blk_start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), G)    # token of each score row
    tok = blk_start + jax.lax.broadcasted_iota(jnp.int32, (bq, 1, 1), 0)              # token of each output row

    def seq_body(s, _):
        q_start, q_end = cu_ref[s], cu_ref[s + 1]
        q_len, kv_len = q_end - q_start, kv_lens_ref[s]
        lo, hi = jnp.maximum(q_start, blk_start), jnp.minimum(q_end, blk_start + bq)

        @pl.when(hi > lo)
        def _attend():
            last_pos = kv_len - q_len + (hi - 1 - q_start)       # position of the block's last token of seq s
            n_blocks = jax.lax.div(jax.lax.div(last_pos, ps) + ppb, ppb)  # KV blocks it sees (causal skip)

            def for_pages(b, slot, action):    # one K and one V DMA per page of KV block b, into buffer `slot`
                def body(j, c):
                    page = pt_ref[s * P + jnp.minimum(b * ppb + j, P - 1)]   # clamped: tail pages are masked
                    rows_j = pl.ds(j * ps * Hkv, ps * Hkv)                    # page j's rows in the buffer
                    for src, dst, sem in ((k_hbm.at[kv_idx_ref[0]], k_buf, sems.at[0, slot]),
                                          (v_hbm.at[kv_idx_ref[1]], v_buf, sems.at[1, slot])):
                        action(pltpu.make_async_copy(src.at[page], dst.at[slot, rows_j], sem))
                    return c

                jax.lax.fori_loop(0, ppb, body, 0)

            for_pages(0, 0, lambda c: c.start())
            pos = kv_len - q_len + tok_row - q_start                          # [rows, 1]
            in_seq = (tok_row >= lo) & (tok_row < hi)

            def kv_body(b, carry):
                slot = jax.lax.rem(b, 2)   # lax.rem/div, not % and //: those lower through sign(), which needs a TPU

                @pl.when(b + 1 < n_blocks)
                def _prefetch():
                    for_pages(b + 1, 1 - slot, lambda c: c.start())

                for_pages(b, slot, lambda c: c.wait())
                kpos = b * L + jax.lax.broadcasted_iota(jnp.int32, (1, L), 1)
                mask = in_seq & (kpos <= pos)                                 # [rows, L]
                new = []
                for h in range(Hkv):
                    m, l, acc = carry[h]
                    qh = q[:, h].reshape(rows, D)
                    # Buffer row (key·Hkv + h): KV head h's L keys are every Hkv-th row (a strided load).
                    kh = k_buf[slot, pl.ds(h, L, stride=Hkv), :]
                    vh = v_buf[slot, pl.ds(h, L, stride=Hkv), :]
                    if kh.dtype != kv_dtype:  # a pool of bits (the serving engine's): the values, bit for bit
                        kh = jax.lax.bitcast_convert_type(kh, kv_dtype)
                        vh = jax.lax.bitcast_convert_type(vh, kv_dtype)
                    sc = jax.lax.dot_general(qh, kh, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32) * sm_scale
                    sc = jnp.where(mask, sc, _MASK)
                    m_new = jnp.maximum(m, jnp.max(sc, axis=1, keepdims=True))
                    alpha = jnp.exp(m - m_new)
                    p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)
                    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
                    pv = jax.lax.dot_general(p.astype(vh.dtype), vh, (((1,), (0,)), ((), ())),
                                             preferred_element_type=jnp.float32)
                    new.append((m_new, l, alpha * acc + pv))
                return tuple(new)

            init = tuple((jnp.full((rows, 1), _MASK, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                          jnp.zeros((rows, D), jnp.float32)) for _ in range(Hkv))
            final = jax.lax.fori_loop(0, n_blocks, kv_body, init)
            keep = (tok >= lo) & (tok < hi)                                   # [bq, 1, 1]
            for h in range(Hkv):
                _, l, acc = final[h]
                o_h = (acc / jnp.where(l > 0, l, 1.0)).reshape(bq, G, D).astype(o_ref.dtype)
                o_ref[:, h] = jnp.where(keep, o_h, o_ref[:, h])

        return 0

    jax.lax.fori_loop(seq_lo_ref[i], seq_hi_ref[i], seq_body, 0)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "pages_per_block", "interpret", "kv_dtype"))
def _rpa(q, k_src, v_src, kv_idx, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, block_q,
         pages_per_block, interpret, kv_dtype):
    """The kernel on K pages k_src[kv_idx[0]] and V pages v_src[kv_idx[1]] (k_src, v_src [C, num_pages, ps, Hkv,
    D]; a plain pair of page arrays is C = 1, kv_idx = (0, 0); v_src None: the V pages are in k_src too)."""
    Tq, Hq, D = q.shape
    C, _, ps, Hkv, _ = k_src.shape
    S, P = page_indices.shape
    G = Hq // Hkv
    bq = block_q
    nqb = max(1, -(-Tq // bq))
    q4 = jnp.pad(q, ((0, nqb * bq - Tq), (0, 0), (0, 0))).reshape(nqb * bq, Hkv, G, D)
    cu = cu_q_lens.astype(jnp.int32)
    blk_start = jnp.arange(nqb, dtype=jnp.int32) * bq
    # Sequences overlapping q block i: [seq_lo, seq_hi) = (ends <= block start) .. (starts < block end), < num_seqs.
    seq_lo = jnp.sum(cu[None, 1:] <= blk_start[:, None], axis=1).astype(jnp.int32)
    seq_hi = jnp.sum(cu[None, :S] < blk_start[:, None] + bq, axis=1).astype(jnp.int32)
    seq_hi = jnp.minimum(seq_hi, jnp.minimum(num_seqs[0], S)).astype(jnp.int32)
    kernel = functools.partial(_rpa_kernel, block_q=bq, pages_per_block=pages_per_block, page_size=ps,
                               pages_per_seq=P, sm_scale=sm_scale, kv_dtype=kv_dtype, one_source=v_src is None)
    # free reshapes: the pages stay put; the serving pool is passed once (its K and V pages are both in it)
    srcs = [k_src.reshape(C, -1, ps * Hkv, D)] + ([] if v_src is None else [v_src.reshape(C, -1, ps * Hkv, D)])
    q_spec = pl.BlockSpec((bq, Hkv, G, D), lambda i, *_: (i, 0, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(nqb,),
            in_specs=[q_spec] + [pl.BlockSpec(memory_space=pl.ANY)] * len(srcs),
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((2, pages_per_block * ps * Hkv, D), k_src.dtype),
                            pltpu.VMEM((2, pages_per_block * ps * Hkv, D), srcs[-1].dtype),
                            pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
    )(kv_idx.astype(jnp.int32), kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32).reshape(-1), cu, seq_lo,
      seq_hi, q4, *srcs)
    return out.reshape(nqb * bq, Hq, D)[:Tq]


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: float | None = None, block_q: int = 8, pages_per_block: int | None = None,
                           interpret=None) -> jax.Array:
    """The Pallas TPU kernel: same arguments, layouts and result as `ragged_paged_attention_reference`.

    block_q: query tokens per grid step (a block of decode tokens is `block_q` sequences at once).
    pages_per_block: KV pages fetched per inner step (default: enough for 128 keys, at least 1). Each page is
    one DMA, so small pages mean many small DMAs and many page-table reads: the reason 256-token pages beat
    16-token ones on TPU. interpret: None = TPU interpret mode off TPU, or a `pltpu.InterpretParams` / bool.
    Entries of `page_indices` past a sequence's pages must still be valid page ids (they may be fetched, then
    masked); kv_lens[s] >= q_len(s) for every used sequence.
    """
    check_ragged_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    return _rpa_call(q, k_pages[None], v_pages[None], jnp.zeros(2, jnp.int32), kv_lens, page_indices, cu_q_lens,
                     num_seqs, sm_scale=sm_scale, block_q=block_q, pages_per_block=pages_per_block,
                     interpret=interpret)


def ragged_paged_attention_pool(q, pool, kv_index, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                                kv_dtype=None, sm_scale: float | None = None, block_q: int = 8,
                                pages_per_block: int | None = None, interpret=None) -> jax.Array:
    """`ragged_paged_attention` with the K pages `pool[kv_index]` and the V pages `pool[kv_index + 1]` of a cache
    pool [C, num_pages, page_size, Hkv, D] (the serving engine's, `qwen35.serving.cache`): the kernel's DMAs
    read the layer's pages in place, so no copy of a layer's pages is made. kv_index may be traced (one compiled
    program serves every attention layer). A pool of unsigned integers holds the bits of `kv_dtype` values (the
    engine's pool), bitcast back after each page lands in VMEM."""
    if pool.ndim != 5:
        raise ValueError(f"pool must be [C, num_pages, page_size, Hkv, D], got shape {tuple(pool.shape)}")
    kv_dtype = jnp.dtype(kv_dtype or pool.dtype)
    if kv_dtype.itemsize != pool.dtype.itemsize:
        raise ValueError(f"kv_dtype {kv_dtype} is not as wide as the pool's {pool.dtype}")
    page = jax.ShapeDtypeStruct(pool.shape[1:], kv_dtype)
    check_ragged_inputs(q, page, page, kv_lens, page_indices, cu_q_lens, num_seqs)
    idx = jnp.asarray(kv_index, jnp.int32)
    return _rpa_call(q, pool, None, jnp.stack([idx, idx + 1]), kv_lens, page_indices, cu_q_lens, num_seqs,
                     sm_scale=sm_scale, block_q=block_q, pages_per_block=pages_per_block, interpret=interpret,
                     kv_dtype=kv_dtype)


def _rpa_call(q, k_src, v_src, kv_idx, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, block_q,
              pages_per_block, interpret, kv_dtype=None):
    """The kernel on K pages k_src[kv_idx[0]] and V pages v_src[kv_idx[1]] (v_src None: both in k_src)."""
    page_size = k_src.shape[2]
    if pages_per_block is None:
        pages_per_block = max(1, 128 // page_size)
    pages_per_block = min(pages_per_block, page_indices.shape[1])   # never more than a sequence can own
    if not isinstance(block_q, int) or block_q < 1 or not isinstance(pages_per_block, int) or pages_per_block < 1:
        raise ValueError(f"block_q and pages_per_block must be positive ints, got {block_q!r}, {pages_per_block!r}")
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    return _rpa(q, k_src, v_src, kv_idx, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=scale,
                block_q=block_q, pages_per_block=pages_per_block, interpret=default_interpret(interpret),
                kv_dtype=jnp.dtype(kv_dtype or k_src.dtype))


def rpa_cost(kv_lens, q_lens, *, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             dtype_bytes: int = 2) -> dict:
    """Napkin math for one call: FLOPs (QKᵀ and PV, causal), bytes (KV pages read once per sequence, q and o),
    and the number of page DMAs. kv_lens, q_lens: per-sequence Python ints."""
    flops = kv_bytes = n_dma = 0
    for kv, ql in zip(kv_lens, q_lens):
        seen = sum(kv - ql + t + 1 for t in range(ql))             # (query, key) pairs under the causal mask
        flops += 4 * seen * num_q_heads * head_dim
        pages = -(-kv // page_size)
        kv_bytes += 2 * pages * page_size * num_kv_heads * head_dim * dtype_bytes
        n_dma += 2 * pages
    q_bytes = 2 * sum(q_lens) * num_q_heads * head_dim * dtype_bytes
    return {"flops": flops, "bytes": kv_bytes + q_bytes, "kv_bytes": kv_bytes, "page_dmas": n_dma}
