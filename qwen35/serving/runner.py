"""The jitted serving step: one forward over the packed tokens of a scheduler step, reading and writing the paged
hybrid cache, then one sampled token per sequence.

A step packs the tokens of every scheduled sequence back to back — prefill chunks and single decode tokens
together — into `tokens [Tb]`, and runs the model's own modules on them: `DecoderLayer` (norms, residuals, the
MoE), each mixer's own projections and output (`GatedAttention.project / output`, `GatedDeltaNet.project / gates
/ heads / output`) and the model's head (`output_logits`). Where the state lives is each mixer's paged call,
`GatedAttention.paged` and `GatedDeltaNet.paged` (given the pool and the step's packed batch); this module packs
the batch, picks the programs and jits them:

  attention mixer:  K/V scattered into the layer's pages of the pool at `slot_mapping` (every token at its own
                    position), then ragged paged attention over the block tables (the Pallas kernel of
                    `qwen35.kernels` when `execution.kernels == "pallas"`, else `attention._paged_attention_rows`:
                    the reference's result, computed by rows as the GDN mixer below is; a prefill chunk attends to its own fresh K/V plus, only if it
                    continues a sequence, the context pages before it)
  GDN mixer:        the rows' states read from their state blocks in the pool (`qwen35.pool.read_state`: only this
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
the scratch page and padding rows' states go nowhere (`NO_BLOCK`, see `qwen35.pool` and `cache.py`).

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

from qwen35.config import LINEAR
from qwen35.model import bind_program, output_logits
from qwen35.pool import NO_BLOCK, SCRATCH_PAGE
from qwen35.serving.cache import PagedHybridCache
from qwen35.serving.sampling import sample, verify_drafts
from qwen35.sharding import moe_ep_local

__all__ = ["StepBatch", "padding_batch", "DataParallel", "serving_forward", "step_fn", "FusedStep",
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






def _layer(layer, h, pool, idx, b: StepBatch, routed_fn=None):
    """One decoder layer on the packed tokens h [Tb, H]: the model's own `DecoderLayer` (norms, residuals, MoE),
    its mixer run on the cache pool as layer `idx` of its kind. `routed_fn`: how the MoE sums its routed experts
    (None: the block's own path; on a mesh, the exchange)."""
    h, pool, _ = layer(h[None], pool, None, mix=_pool_mix(b, idx), routed_fn=routed_fn)
    return h[0], pool


def _pool_mix(b: StepBatch, idx):
    """A `DecoderLayer` `mix` that runs its mixer's paged call (`GatedAttention.paged`, `GatedDeltaNet.paged`) on the
    packed tokens over the cache pool, as layer `idx` of its kind (x [1, Tb, H] -> ([1, Tb, H], pool))."""
    def mix(mixer, x, pool):
        y, pool = mixer.paged(x[0], pool, idx, b)
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
                         routed_fn=routed_fn, mix=_pool_mix(batch, dp.index))
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
