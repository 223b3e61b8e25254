"""The jitted serving step: one forward over the packed tokens of a scheduler step, reading and writing the paged
hybrid cache, then one sampled token per sequence.

A step packs the tokens of every scheduled sequence back to back — prefill chunks and single decode tokens
together — into `tokens [Tb]`, and runs the model's own modules on them: `DecoderLayer` (norms, residuals, the
MoE), each mixer's own projections and output (`GatedAttention.project / output`, `GatedDeltaNet.project / gates
/ heads / output`) and the model's head (`output_logits`). What is the step's own is where the state lives:

  attention mixer:  K/V scattered into the layer's pages of the pool at `slot_mapping` (every token at its own position), then ragged
                    paged attention over the block tables (the Pallas kernel of `qwen35.kernels` when
                    `execution.kernels == "pallas"`, else `_paged_attention_rows`: the reference's result, computed
                    by rows as the GDN mixer below is; a prefill chunk attends to its own fresh K/V plus, only if it
                    continues a sequence, the context pages before it)
  GDN mixer:        the rows' states read from their state blocks in the pool (`cache.read_state`: only this
                    layer's units), for every row `causal_conv1d_update` + `gated_delta_rule_step` on its last
                    token (exact for rows with one token: decodes), and for the rows with several tokens
                    (prefill chunks) their tokens gathered into a padded block [Sp, Lb] (`gather_idx`),
                    `causal_conv1d` + `chunk_gated_delta_rule` from the row's state (padded steps have g = 0 and
                    beta = 0: decay 1 and no write, so the state is untouched), the conv state taken from the last
                    Kc real inputs; their results replace the single-token ones. A sequence's first step (`fresh`)
                    starts from zero state, so recycled blocks need no clearing. With `kernels="pallas"` the
                    decode rows go through `paged_conv_gdn_decode`, one kernel for the whole step (conv window,
                    conv, gates, rule) that reads and writes each row's conv and recurrent states in the pool by
                    its state block ids (DMAs from scalar-prefetched ids, as tpu-inference's kernels address their
                    state pool): the states cross HBM once each way, as the roofline counts them
                    (`roofline.Scenario.bytes_per_device`), where a gather into a dense block before a dense kernel
                    and a scatter after would move them twice more (on the 397B host, 64 decode rows per device and
                    45 GDN layers of 4 MiB float32 states: 22.5 GiB per step for the kernel, 45 GiB more for the
                    copies, about 13 ms at 3.69 TB/s). Prefill chunks go through `chunked_gdn_conv_packed` (conv
                    fused in) from states gathered for those rows only: a chunk reads and writes its state once for
                    up to Lb tokens, so the copies are a small share of its work. (A pool whose units are not whole rows of 128 lanes
                    falls back to gathering every row for the dense `fused_gdn_decode`.)
  head:             only each sequence's last token, then `sample`.
  MoE on a mesh:    the routed experts' sum is handed in (`routed_fn`): the all-gather / reduce-scatter exchange
                    of `qwen35.sharding.moe_ep_local` inside the step's `shard_map` (see `DataParallel`).

Shapes are bucketed (see `Engine.step_shape`), so a run compiles a handful of programs; padding tokens write to
the scratch page and padding rows' states go nowhere (`NO_BLOCK`, see `cache.py`).

Every layer program gets its index among the layers of its kind (`idx`: which units of the pool are its) as a
traced argument, so the layers of one kind still share one compiled program.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from qwen35.config import FULL, LINEAR
from qwen35.gdn import causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule, gated_delta_rule_step
from qwen35.kernels.chunked_gdn import chunked_gdn_conv_packed
from qwen35.kernels.fused_gdn_decode import fused_gdn_decode
from qwen35.kernels.paged_gdn_decode import paged_conv_gdn_decode, supports_paged_decode
from qwen35.kernels.ragged_paged_attention import ragged_paged_attention_pool
from qwen35.model import bind_program, output_logits
from qwen35.serving.cache import (NO_BLOCK, SCRATCH_PAGE, PagedHybridCache, from_pool, layout_of, pool_dtype, read_conv,
                                  read_rec, to_pool, write_state)
from qwen35.serving.sampling import sample, verify_drafts
from qwen35.sharding import moe_ep_local

__all__ = ["StepBatch", "padding_batch", "DataParallel", "paged_attention", "serving_forward", "step_fn", "FusedStep",
           "LayerwiseStep", "DraftStep"]


class StepBatch(NamedTuple):
    """Everything the jitted step needs besides parameters and cache (all int32 unless noted).

    Tb packed tokens, Sb sequence rows, Sp prefill rows (0 in a decode-only step), Lb their longest query, P pages
    per row, Pc pages of context before a prefill chunk (0 when no prefill row has any).
    """

    tokens: jax.Array        # [Tb] token ids, packed (sequence s owns tokens[cu_q_lens[s]:cu_q_lens[s+1]])
    positions: jax.Array     # [Tb] position of each token in its sequence
    slot_mapping: jax.Array  # [Tb] flat K/V index page·page_size + offset where the token's K/V is written
    cu_q_lens: jax.Array     # [Sb + 1]
    kv_lens: jax.Array       # [Sb] tokens in the cache after this step
    page_indices: jax.Array  # [Sb, P] block tables
    num_seqs: jax.Array      # [1]
    state_blocks: jax.Array  # [Sb, NS] the GDN state blocks of each row (NO_BLOCK for padding rows)
    fresh: jax.Array         # [Sb] bool: the row starts its sequence (zero GDN state)
    gather_idx: jax.Array    # [Sp, Lb] packed index of the j-th token of the p-th prefill row (rows with > 1 token)
    gather_valid: jax.Array  # [Sp, Lb] bool
    pf_rows: jax.Array       # [Sp] row of each prefill entry (Sb for padding: its writes are dropped)
    ctx_pages: jax.Array     # [Sp, Pc] pages of each prefill entry's context before this step (Pc = 0 when every
                             # prefill row starts its sequence: the common case, attention on its own K/V only;
                             # Pc = P, the whole block table, when context + chunk would cost as many keys)
    tok_row: jax.Array       # [Tb] row of each packed token
    tok_pf: jax.Array        # [Tb] bool: the token belongs to a prefill row
    tok_prow: jax.Array      # [Tb] its prefill entry p
    tok_col: jax.Array       # [Tb] its index within the row's tokens of this step
    last_idx: jax.Array      # [Sb] packed index of each row's last token (its logits are sampled)
    temperature: jax.Array   # [Sb] float32
    top_k: jax.Array         # [Sb]
    top_p: jax.Array         # [Sb] float32
    seeds: jax.Array         # [Sb] uint32
    counters: jax.Array      # [Sb] tokens generated so far (folds into the row's key)
    # Speculative decoding (`Engine(speculative_tokens=k)`): Sv verify rows of K1 = k + 1 tokens each (the last
    # token and k drafts), their GDN states kept after every token (`spec_states`: one group of state blocks per
    # position, group 0 the row's own `state_blocks`), and what the MTP head reads after the step.
    spec_idx: jax.Array      # [Sv, K1] packed index of each verify row's tokens (Tb for padding entries)
    spec_rows: jax.Array     # [Sv] row of each verify entry (Sb for padding)
    spec_states: jax.Array   # [Sv, K1, NS] state blocks where the GDN state after token i is written
    mtp_next: jax.Array      # [Tb] the token after each packed token, for the MTP head: >= 0 when the host knows it
                             # (the next prompt token), -1 - c for column c of the row's emitted tokens
    verify_only: jax.Array   # [1] when every row of the step verifies drafts, else [0]: a fact of the shape, so
                             # the program skips the single-token passes whose results the verify rows replace


def padding_batch(Sb: int, P: int, Tb: int, Sp: int = 0, Lb: int = 1, Pc: int = 0, *, state_blocks: int = 0,
                  page_size: int = 1, Sv: int = 0, K1: int = 1, verify_only: bool = False) -> StepBatch:
    """A step of these sizes with no sequence in it (numpy): every token writes the scratch page, every row's
    `state_blocks` state blocks are `NO_BLOCK` (read as zeros, writes dropped), nothing is visible. `Engine.build_batch` starts from it and fills in the
    scheduled rows; an idle rank runs it as it is beside busy ones; its arrays' shapes are what a step is compiled
    for from shapes alone (`qwen35.serving.plan`)."""
    z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
    return StepBatch(tokens=z(Tb), positions=z(Tb), slot_mapping=np.full(Tb, SCRATCH_PAGE * page_size, np.int32),
                     cu_q_lens=z(Sb + 1), kv_lens=z(Sb), page_indices=np.full((Sb, P), SCRATCH_PAGE, np.int32),
                     num_seqs=z(1), state_blocks=np.full((Sb, state_blocks), NO_BLOCK, np.int32), fresh=z(Sb, dtype=bool),
                     gather_idx=z(Sp, Lb), gather_valid=z(Sp, Lb, dtype=bool), pf_rows=np.full(Sp, Sb, np.int32),
                     ctx_pages=np.full((Sp, Pc), SCRATCH_PAGE, np.int32), tok_row=z(Tb), tok_pf=z(Tb, dtype=bool),
                     tok_prow=z(Tb), tok_col=z(Tb), last_idx=z(Sb), temperature=z(Sb, dtype=np.float32),
                     top_k=z(Sb), top_p=np.ones(Sb, np.float32), seeds=z(Sb, dtype=np.uint32), counters=z(Sb),
                     spec_idx=np.full((Sv, K1), Tb, np.int32), spec_rows=np.full(Sv, Sb, np.int32),
                     spec_states=np.full((Sv, K1, state_blocks), NO_BLOCK, np.int32), mtp_next=z(Tb),
                     verify_only=z(int(verify_only)))


# What each per-layer program reads of a StepBatch. `LayerwiseStep` hands a program only these fields (the rest
# None), so it compiles once per shape of what it reads: a GDN layer does not recompile when the step's page-table
# width changes, the head not when its prefill block does.
_MIXED_ROWS = ("last_idx", "tok_row", "gather_idx", "gather_valid", "pf_rows", "tok_pf", "tok_prow", "tok_col")
BATCH_FIELDS = {
    "gdn": _MIXED_ROWS + ("state_blocks", "fresh", "spec_idx", "spec_rows", "spec_states", "verify_only"),
    "attention": _MIXED_ROWS + ("positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_indices", "num_seqs",
                                "ctx_pages", "spec_idx", "spec_rows", "verify_only"),
    "head": ("last_idx", "temperature", "top_k", "top_p", "seeds", "counters", "tokens", "spec_idx", "spec_rows",
             "verify_only"),
}


def batch_view(b: StepBatch, reads: str) -> StepBatch:
    """`b` with only the fields `BATCH_FIELDS[reads]` names, the others None."""
    keep = BATCH_FIELDS[reads]
    return b._replace(**{f: None for f in StepBatch._fields if f not in keep})


def paged_attention(kernels: str):
    """The step's ragged paged attention for `kernels` (the layer's `execution.kernels`), as
    `attend(q, k, v, pages, ki, batch) -> [Tb, Hq, D]`
    (k, v: this step's own keys and values [Tb, Hkv, D], already written into the pages; pages: the pool viewed
    as [2A, num_blocks, page_size, Hkv, D], the layer's K pages at pages[ki] and V pages at pages[ki + 1]): the
    Pallas kernel for "pallas" (it reads everything through the block tables, in place), else
    `_paged_attention_rows` (the reference's result, laid out by rows)."""
    if kernels == "pallas":
        return lambda q, k, v, pages, ki, b: ragged_paged_attention_pool(
            q, pages, ki, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, kv_dtype=pool_dtype(pages))
    return _paged_attention_rows


def _softmax_attend(spec: str, qg, k, v, mask, scale):
    """Masked softmax attention in float32. `spec` names q's leading axes (before [Hkv, G, D]) and k/v's (before
    [L, Hkv, D]), e.g. "pj,p" for a block of queries per row; mask has q's leading axes + [L]. Fully masked
    queries give 0."""
    qa, ka = spec.split(",")
    # Keys in their stored dtype, products accumulated in float32: exact for a bf16 cache and bf16 queries (q's
    # float32 copy of bf16 values rounds back exactly), without a float32 copy of every gathered key.
    q_in = qg.astype(k.dtype) if qg.dtype != k.dtype and jnp.finfo(k.dtype).bits < 32 else qg
    s = jnp.einsum(f"{qa}kgd,{ka}lkd->{qa}kgl", q_in, k, preferred_element_type=jnp.float32) * scale
    mask = mask[..., None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum(f"{qa}kgl,{ka}lkd->{qa}kgd", p / jnp.where(denom > 0, denom, 1.0), v)


def _paged_attention_rows(q, k_new, v_new, pool_pages, ki, b: StepBatch):
    """Ragged paged attention for the XLA kernels, by rows instead of by tokens: the same result as
    `ragged_paged_attention_reference` for every real token, without its per-token copy of the sequence's KV
    ([Tb, L, Hkv, D], the cost of a mixed step on CPU).

    Every row's last token attends to the row's pages ([Sb, L]: all a decode row has). The rows with several
    tokens (prefill chunks) attend again as the padded block [Sp, Lb] of `gather_idx` and replace their tokens'
    outputs (the layout `_gdn` uses): causally to the chunk's own keys and values `k_new`, `v_new` (no page
    gather), after the context the row had before this step, read from its first Pc pages (`ctx_pages`). A
    prompt prefilled in one step has no context (Pc = 0), so its attention costs Lb keys per query, not the
    L = P·page_size of the whole block table. When Pc·page_size + Lb would reach L anyway, the engine passes the
    whole table (Pc = P) and the chunk reads every key, its own included, from the pages."""
    T, Hq, D = q.shape
    _, _, PS, Hkv, _ = pool_pages.shape
    Sb, P = b.page_indices.shape
    G, L = Hq // Hkv, P * PS
    scale = D ** -0.5
    kv_dtype = pool_dtype(pool_pages)

    def pages(table):  # [R, P'] page ids -> K [R, P'·PS, Hkv, D] (cache dtype), V (float32): gathers in the pool
        R, n = table.shape
        return (from_pool(pool_pages[ki, table], pool_pages).reshape(R, n * PS, Hkv, D),
                from_pool(pool_pages[ki + 1, table], pool_pages).reshape(R, n * PS, Hkv, D).astype(jnp.float32))

    k, v = pages(b.page_indices)
    qf = q.astype(jnp.float32).reshape(T, Hkv, G, D)
    key_pos = jnp.arange(L, dtype=jnp.int32)
    live = jnp.arange(Sb) < b.num_seqs[0]
    visible = (key_pos[None, :] < b.kv_lens[:, None]) & live[:, None]  # [Sb, L]
    Sp, Lb = b.gather_idx.shape
    Sv, K1 = b.spec_idx.shape
    if b.verify_only.shape[0]:  # every row verifies drafts: the verify block below covers every token
        o = jnp.zeros((T, Hkv, G, D), jnp.float32)
    else:
        o = _softmax_attend("s,s", qf[b.last_idx], k, v, visible, scale)[b.tok_row]  # [Tb, Hkv, G, D]
    if Sp:
        r = jnp.minimum(b.pf_rows, Sb - 1)
        valid = b.gather_valid
        j = jnp.arange(Lb)
        Pc = b.ctx_pages.shape[1]
        start = b.kv_lens[r] - jnp.sum(valid, axis=1)  # [Sp] tokens before the chunk
        if Pc == P:  # the whole block table (cheaper than context + chunk): the chunk's K/V are in the pages too
            keys, vals = pages(b.ctx_pages)
            pos = start[:, None] + j[None, :]  # [Sp, Lb]
            mask = (key_pos[None, None, :] <= pos[..., None]) & valid[..., None]  # [Sp, Lb, L]
        else:
            keys = k_new[b.gather_idx].astype(kv_dtype)  # [Sp, Lb, Hkv, D]: the chunk's own tokens
            vals = v_new[b.gather_idx].astype(jnp.float32)
            mask = (j[None, None, :] <= j[None, :, None]) & valid[:, None, :] & valid[:, :, None]  # [Sp, Lb, Lb]
            if Pc:  # a chunk that continues a sequence: its earlier tokens from the first Pc pages come first
                kc, vc = pages(b.ctx_pages)
                ctx = (jnp.arange(Pc * PS)[None, None, :] < start[:, None, None]) & valid[..., None]  # [Sp, Lb, Pc·PS]
                keys, vals = jnp.concatenate([kc, keys], axis=1), jnp.concatenate([vc, vals], axis=1)
                mask = jnp.concatenate([ctx, mask], axis=-1)
        o_pf = _softmax_attend("pj,p", qf[b.gather_idx], keys, vals, mask, scale)  # [Sp, Lb, Hkv, G, D]
        o = jnp.where(b.tok_pf[:, None, None, None], o_pf[b.tok_prow, b.tok_col], o)
    if Sv:  # verify rows (a speculative step): each token attends causally to its row's pages, itself included
        r = jnp.minimum(b.spec_rows, Sb - 1)
        mask = key_pos[None, None, :] <= b.positions[b.spec_idx][..., None]  # [Sv, K1, L]
        o_sp = _softmax_attend("pj,p", qf[b.spec_idx], k[r], v[r], mask, scale)  # [Sv, K1, Hkv, G, D]
        o = o.at[b.spec_idx.reshape(-1)].set(o_sp.reshape(Sv * K1, *o.shape[1:]), mode="drop")
    return o.reshape(T, Hq, D).astype(q.dtype)


def _attention(attn, x, b: StepBatch, pool, i):
    """The attention mixer of attention layer i (of the model's attention layers) on the packed tokens x [Tb, H]:
    the layer's own projections (`GatedAttention.project`, every token at its own position), K/V scattered into
    its pages of the pool (units 2i and 2i + 1) at `slot_mapping`, the ragged paged attention of
    `paged_attention` over the block tables, the layer's own output gate and projection."""
    q, k, v, gate = (t[0] for t in attn.project(x[None], b.positions))
    C, NB, _ = pool.shape
    Hkv, Dh = k.shape[1:]
    PS = pool.shape[2] // (Hkv * Dh)
    flat = pool.reshape(C, NB * PS, Hkv, Dh)  # free views of the pool: token slots, then pages
    flat = flat.at[2 * i, b.slot_mapping].set(to_pool(k, pool)).at[2 * i + 1, b.slot_mapping].set(to_pool(v, pool))
    pages = flat.reshape(C, NB, PS, Hkv, Dh)
    o = paged_attention(attn.execution.kernels)(q, k, v, pages, 2 * i, b)  # [Tb, Hq, Dh]
    return attn.output(o[None], gate[None], x.dtype)[0], pages.reshape(pool.shape)


def _paged(gdn, pool) -> bool:
    """Whether this GDN layer's decode rows run the paged kernel (states read and written in the pool by index):
    the Pallas kernels on a pool whose units the kernel's 128-lane row view fits (`supports_paged_decode`)."""
    if gdn.execution.kernels != "pallas":
        return False
    return supports_paged_decode(layout_of(gdn.config, pool))


def _blocks_of(b: StepBatch, rows):
    """The state blocks [n, NS] of `rows` [n] (a padding entry, row Sb, at NO_BLOCK: reads zeros, writes dropped)."""
    Sb = b.state_blocks.shape[0]
    return jnp.where((rows < Sb)[:, None], b.state_blocks[jnp.minimum(rows, Sb - 1)], NO_BLOCK)


def _gdn(gdn, x, b: StepBatch, pool, j):
    """The mixer of GDN layer j (of the model's GDN layers) on the packed tokens x [Tb, H]: the layer's own
    projections, gates, heads and output (`GatedDeltaNet.project / gates / heads / output`); what is the step's own
    is reading and writing the rows' states in the pool and running the rules by rows (see the module
    docstring)."""
    Sb = b.state_blocks.shape[0]
    Sp, Lb = b.gather_idx.shape
    Sv, K1 = b.spec_idx.shape
    mixed, z, a, bb = gdn.project(x)  # [Tb, conv_dim], [Tb, Hv, Dv], [Tb, Hv] x 2
    g, beta = gdn.gates(a, bb)
    fresh = b.fresh
    paged = _paged(gdn, pool)

    def fresh_of(rows):  # [n] whether each of `rows` starts from zero (Sb: padding)
        return fresh[jnp.minimum(rows, Sb - 1)]

    def rec_of(rows):  # the recurrent states [n, Hv, Dk, Dv] float32 of `rows` [n] (Sb: padding, reads zeros)
        return jnp.where(fresh_of(rows)[:, None, None, None], 0.0, read_rec(gdn.config, pool, j, _blocks_of(b, rows)))

    def conv_of(rows):  # the conv states [n, C, Kc] of `rows` [n] in the activations' dtype
        return jnp.where(fresh_of(rows)[:, None, None], 0, read_conv(gdn.config, pool, j, _blocks_of(b, rows), x.dtype))

    if paged:  # the kernel reads the decode rows' states itself; the dense rules get only the prefill and verify rows'
        rec0, conv0 = None, None
        s0, c_pf = (rec_of(b.pf_rows), conv_of(b.pf_rows)) if Sp else (None, None)
        sv0, c_sv = (rec_of(b.spec_rows), conv_of(b.spec_rows)) if Sv else (None, None)
        # every read of the pool before the kernel that updates it in place (else XLA would copy the pool)
        c_pf, c_sv, s0, sv0, pool = jax.lax.optimization_barrier((c_pf, c_sv, s0, sv0, pool))
    else:
        conv0 = jnp.where(fresh[:, None, None], 0, read_conv(gdn.config, pool, j, b.state_blocks, x.dtype))
        rec0 = jnp.where(fresh[:, None, None, None], 0.0, read_rec(gdn.config, pool, j, b.state_blocks))
        pf, sv = jnp.minimum(b.pf_rows, Sb - 1), jnp.minimum(b.spec_rows, Sb - 1)
        s0, c_pf = (rec0[pf], conv0[pf]) if Sp else (None, None)
        sv0, c_sv = (rec0[sv], conv0[sv]) if Sv else (None, None)

    if b.verify_only.shape[0]:  # every row verifies drafts: the single-token pass would be discarded
        o = jnp.zeros((x.shape[0], gdn.num_v_heads, gdn.head_v_dim), x.dtype)
    else:
        o, pool = _gdn_rows(gdn, b, pool, j, x.dtype, mixed, a, bb, g, beta, conv0, rec0, c_pf, s0, paged)
    if Sv:  # verify rows: the single-token rule token by token, the state after each kept in its own group
        conv, rec = c_sv, sv0
        outs, convs, recs = [], [], []
        for i in range(K1):
            o_i, conv, rec = _gdn_token(gdn, b.spec_idx[:, i], mixed, a, bb, g, beta, conv, rec)
            outs.append(o_i.astype(x.dtype))
            convs.append(conv)
            recs.append(rec)
        o = o.at[b.spec_idx.reshape(-1)].set(jnp.stack(outs, 1).reshape(Sv * K1, *o.shape[1:]), mode="drop")
        flat = lambda t: jnp.stack(t, 1).reshape(Sv * K1, *t[0].shape[1:])  # noqa: E731
        # one write for every group (after the rows' own write: group 0 is the row's state blocks)
        pool = write_state(gdn.config, pool, j, b.spec_states.reshape(Sv * K1, -1), flat(convs), flat(recs))
    return gdn.output(o, z), pool


def _gdn_token(gdn, idx, mixed, a, bb, g, beta, conv, rec):
    """The single-token rule for the packed tokens `idx` [R] from states conv [R, C, Kc] and rec [R, Hv, Dk, Dv]:
    (o [R, Hv, Dv] float32, new conv, new rec). With `kernels="pallas"`, conv update, gates and the recurrent
    step in one kernel (the state read once and written once)."""
    w = gdn.conv1d.weight[...]
    if gdn.execution.kernels == "pallas":
        return fused_gdn_decode(mixed[idx], a[idx], bb[idx], conv, rec, w, gdn.A_log[...], gdn.dt_bias[...],
                                num_k_heads=gdn.num_k_heads, head_k_dim=gdn.head_k_dim, head_v_dim=gdn.head_v_dim)
    y, conv = causal_conv1d_update(mixed[idx], w, conv)
    q, k, v = gdn.heads(y)
    o, rec = gated_delta_rule_step(q, k, v, g[idx], beta[idx], rec)
    return o, conv, rec


def _gdn_rows(gdn, b: StepBatch, pool, j, dtype, mixed, a, bb, g, beta, conv0, rec0, c_pf, s0, paged: bool):
    """Every row's single-token rule on its last token (exact for decode rows), replaced for the prefill rows by
    the chunked rule over their padded block; the states written to the rows' state blocks: (o [Tb, Hv, Dv],
    pool). conv0, rec0: every row's states; c_pf, s0: the prefill rows'. `paged`: the single-token step (conv
    and rule) is the paged kernel, which reads and writes the rows' conv and recurrent states in the pool itself
    (conv0 and rec0 are None; prefill rows excluded: their states come from the chunked rule)."""
    Sb = b.state_blocks.shape[0]
    Sp, Lb = b.gather_idx.shape
    w = gdn.conv1d.weight[...]
    Kc = w.shape[-1]
    pallas = gdn.execution.kernels == "pallas"
    if paged:
        idx = b.last_idx
        is_pf = jnp.zeros((Sb,), bool).at[b.pf_rows].set(True, mode="drop")
        blocks = jnp.where(is_pf[:, None], NO_BLOCK, b.state_blocks)  # prefill rows: written after, from their chunk
        o_dec, pool = paged_conv_gdn_decode(
            mixed[idx], a[idx], bb[idx], w, gdn.A_log[...], gdn.dt_bias[...], pool, blocks, b.fresh, j,
            layout_of(gdn.config, pool), num_k_heads=gdn.num_k_heads, head_k_dim=gdn.head_k_dim,
            head_v_dim=gdn.head_v_dim)
        conv_new = rec_new = None
    else:
        o_dec, conv_new, rec_new = _gdn_token(gdn, b.last_idx, mixed, a, bb, g, beta, conv0, rec0)
    o = o_dec.astype(dtype)[b.tok_row]  # [Tb, Hv, Dv] (the rules return float32: q is normalised in it)
    if Sp:  # rows with several tokens (prefill chunks): a padded [Sp, Lb] block, padded steps made no-ops
        c0 = c_pf  # padding entries (pf_rows = Sb) read zeros or any row; their writes are dropped
        valid = b.gather_valid
        xb = jnp.where(valid[..., None], mixed[b.gather_idx], 0)  # [Sp, Lb, C]
        hist = jnp.concatenate([jnp.swapaxes(c0, 1, 2), xb], axis=1)  # [Sp, Kc + Lb, C]
        take = jnp.sum(valid, axis=1)[:, None] + jnp.arange(Kc)[None, :]  # the last Kc real inputs
        conv_pf = jnp.swapaxes(jnp.take_along_axis(hist, take[..., None], axis=1), 1, 2)
        gb = jnp.where(valid[..., None], g[b.gather_idx], 0.0)
        betab = jnp.where(valid[..., None], beta[b.gather_idx], 0.0)
        if pallas:  # the conv fused into the chunked kernel (its output never in memory): the Sp rows back to back,
            # Lb tokens each (padding steps are no-ops for the rule; the conv state comes from `take` above)
            flat = lambda t: t.reshape(Sp * Lb, *t.shape[2:])  # noqa: E731
            o_pf, rec_pf, _ = chunked_gdn_conv_packed(
                flat(xb), w, flat(gb), flat(betab), jnp.arange(Sp + 1, dtype=jnp.int32) * Lb,
                num_k_heads=gdn.num_k_heads, head_k_dim=gdn.head_k_dim, conv_state=c0, initial_state=s0,
                use_qk_l2norm=True, chunk_size=max(gdn.chunk_for(), Kc))
            o_pf = o_pf.reshape(Sp, Lb, gdn.num_v_heads, gdn.head_v_dim)
        else:
            yb, _ = causal_conv1d(xb, w, c0)
            qb, kb, vb = gdn.heads(yb)
            o_pf, rec_pf = chunk_gated_delta_rule(qb, kb, vb, gb, betab, chunk_size=gdn.chunk_for(),
                                                  initial_state=s0)
        if paged:  # the prefill rows' states, to their own blocks (padding entries at NO_BLOCK: dropped)
            pool = write_state(gdn.config, pool, j, _blocks_of(b, b.pf_rows), conv_pf, rec_pf)
        else:
            conv_new = conv_new.at[b.pf_rows].set(conv_pf.astype(conv_new.dtype), mode="drop")
            rec_new = rec_new.at[b.pf_rows].set(rec_pf, mode="drop")
        o = jnp.where(b.tok_pf[:, None, None], o_pf.astype(dtype)[b.tok_prow, b.tok_col], o)
    if paged:
        return o, pool
    return o, write_state(gdn.config, pool, j, b.state_blocks, conv_new, rec_new)


def _layer(layer, h, pool, idx, b: StepBatch, routed_fn=None):
    """One decoder layer on the packed tokens h [Tb, H]: the model's own `DecoderLayer` (norms, residuals, MoE),
    its mixer run on the cache pool as layer `idx` of its kind. `routed_fn`: how the MoE sums its routed experts
    (None: the block's own path; on a mesh, the exchange)."""
    h, pool, _ = layer(h[None], pool, None, mix=_pool_mix(layer.layer_type, b, idx), routed_fn=routed_fn)
    return h[0], pool


def _pool_mix(layer_type: str, b: StepBatch, idx):
    """A `DecoderLayer` `mix` that runs its mixer on the packed tokens over the cache pool, as layer `idx` of its
    kind (x [1, Tb, H] -> ([1, Tb, H], pool))."""
    def mix(mixer, x, pool):
        y, pool = _gdn(mixer, x[0], b, pool, idx) if layer_type == LINEAR else _attention(mixer, x[0], b, pool, idx)
        return y[None], pool
    return mix


def layer_indices(layers) -> list[int]:
    """Each layer's index among the layers of its kind (GDN layers 0, 1, 2, ..., attention layers 0, 1, ...)."""
    seen: dict[str, int] = {}
    out = []
    for layer in layers:
        out.append(seen.get(layer.layer_type, 0))
        seen[layer.layer_type] = out[-1] + 1
    return out


class HeadParams(nnx.Module):
    """What the step's head reads: the final norm and the lm_head (or, tied, the embedding) of `model`, shared with
    it. The per-layer runner binds its head program to this, not to the whole model: a jitted call handles every
    parameter array it is passed, used or not (141 arrays for the tiny model, 2 here), and on a CPU that per-step
    host work cost about 3% of a continuous serving run (tiny preset, 128 requests, same tokens)."""

    def __init__(self, model):
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.embed_tokens = model.model.embed_tokens if model.lm_head is None else None


def _head(hp: HeadParams, h, b: StepBatch):
    return output_logits(hp.norm, hp.lm_head, hp.embed_tokens, h[b.last_idx])  # [Sb, V]: each row's last token


def _identity(x):
    return x


def _head_spec(hp: HeadParams, h, b: StepBatch):
    """The head of a speculative step: ((tokens [Sb, K1], counts [Sb], hidden [Tb, H] after the final norm: what
    the MTP head reads), logits [Sb, V] of each row's last token). A row emits tokens[:count]: one sampled token,
    or for a verify row its accepted drafts and one more (`verify_drafts`)."""
    x = hp.norm(h)
    Sb, (Sv, K1) = b.last_idx.shape[0], b.spec_idx.shape
    if b.verify_only.shape[0]:  # every row verifies drafts: no single-token sampling
        out, counts = jnp.zeros((Sb, K1), jnp.int32), jnp.ones(Sb, jnp.int32)
        logits = None
    else:
        logits = output_logits(_identity, hp.lm_head, hp.embed_tokens, x[b.last_idx])
        out, counts = jnp.broadcast_to(_sample(logits, b)[:, None], (Sb, K1)), jnp.ones(Sb, jnp.int32)
    if Sv:
        r = jnp.minimum(b.spec_rows, Sb - 1)
        lg = output_logits(_identity, hp.lm_head, hp.embed_tokens, x[b.spec_idx])  # [Sv, K1, V]
        vt, vn = verify_drafts(lg, b.tokens[b.spec_idx[:, 1:]], b.temperature[r], b.top_k[r], b.top_p[r],
                               b.seeds[r], b.counters[r])
        out, counts = out.at[b.spec_rows].set(vt, mode="drop"), counts.at[b.spec_rows].set(vn, mode="drop")
        if logits is None:  # each verify row's logits at its last token
            logits = jnp.zeros((Sb, lg.shape[-1]), lg.dtype).at[b.spec_rows].set(lg[:, -1], mode="drop")
    return (out, counts, x), logits


class DraftParams(nnx.Module):
    """What the MTP drafter reads: the model's MTP head, embedding and lm_head (shared with it)."""

    def __init__(self, model):
        self.mtp = model.mtp
        self.embed_tokens = model.model.embed_tokens
        self.lm_head = model.lm_head
        self.dtype = model.dtype
        self.index = model.config.num_full_layers  # the MTP attention's pages: pool units 2·index, 2·index + 1


def _draft(dp: DraftParams, pool, b: StepBatch, x, out, counts, k: int, routed_fn=None):
    """k drafts per row [Sb, k] from the MTP head after a step, and the pool with the head's K/V written (traced).

    First pass, over the step's own tokens: at every packed position t, the hidden state x_t (after the final
    norm) and the token after it (`mtp_next`: the next prompt token, or the row's emitted tokens) -> the MTP
    layer's K/V at t (a prefill chunk fills the head's cache as the model's) and, at each row's last committed
    position, the first draft. Then k - 1 single-token passes, each from the previous pass's output state and
    draft at the next position (vLLM's chained MTP drafting). Positions past what the verify step accepts get
    K/V that the next step's first pass overwrites before anything reads them."""
    mtp = dp.mtp
    Sb, K1 = out.shape
    col = jnp.clip(-1 - b.mtp_next, 0, K1 - 1)
    nxt = jnp.where(b.mtp_next >= 0, b.mtp_next, out[b.tok_row, col])

    def run(hidden, ids, batch, pool, step):  # the MTP head's own call, its attention on the pool
        v, pool, _ = mtp(hidden.astype(dp.dtype)[None], dp.embed_tokens(ids, dp.dtype)[None], cache=pool, step=step,
                         routed_fn=routed_fn, mix=_pool_mix(FULL, batch, dp.index))
        return mtp.norm(v[0]), pool

    def guess(hn):
        return jnp.argmax(output_logits(_identity, dp.lm_head, dp.embed_tokens, hn), axis=-1).astype(jnp.int32)

    hm, pool = run(x, nxt, b, pool, 0)
    spec = jnp.zeros(Sb, bool).at[b.spec_rows].set(True, mode="drop")
    sel = jnp.where(spec, b.last_idx - (K1 - counts), b.last_idx)  # each row's last committed position
    h, d = hm[sel], guess(hm[sel])
    drafts = [d]
    if k > 1:
        c = mtp.layers[0].self_attn.config
        PS = pool.shape[-1] // (c.num_key_value_heads * c.head_dim)
        P = b.page_indices.shape[1]
        rows = jnp.arange(Sb, dtype=jnp.int32)
        live = rows < b.num_seqs[0]
        z = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)  # noqa: E731
        chain = b._replace(cu_q_lens=jnp.minimum(jnp.arange(Sb + 1, dtype=jnp.int32), b.num_seqs[0]),
                           gather_idx=z(0, 1), gather_valid=z(0, 1, dtype=bool), pf_rows=z(0), ctx_pages=z(0, 0),
                           tok_row=rows, tok_pf=z(Sb, dtype=bool), tok_prow=z(Sb), tok_col=z(Sb), last_idx=rows,
                           spec_idx=z(0, 1), spec_rows=z(0), mtp_next=z(Sb), verify_only=z(0))
        for j in range(1, k):
            pos = b.positions[sel] + j
            ok = live & (pos // PS < P)
            slot = b.page_indices[rows, jnp.minimum(pos // PS, P - 1)] * PS + pos % PS
            step = chain._replace(tokens=d, positions=pos, slot_mapping=jnp.where(ok, slot, SCRATCH_PAGE * PS),
                                  kv_lens=jnp.where(ok, pos + 1, 0))
            h, pool = run(h, d, step, pool, j)
            d = guess(h)
            drafts.append(d)
    return jnp.stack(drafts, axis=1), pool


def _sample(logits, b: StepBatch):
    return jax.lax.cond(
        jnp.any(b.temperature > 0),
        lambda: sample(logits, b.temperature, b.top_k, b.top_p, b.seeds, b.counters),
        lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32))


def _hidden(model, cache: PagedHybridCache, b: StepBatch, routed_fn=None):
    if routed_fn is None:
        routed_fn = model.routed_fn()
    h = model.model.embed_tokens(b.tokens, model.dtype)  # [Tb, H]
    pool = cache.pool
    for layer, idx in zip(model.model.layers, layer_indices(model.model.layers)):
        h, pool = _layer(layer, h, pool, idx, b, routed_fn)
    return h, PagedHybridCache(pool)


def serving_forward(model, cache: PagedHybridCache, b: StepBatch, routed_fn=None):
    """Logits [Sb, V] float32 of each row's last token and the updated cache (traced code). `routed_fn`: how the
    MoE sums its routed experts (default: the model's `routed_fn()`, the exchange of a placed model)."""
    h, cache = _hidden(model, cache, b, routed_fn)
    return _head(HeadParams(model), h, b), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "return_logits"), donate_argnames=("cache",))
def step_fn(graphdef, params, cache, batch: StepBatch, *, return_logits: bool = False):
    """The fused step, one program: (next tokens [Sb] int32, logits [Sb, V] or None, new cache). The cache is
    donated (updated in place). For a loop, `FusedStep` runs the same program without re-hashing `graphdef`."""
    return _step(nnx.merge(graphdef, params), cache, batch, return_logits)


def _step(model, cache, batch, return_logits, routed_fn=None, speculative=False):
    """(tokens, logits or None, cache): tokens [Sb], or with `speculative` the tuple of `_head_spec`."""
    if speculative:
        h, cache = _hidden(model, cache, batch, routed_fn)
        toks, logits = _head_spec(HeadParams(model), h, batch)
        return toks, (logits if return_logits else None), cache
    logits, cache = serving_forward(model, cache, batch, routed_fn)
    return _sample(logits, batch), (logits if return_logits else None), cache


# ------------------------------------------------------------------------------------------------------------
# Data-parallel ranks on a mesh: every device runs its own sequences' step; the MoE exchanges tokens.
class DataParallel(NamedTuple):
    """Where the engine's step runs: one data-parallel rank per device of `mesh`'s `axes` (the "batch" rule's
    axes: every axis but "model"), each with its own sequences, pages and GDN slots; the experts split over
    `expert_axes` (a subset of `axes`, or none: experts whole on every device).

    Every array of a step (batch, cache, hidden states, sampled tokens) carries a leading [dp] axis split over
    `axes`, so a device holds only its own rank's slice. The step is a `jax.shard_map` over the mesh: inside it,
    attention and the GDN run on the rank's own rows, pages and slots with no communication, and each MoE layer
    all-gathers the tokens and their packed routing metadata over `expert_axes`, sums its local experts and
    reduce-scatters the results back (`qwen35.sharding.moe_ep_local`), or, with the model's exchange "ragged",
    sends exactly the routed rows there and back by a ragged all-to-all."""

    mesh: jax.sharding.Mesh
    axes: tuple
    expert_axes: tuple

    @property
    def size(self) -> int:
        return int(math.prod(self.mesh.shape[a] for a in self.axes))

    def spec(self) -> P:
        return P(self.axes)

    def sharding(self) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, self.spec())

    def routed_fn(self):
        return functools.partial(moe_ep_local, expert_axes=self.expert_axes)


def _leaf_spec(a, dp: DataParallel) -> P:
    s = getattr(a, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding) and s.mesh == dp.mesh:
        return s.spec
    return P()


def _on_ranks(fn, dp: DataParallel | None, specs, shared: int = 0):
    """`fn(leaves, *args)` as run on every rank: without `dp`, `fn` itself; with it, a `shard_map` whose `args` and
    outputs carry the leading [dp] axis (each device sees [1, ...] and `fn` gets it squeezed) and whose parameter
    leaves keep their own placement (`specs`: experts split, the rest replicated). The first `shared` args are the
    same on every rank (a layer's index) and have no [dp] axis."""
    if dp is None:
        return fn
    r = dp.spec()

    def body(leaves, *args):
        out = fn(leaves, *args[:shared], *jax.tree.map(lambda a: a[0], args[shared:]))
        return jax.tree.map(lambda a: a[None], out)

    def run(leaves, *args):
        in_specs = (list(specs),) + (P(),) * shared + (r,) * (len(args) - shared)
        return jax.shard_map(body, mesh=dp.mesh, in_specs=in_specs, out_specs=r, check_vma=False)(leaves, *args)
    return run


# Programs bound to a module's structure by `qwen35.model.bind_program` (why: see there), called with the flat
# parameter arrays taken once, when the engine is built.
def _program(kind: str, module, dp: DataParallel | None = None, routed=None):
    """(jitted program for `kind` closed over `module`'s structure and, on a mesh, its parameters' placement; the
    module's flat parameter arrays). `routed`: the MoE's routed sum when there is no `dp` (a placed model's
    `routed_fn()`: a layer does not know it is part of one)."""
    specs = None if dp is None else tuple(_leaf_spec(a, dp) for a in jax.tree.leaves(nnx.state(module)))
    program, state = bind_program((kind, dp, specs, routed), module,
                                  lambda merge: _BUILDERS[kind](merge, dp, specs, routed))
    return program, jax.tree.leaves(state)


def _build_step(merge, dp, specs, routed):
    routed = None if dp is None else dp.routed_fn()  # else the merged model's own `routed_fn()`

    @functools.partial(jax.jit, static_argnames=("return_logits", "speculative"), donate_argnames=("cache",))
    def run(leaves, cache, batch, *, return_logits, speculative=False):
        def local(leaves, cache, batch):
            return _step(merge(leaves), cache, batch, return_logits, routed, speculative)
        return _on_ranks(local, dp, specs)(leaves, cache, batch)
    return run


def _build_embed(merge, dp, specs, routed):
    @functools.partial(jax.jit, static_argnames=("dtype",))
    def run(leaves, tokens, *, dtype):
        return _on_ranks(lambda leaves, tokens: merge(leaves)(tokens, dtype), dp, specs)(leaves, tokens)
    return run


def _build_layer(merge, dp, specs, routed):
    routed = routed if dp is None else dp.routed_fn()  # the rank's in-step exchange, else the placed model's

    @functools.partial(jax.jit, donate_argnames=("pool",))
    def run(leaves, idx, h, pool, b):
        def local(leaves, idx, h, pool, b):
            return _layer(merge(leaves), h, pool, idx, b, routed)
        return _on_ranks(local, dp, specs, shared=1)(leaves, idx, h, pool, b)
    return run


def _build_head(merge, dp, specs, routed):
    @functools.partial(jax.jit, static_argnames=("return_logits", "speculative"))
    def run(leaves, h, b, *, return_logits, speculative=False):
        def local(leaves, h, b):
            if speculative:
                toks, logits = _head_spec(merge(leaves), h, b)
                return toks, (logits if return_logits else None)
            logits = _head(merge(leaves), h, b)
            return _sample(logits, b), (logits if return_logits else None)
        return _on_ranks(local, dp, specs)(leaves, h, b)
    return run


def _build_draft(merge, dp, specs, routed):
    routed = routed if dp is None else dp.routed_fn()

    @functools.partial(jax.jit, static_argnames=("k",), donate_argnames=("cache",))
    def run(leaves, cache, b, x, out, counts, *, k):
        def local(leaves, cache, b, x, out, counts):
            drafts, pool = _draft(merge(leaves), cache.pool, b, x, out, counts, k, routed)
            return drafts, PagedHybridCache(pool)
        return _on_ranks(local, dp, specs)(leaves, cache, b, x, out, counts)
    return run


_BUILDERS = {"step": _build_step, "embed": _build_embed, "layer": _build_layer, "head": _build_head,
             "draft": _build_draft}


class FusedStep:
    """`step_fn` for a loop: the whole step as one jitted program (best on accelerators), bound to `model` once.
    With `dp`, the program runs every data-parallel rank of the mesh (inputs and outputs with a leading [dp])."""

    def __init__(self, model, dp: DataParallel | None = None):
        self.run, self.leaves = _program("step", model, dp)

    def __call__(self, cache: PagedHybridCache, batch: StepBatch, *, return_logits=False, speculative=False):
        return self.run(self.leaves, cache, batch, return_logits=return_logits, speculative=speculative)


class LayerwiseStep:
    """The same step as `step_fn`, run as one jitted program per layer instead of one for the whole model.

    Layers of one kind share a graph definition and shapes, so the 6 GDN layers of the tiny model compile once,
    the 2 attention layers once: compile time drops by about the number of layers per kind, for one dispatch per
    layer at run time. Each program gets only the batch fields it reads (`batch_view`), so it compiles once per
    shape of those. The engine uses it on CPU, where compiling dominates short runs; `FusedStep` elsewhere.
    With `dp`, each program runs every data-parallel rank of the mesh, as `FusedStep`'s does.
    """

    def __init__(self, model, dp: DataParallel | None = None):
        self.dtype = model.dtype
        self.embed = _program("embed", model.model.embed_tokens, dp)
        routed = model.routed_fn() if dp is None else None  # with dp, the MoE's exchange is the rank's own
        self.layers = [_program("layer", layer, dp, routed) for layer in model.model.layers]
        self.indices = [np.int32(i) for i in layer_indices(model.model.layers)]  # traced: one program a kind
        self.reads = ["gdn" if layer.layer_type == LINEAR else "attention" for layer in model.model.layers]
        self.head = _program("head", HeadParams(model), dp)  # the final norm and lm_head only

    def __call__(self, cache: PagedHybridCache, batch: StepBatch, *, return_logits=False, speculative=False):
        embed, leaves = self.embed
        h = embed(leaves, batch.tokens, dtype=self.dtype)
        pool = cache.pool
        views = {reads: batch_view(batch, reads) for reads in BATCH_FIELDS}
        for (layer, leaves), idx, reads in zip(self.layers, self.indices, self.reads):
            h, pool = layer(leaves, idx, h, pool, views[reads])
        head, leaves = self.head
        toks, logits = head(leaves, h, views["head"], return_logits=return_logits, speculative=speculative)
        return toks, logits, PagedHybridCache(pool)


class DraftStep:
    """The MTP drafter after a speculative step (`_draft`), one jitted program bound to `model`'s MTP head; with
    `dp`, it runs every data-parallel rank as the step does."""

    def __init__(self, model, dp: DataParallel | None = None):
        self.run, self.leaves = _program("draft", DraftParams(model), dp, model.routed_fn() if dp is None else None)

    def __call__(self, cache: PagedHybridCache, batch: StepBatch, hidden, out, counts, *, k: int):
        return self.run(self.leaves, cache, batch, hidden, out, counts, k=k)
