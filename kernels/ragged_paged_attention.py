"""Ragged paged attention: one call attends a mixed batch of prefill chunks and decode tokens over a paged KV cache.

This module holds the pure-JAX reference (gather the pages, then attend); the Pallas TPU kernel lives beside it.
Both share one signature, so the serving engine and the model can switch between them by `backend`.

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

import jax
import jax.numpy as jnp

__all__ = ["ragged_paged_attention_reference", "check_ragged_inputs"]


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
