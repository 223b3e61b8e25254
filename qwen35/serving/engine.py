"""The serving engine: requests in, tokens out, with continuous batching over a paged hybrid cache.

    from qwen35.serving import Engine, SamplingParams
    engine = Engine(model, max_num_seqs=64, max_num_batched_tokens=1024, block_size=256, num_blocks=None)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))  # token-id lists or strings
    for event in engine.stream(prompt, params): ...                                   # incremental tokens
    rid = engine.add_request(prompt, params); events = engine.step()                  # drive the loop yourself

Each `step()` asks the scheduler for the next batch (`scheduler.py`), packs it into bucketed arrays (`StepBatch`),
runs the jitted step (`runner.py`) and appends the sampled tokens. On a mesh (`Engine(model, mesh=...)`, or a
model from `qwen35.sharding.shard_model`) every device is a data-parallel rank with its own scheduler and pool of
cache blocks; a step stacks every rank's batch into one [dp, ...] array and runs one program over the mesh
(`runner.DataParallel`). A bad request (empty, too long, ids outside
the vocabulary, max_tokens < 1) raises `ValueError` from `add_request` and never reaches the batch; `generate`
turns that into an `error` on that request's output while the others run.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import numpy as np

from qwen35.pool import pool_layout
from qwen35.serving.cache import BlockAllocator, init_paged_cache, pool_blocks
from qwen35.serving.runner import DataParallel, DraftStep, FusedStep, LayerwiseStep, StepBatch, padding_batch
from qwen35.serving.sampling import SamplingParams
from qwen35.serving.scheduler import FINISHED, Request, Scheduler

__all__ = ["Engine", "RequestOutput", "StepEvent", "ByteTokenizer", "Rank", "data_parallel"]


@dataclasses.dataclass
class RequestOutput:
    request_id: object
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "error"
    error: str | None = None
    text: str | None = None
    num_preemptions: int = 0


@dataclasses.dataclass
class StepEvent:
    request_id: object
    token_ids: list[int]  # the new token(s) of this step
    finished: bool
    finish_reason: str | None = None


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: lets string prompts reach a model without a real tokenizer (the tiny preset)."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class StepShape(NamedTuple):
    """A step's bucketed sizes (see `Engine.step_shape` and `StepBatch`)."""

    Sb: int  # rows
    P: int   # pages per row
    Tb: int  # tokens
    Sp: int  # prefill rows
    Lb: int  # prefill block length
    Pc: int  # context pages per prefill row
    Sv: int = 0  # verify rows (speculative decoding)
    verify_only: bool = False  # every row verifies drafts


# A step has at least 2 rows (a padding row when one sequence runs). With one row, the pool writes are scatters
# of a single index, which XLA rewrites into a bounds-checked dynamic-update-slice; on CPU that loses the in-place
# update and copies the whole pool in every layer program (a test checks the compiled step has no pool-sized
# copy). A padding row costs one token through the model.
MIN_ROWS = 2


def _pow2(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _page_width(n: int) -> int:
    """Pages per row for a longest block table of n pages: a power of two up to 8, then a multiple of 8. Attention
    reads every page of the width, so the rounding is work: 36 pages (9K tokens in 256-token pages) read 40, not
    64, for a few more compiled shapes over a long run (1, 2, 4, 8, 16, 24, 32, 40 on the way to 9K)."""
    return _pow2(n, 1) if n <= 8 else -(-n // 8) * 8


def _verifies(row) -> bool:
    """Whether a scheduled (request, tokens) row verifies drafts: more tokens than the request has uncomputed."""
    req, n = row
    return n > req.num_tokens - req.num_computed


def _pow4(n: int, lo: int) -> int:
    b = lo
    while b < n:
        b *= 4
    return b


def _block_len(n: int) -> int:
    """The prefill block length Lb for a longest chunk of n tokens: 16, 32, 64, then 256, 1024, ...

    Short prompts get blocks of their own size: the chunked rule and the block's causal attention cost per padded
    position, and a mixed step's prefill block is most of what it adds to a decode step (`python
    benchmarks/serving.py` measures continuous batching with it). Past 64, steps of 4 keep the number of compiled
    programs down."""
    return 16 if n <= 16 else 32 if n <= 32 else _pow4(n, 64)


class Rank:
    """One data-parallel rank's host state: its pool's blocks (KV pages and GDN states) and scheduler, and the
    tokens in flight on it (prompt + max_tokens of its unfinished requests: what a new request's placement
    balances)."""

    def __init__(self, max_num_seqs, max_num_batched_tokens, num_blocks, block_size, state_blocks, chunked,
                 lookahead=0):
        self.blocks = BlockAllocator(num_blocks, block_size, state_blocks)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, self.blocks, chunked, lookahead)
        self.load = 0

    def add(self, req: Request) -> None:
        self.load += req.load
        self.scheduler.add(req)

    def finish(self, req: Request, reason: str) -> None:
        self.load -= req.load
        self.scheduler.finish(req, reason)


def data_parallel(model, mesh=None):
    """(model placed for serving, `DataParallel` or None): how `Engine` runs `model` on `mesh` (default: the mesh
    of a model from `shard_model`; None and an unsharded model: one device, no mesh).

    The engine's step is data-parallel over the mesh's "batch" axes. Refused, with the fix: a mesh axis that
    splits something else (tensor parallelism: a "model" axis of size > 1), a model sharded on another mesh, and
    the capacity-based all-to-all exchange (it drops tokens; the engine exchanges exactly: by all-gather, or by
    the ragged all-to-all of a model whose execution says exchange="ragged")."""
    from qwen35 import sharding as S

    execution = model.execution
    own = execution.mesh
    if mesh is None:
        mesh = own
    if mesh is None:
        return model, None
    if own is not None and own != mesh:
        raise S.ShardingError(f"the model is sharded on mesh {dict(own.shape)} but the engine was given mesh "
                              f"{dict(mesh.shape)}; pass the model's own mesh (or none)")
    rules = S.LOGICAL_RULES if execution.rules is None else execution.rules
    axes = S.mesh_axes_for("batch", mesh, rules)
    other = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
    if other:
        raise S.ShardingError(f"the engine serves attention data-parallel (every mesh axis splits whole sequences), "
                              f"but mesh axes {other} of {dict(mesh.shape)} split something else (tensor "
                              f"parallelism); use make_mesh(expert=n) or make_mesh(data=d, expert=e)")
    expert_axes = S.mesh_axes_for("experts", mesh, rules)
    if execution.exchange == "alltoall":
        raise S.ShardingError("the engine exchanges tokens exactly (all-gather / reduce-scatter, or the dropless "
                              "ragged all-to-all); a model whose execution says exchange='alltoall' drops tokens "
                              "past capacity. Build it with Execution(exchange='allgather') (or 'ragged')")
    if own is None:  # (with no expert axis, e.g. make_mesh(data=8), every device holds the whole model)
        model = S.shard_model(model, mesh, rules=rules)
    return model, DataParallel(mesh, tuple(axes), tuple(expert_axes))


class Engine:
    """Continuous-batching engine over `model` (a `Qwen35ForCausalLM`, sharded or not).

    max_num_seqs: sequences running at once.
    max_num_batched_tokens: tokens per step (prefill chunks + decode tokens).
    block_size: tokens per KV page. num_blocks: blocks of the cache pool, each one page of every attention layer
      or a piece of a GDN state (`qwen35.serving.cache`; default: enough for max_num_seqs full-length sequences
      and their states, plus one scratch block). max_model_len: longest sequence (prompt + output), default
      min(max_position_embeddings, 4096).
    enable_chunked_prefill: split long prompts across steps (mixed with decodes) instead of prefilling whole.
    tokenizer: anything with encode/decode for string prompts (default: `ByteTokenizer` if the vocab has >= 256).
    fused: one jitted program per step (default off CPU) or one per layer (`LayerwiseStep`, default on CPU).
    min_batch_rows: a step's rows are its scheduled sequences rounded up to a power of two, at least this (a
      floor of 32 lets engines of different concurrency share compiled programs, as the tests do; the default 1
      pads least; a step has at least `MIN_ROWS` = 2 rows in any case). A speculative step's verify rows have
      the same floor.
    min_page_width: a step's page-table width is its longest block table's, at least this many pages (a floor at
      max_model_len / block_size gives every step of a run one width: fewer compiles, more keys read).
    mesh: serve on a device mesh with attention data-parallel (default: the mesh of a model from
      `qwen35.sharding.shard_model` / `load_sharded`, else one device). Every device on the mesh's "batch" axes
      (all of `make_mesh(expert=8)`'s 8, or `make_mesh(data=2, expert=4)`'s) is a data-parallel rank with its own
      scheduler, block allocator and share of the cache pool; the experts stay split as the model's
      rules place them (an unsharded model is sharded with `shard_model`, or replicated on a mesh with no expert
      axis). max_num_seqs, max_num_batched_tokens and num_blocks are then *per rank* (as for vLLM's data-parallel
      engines): `Engine(smodel, max_num_seqs=64)` on 8 devices serves 512 sequences. A new request goes to the rank
      with the fewest tokens in flight (prompt + max_tokens of its unfinished requests), or to `dp_rank`.
    """

    def __init__(self, model, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, block_size: int = 256,
                 num_blocks: int | None = None, *, max_model_len: int | None = None,
                 enable_chunked_prefill: bool = True, tokenizer=None, cache_dtype=None, record_history: bool = True,
                 fused: bool | None = None, min_batch_rows: int = 1, min_page_width: int = 1, mesh=None,
                 speculative_tokens: int = 0):
        c = model.config
        k = speculative_tokens
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
            raise ValueError(f"speculative_tokens must be an integer >= 0 (0: no speculative decoding), got {k!r}")
        if k and getattr(model, "mtp", None) is None:
            raise ValueError(f"speculative_tokens={k} drafts with the model's multi-token-prediction head, but this "
                             f"model has none: build it with Qwen35ForCausalLM(config, mtp=True), or load it with "
                             f"load_hf_checkpoint(..., mtp=True) / qwen35.load_trained(mtp=True)")
        self.speculative_tokens = k = int(k)
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got {max_num_seqs}, "
                             f"{max_num_batched_tokens}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}) so every running sequence can decode in one step")
        self.max_model_len = int(max_model_len or min(c.max_position_embeddings, 4096))
        if self.max_model_len > c.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds max_position_embeddings "
                             f"{c.max_position_embeddings}")
        model, self.dp = data_parallel(model, mesh)
        self.model, self.config = model, c
        self.max_num_seqs, self.max_num_batched_tokens, self.block_size = max_num_seqs, max_num_batched_tokens, block_size
        cache_dtype = cache_dtype or model.dtype
        # Speculative decoding (see `step`): the MTP head's attention gets pages in the pool after the model's, a
        # sequence keeps its GDN state after each of a verify step's k + 1 tokens (k + 1 groups of state blocks),
        # and its K/V may run 2k positions past its committed tokens (the verified drafts, then the next drafts).
        self.layout = pool_layout(c, block_size, cache_dtype, attention_layers=c.num_full_layers + (
            c.mtp_num_hidden_layers if k else 0))
        self.state_blocks = self.layout.state_blocks * (k + 1)  # per sequence
        self.lookahead = 2 * k  # positions past max_model_len a sequence may write
        span = self.max_model_len + self.lookahead
        if num_blocks is None:
            num_blocks = pool_blocks(self.layout, max_num_seqs, span, state_groups=k + 1)
        if num_blocks < self.state_blocks + 2:
            raise ValueError(f"num_blocks={num_blocks} cannot hold one sequence: its GDN state takes "
                             f"{self.state_blocks} blocks, plus a page and the scratch block; raise num_blocks")
        self.num_blocks = num_blocks
        self.chunked = enable_chunked_prefill
        self.ranks = [Rank(max_num_seqs, max_num_batched_tokens, num_blocks, block_size, self.state_blocks,
                           enable_chunked_prefill, max(0, k - 1)) for _ in range(self.num_ranks)]
        self.min_batch_rows, self.min_page_width = min_batch_rows, min_page_width
        self.seq_bucket = _pow2(max_num_seqs, max(min_batch_rows, MIN_ROWS))  # the most rows a step can have
        self.token_bucket = _pow2(max_num_batched_tokens, 16)
        self.page_bucket = _page_width(math.ceil(span / block_size))
        self.tokenizer = tokenizer if tokenizer is not None else (ByteTokenizer() if c.vocab_size >= 256 else None)
        # One program for the whole step (best on accelerators), or one per layer (on CPU, where compiling
        # dominates: layers of one kind share one program).
        self.fused = (jax.default_backend() != "cpu") if fused is None else fused
        self._run = FusedStep(model, self.dp) if self.fused else LayerwiseStep(model, self.dp)
        self._draft = DraftStep(model, self.dp) if k else None
        self.cache = init_paged_cache(c, num_blocks, block_size, cache_dtype,
                                      ranks=None if self.dp is None else self.dp.size,
                                      sharding=None if self.dp is None else self.dp.sharding(),
                                      attention_layers=self.layout.attention_layers)
        self.num_drafted = self.num_accepted = 0  # drafts verified, and kept
        self.accepted_hist = np.zeros(k + 1, np.int64)  # verify rows by the number of drafts they kept
        self.kernels = model.execution.kernels
        self.requests: dict[object, Request] = {}
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self.record_history = record_history
        self.history: list[dict] = []
        self.num_steps = 0
        self.last_logits = None
        self.keep_logits = False

    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks: the devices of the mesh's "batch" axes (1 without a mesh)."""
        return 1 if self.dp is None else self.dp.size

    # Rank 0's allocators and scheduler (the only ones without a mesh); `ranks` holds every rank's.
    @property
    def blocks(self) -> BlockAllocator:
        return self.ranks[0].blocks

    @property
    def scheduler(self) -> Scheduler:
        return self.ranks[0].scheduler

    @property
    def num_preemptions(self) -> int:
        return sum(r.scheduler.num_preemptions for r in self.ranks)

    # -- requests --------------------------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompt but the engine has no tokenizer; pass token ids or "
                                 "Engine(..., tokenizer=...)")
            enc = self.tokenizer.encode(prompt)
            return [int(t) for t in getattr(enc, "ids", enc)]  # `tokenizers` returns an Encoding
        ids = np.asarray(prompt)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"a prompt must be a string or a flat list of token ids, got shape {ids.shape} "
                             f"dtype {ids.dtype}")
        return [int(t) for t in ids]

    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None, *,
                    dp_rank: int | None = None) -> object:
        """Queue a request; returns its id. Raises ValueError (naming the problem) for a bad one. On a mesh the
        request runs on `dp_rank` (default: the rank with the fewest tokens in flight)."""
        if dp_rank is not None and not (isinstance(dp_rank, (int, np.integer)) and 0 <= dp_rank < self.num_ranks):
            raise ValueError(f"dp_rank must be an int in [0, {self.num_ranks}) (the engine's data-parallel ranks), "
                             f"got {dp_rank!r}")
        params = (params or SamplingParams()).validate(self.config.vocab_size)
        ids = self._encode(prompt)
        V, L = self.config.vocab_size, self.max_model_len
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {V}): {bad[:5]}")
        if len(ids) >= L:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len {L} (it needs room for at "
                             f"least one output token); shorten it or build the Engine with a larger max_model_len")
        need = min(len(ids) + params.max_tokens, L) + self.lookahead
        room = (self.num_blocks - 1 - self.state_blocks) * self.block_size
        if need > room:
            extra = f" (+ {self.lookahead} positions for the drafts)" if self.lookahead else ""
            raise ValueError(f"prompt + max_tokens{extra} = {need} tokens exceed the whole cache pool ({room} tokens "
                             f"of KV beside the sequence's GDN state); lower max_tokens or raise num_blocks")
        if not self.chunked and len(ids) > self.max_num_batched_tokens:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_num_batched_tokens "
                             f"{self.max_num_batched_tokens} with chunked prefill off; enable it or raise the budget")
        rid = request_id if request_id is not None else next(self._ids)
        if rid in self.requests and self.requests[rid].status != FINISHED:
            raise ValueError(f"request id {rid!r} is already in flight")
        req = Request(rid, ids, params, next(self._arrival))
        req.load = len(ids) + params.max_tokens
        if dp_rank is None:
            dp_rank = min(range(self.num_ranks), key=lambda r: self.ranks[r].load)  # least loaded, lowest first
        req.rank = int(dp_rank)
        self.requests[rid] = req
        self.ranks[req.rank].add(req)
        return rid

    def has_unfinished(self) -> bool:
        return any(r.scheduler.has_unfinished() for r in self.ranks)

    # -- one step ----------------------------------------------------------------------------------------------
    def step_shape(self, sched: list[tuple[Request, int]]) -> StepShape:
        """The bucketed sizes of a scheduled step (see `StepBatch`), each a power of two or so: few shapes, few
        compiles, and every size follows the step's own work, not the engine's limits.

          Sb  rows: the scheduled sequences, at least `min_batch_rows` and `MIN_ROWS`, at most max_num_seqs (rounded
              up);
          P   pages per row: on the XLA path, which reads every page of the table, the longest block table of
              the step (so a decode at context 100 reads 128 keys per row, not max_model_len's), rounded by
              `_page_width`; with `kernels="pallas"` max_model_len's (the ragged paged attention kernel reads
              only each sequence's own pages, so one width means fewer programs to compile at no cost);
          Tb  tokens: Sb in a decode-only step, else Sb, 2 Sb, 4 Sb, ... (at most the budget), or Sb + Sp·Lb when
              that is fewer: without verify rows, a row that does not prefill has one token, so Sb + Sp·Lb holds
              them all (it takes a power of two's place: no more shapes);
          Sp  prefill rows in 1, 4, 16, ... and Lb their block length in 16, 32, 64, 256, 1024, ... (`_block_len`);
          Pc  pages of each prefill chunk's context (its tokens before this step), bucketed like P; none in the
              common case of prompts prefilled in one step, whose attention then reads only the chunk's own K/V.
        Padding costs: every padded token runs through every layer, so a step that adds one short prompt to the
        decodes (the common mixed step) stays at Tb <= Sb + Lb and Sp = 1."""
        bs = self.block_size
        q_lens = [n for _, n in sched]
        Sb = min(_pow2(len(sched), max(self.min_batch_rows, MIN_ROWS)), self.seq_bucket)
        if self.kernels == "pallas":  # the kernel reads only each sequence's own pages: a wide table costs nothing
            P = self.page_bucket
        else:  # the XLA path reads every page of the table (and the MTP drafts' pages past the step's tokens)
            ahead = self.ranks[0].scheduler.lookahead
            longest = max((-(-(r.num_computed + n + ahead) // bs) for r, n in sched), default=1)
            P = min(_page_width(max(longest, self.min_page_width)), self.page_bucket)
        nv = sum(map(_verifies, sched))
        pf = [s for s, rn in enumerate(sched) if rn[1] > 1 and not _verifies(rn)]
        Sv = min(_pow2(nv, self.min_batch_rows), Sb) if nv else 0  # verify rows share min_batch_rows' floor
        if not pf:
            return StepShape(Sb, P, min(_pow2(sum(q_lens), Sb), self.token_bucket) if nv else Sb, 0, 1, 0, Sv,
                             nv == len(sched) > 0)
        Sp = min(_pow4(len(pf), 1), Sb)
        Lb = min(_block_len(max(q_lens[s] for s in pf)), self.token_bucket)
        Tb = min(_pow2(sum(q_lens), Sb), self.token_bucket)
        if not nv:  # one 50-token prompt beside 15 decodes: 80 tokens, not 128 (a padded token costs every layer)
            Tb = min(Tb, Sb + Sp * Lb)
        ctx = max(-(-sched[s][0].num_computed // bs) for s in pf)
        Pc = min(_page_width(ctx), P) if ctx else 0
        return StepShape(Sb, P, Tb, Sp, Lb, self._whole_table(Pc, Lb, P), Sv)

    def _whole_table(self, Pc: int, Lb: int, P: int) -> int:
        """Pc, or P when context + chunk keys would reach the whole block table anyway (then read the table)."""
        return P if Pc and (Pc * self.block_size + Lb) >= P * self.block_size else Pc

    def build_batch(self, sched: list[tuple[Request, int]], rank: int = 0, shape: StepShape | None = None
                    ) -> StepBatch:
        """The padded arrays of one scheduled step of `rank` (what `step` hands the jitted program), at the sizes
        `shape` (default: `step_shape(sched)`; on a mesh, the largest over the ranks, so every rank's arrays stack
        into one [dp, ...] batch)."""
        bs = self.block_size
        blocks = self.ranks[rank].blocks
        q_lens = [n for _, n in sched]
        S, T = len(sched), sum(q_lens)
        verify = [s for s, rn in enumerate(sched) if _verifies(rn)]
        pf = [s for s, rn in enumerate(sched) if rn[1] > 1 and not _verifies(rn)]
        Sb, P, Tb, Sp, Lb, Pc, Sv, verify_only = self.step_shape(sched) if shape is None else shape
        NS, K1 = self.layout.state_blocks, self.speculative_tokens + 1
        # Per row, Python gathers only scalars and token lists; the per-token arrays are then built by numpy in
        # one pass (a step is on the critical path: at 16 rows a per-row numpy loop cost ~10% of a CPU decode step).
        b = padding_batch(Sb, P, Tb, Sp, Lb, Pc, state_blocks=NS, page_size=bs, Sv=Sv, K1=K1,
                          verify_only=verify_only)  # filled below
        ns = np.asarray(q_lens, np.int64)
        starts = np.fromiter((r.num_computed for r, _ in sched), np.int64, S)
        offs = np.zeros(S + 1, np.int64)
        np.cumsum(ns, out=offs[1:])
        toks: list[int] = []
        pages = b.page_indices
        for s, (req, n) in enumerate(sched):
            st = req.num_computed
            if n == 1 and st >= len(req.prompt):  # a decode: the last sampled token
                toks.append(req.output[st - len(req.prompt)])
            elif n > req.num_tokens - st:  # a verify row: the last sampled token and the drafts
                toks.append(req.output[st - len(req.prompt)])
                toks.extend(req.drafts)
            else:
                toks.extend(req.tokens(st, st + n))
            table = blocks.tables[id(req)]
            pages[s, :len(table)] = table
        b.tokens[:T] = toks
        row = np.repeat(np.arange(S), ns)  # [T] row of each real token
        col = np.arange(T) - offs[row]
        pos = starts[row] + col
        b.tok_row[:T] = row
        b.tok_col[:T] = col
        b.positions[:T] = pos
        b.slot_mapping[:T] = pages[row, pos // bs] * bs + pos % bs
        b.cu_q_lens[:S + 1] = offs
        b.cu_q_lens[S + 1:] = T
        b.kv_lens[:S] = starts + ns
        b.num_seqs[0] = S
        b.last_idx[:S] = offs[1:] - 1
        if S and NS:  # (group 0 of a speculative engine's k + 1 groups: the state after the committed tokens)
            b.state_blocks[:S] = [blocks.states[id(r)][:NS] for r, _ in sched]
        for v, s in enumerate(verify):
            b.spec_idx[v] = offs[s] + np.arange(K1)
            b.spec_rows[v] = s
            b.spec_states[v] = np.reshape(blocks.states[id(sched[s][0])], (K1, NS))
        if self.speculative_tokens and T:  # the token after each packed token, for the MTP head (see StepBatch)
            nxt = b.mtp_next
            nxt[:T - 1] = b.tokens[1:T]
            for s, (req, n) in enumerate(sched):
                end = starts[s] + n
                nxt[offs[s + 1] - 1] = -1 if end >= req.num_tokens else req.tokens(end, end + 1)[0]
            for s in verify:
                nxt[offs[s]:offs[s + 1]] = -1 - np.arange(K1)
        b.fresh[:S] = starts == 0
        for j, s in enumerate(pf):
            a, n = offs[s], q_lens[s]
            b.gather_idx[j, :n] = np.arange(a, a + n)
            b.gather_valid[j, :n] = True
            b.pf_rows[j] = s
            b.tok_pf[a:a + n] = True
            b.tok_prow[a:a + n] = j
        if any(r.params.temperature > 0 for r, _ in sched):  # greedy rows need none of these
            for s, (req, _) in enumerate(sched):
                p = req.params
                b.temperature[s], b.top_k[s], b.top_p[s] = p.temperature, p.top_k, p.top_p
                b.seeds[s], b.counters[s] = np.uint32(p.seed % 2**32), len(req.output)
        # the context pages of each prefill entry (padding entries read any row: masked out)
        return b._replace(ctx_pages=pages[pf + [Sb - 1] * (Sp - len(pf)), :Pc])

    def _batch(self, scheds: list[list[tuple[Request, int]]]) -> StepBatch:
        """One step's batch: a rank's own arrays, or on a mesh every rank's stacked [dp, ...] at common sizes and
        placed on its device (a rank with nothing to run gets a batch of padding)."""
        if self.dp is None:
            return self.build_batch(scheds[0])
        shapes = [self.step_shape(s) for s in scheds if s]
        Sb, P, Tb, Sp, Lb, Pc, Sv, _ = (max(x) for x in zip(*shapes))
        shape = StepShape(Sb, P, Tb, Sp, Lb, self._whole_table(Pc, Lb, P), Sv, all(x.verify_only for x in shapes))
        per_rank = [self.build_batch(s, r, shape) for r, s in enumerate(scheds)]
        return jax.device_put(StepBatch(*(np.stack(f) for f in zip(*per_rank))), self.dp.sharding())

    def step(self) -> list[StepEvent]:
        """Run one scheduler step (every rank's, on a mesh); returns an event for every request that got a token
        (or finished)."""
        t0 = time.perf_counter()
        scheds = [r.scheduler.schedule() for r in self.ranks]
        if not any(scheds):
            if self.has_unfinished():  # cannot happen while admission checks hold; never spin silently
                raise RuntimeError("the scheduler could not run any request: a queued request does not fit the cache")
            return []
        batch = self._batch(scheds)
        k, R = self.speculative_tokens, self.num_ranks
        toks, logits, self.cache = self._run(self.cache, batch, return_logits=self.keep_logits,
                                             speculative=bool(k))
        if k:  # the MTP head drafts the next step's guesses from this step's hidden states and emitted tokens
            out, counts, hidden = toks
            drafts, self.cache = self._draft(self.cache, batch, hidden, out, counts, k=k)
            out = np.asarray(out).reshape(R, -1, k + 1)
            counts, drafts = np.asarray(counts).reshape(R, -1), np.asarray(drafts).reshape(R, -1, k)
        else:
            out = np.asarray(toks).reshape(R, -1, 1)
        if self.keep_logits:
            logits = np.asarray(logits).reshape(self.num_ranks, *logits.shape[-2:])
            self.last_logits = {r.request_id: logits[q, s] for q, sched in enumerate(scheds)
                                for s, (r, n) in enumerate(sched) if r.num_computed + n == r.num_tokens}
        events = []
        kinds = []
        for q, sched in enumerate(scheds):
            rank = self.ranks[q]
            for s, (req, n) in enumerate(sched):
                verify = _verifies((req, n))
                kinds.append("verify" if verify else "decode" if n == 1 and req.num_computed >= len(req.prompt)
                             else "prefill")
                count = int(counts[q, s]) if verify else 1
                req.num_computed += count if verify else n  # a verify row commits its accepted drafts only
                if req.num_computed < req.num_tokens:  # a prefill chunk that did not reach the end: nothing sampled
                    continue
                if verify:
                    self.num_drafted += n - 1
                    self.num_accepted += count - 1
                    self.accepted_hist[count - 1] += 1
                new, reason = [], None
                for tok in out[q, s, :count].tolist():
                    req.output.append(tok)
                    new.append(tok)
                    if tok in req.params.stop_token_ids:
                        reason = "stop"
                    elif len(req.output) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                        reason = "length"
                    if reason:
                        break
                if reason:
                    rank.finish(req, reason)
                elif k:
                    if count > 1:  # the state after the last accepted token is group count - 1: make it group 0
                        st, NS = rank.blocks.states[id(req)], self.layout.state_blocks
                        a = (count - 1) * NS
                        st[:NS], st[a:a + NS] = st[a:a + NS], st[:NS]
                    req.drafts = drafts[q, s].tolist()
                events.append(StepEvent(req.request_id, new, reason is not None, reason))
        self.num_steps += 1
        if self.record_history:
            flat = [(q, r, n) for q, sched in enumerate(scheds) for r, n in sched]
            self.history.append({
                "step": self.num_steps, "seconds": time.perf_counter() - t0,
                "rows": [(r.request_id, n, kind) for (_, r, n), kind in zip(flat, kinds)],
                "row_ranks": [q for q, _, _ in flat],
                "tokens": sum(n for _, _, n in flat), "padded_tokens": int(np.prod(batch.tokens.shape)),
                "free_pages": sum(r.blocks.num_free for r in self.ranks),
                "free_pages_per_rank": [r.blocks.num_free for r in self.ranks],
                "preemptions": self.num_preemptions})
        return events

    # -- convenience loops -----------------------------------------------------------------------------------
    def _output(self, req: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None and not isinstance(self.tokenizer, ByteTokenizer):
            text = self.tokenizer.decode(req.output)
        return RequestOutput(req.request_id, list(req.prompt), list(req.output), req.finish_reason, text=text,
                             num_preemptions=req.num_preemptions)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 progress: bool = False) -> list[RequestOutput]:
        """Run `prompts` (strings or token-id lists) to completion; outputs in the prompts' order. A bad prompt gets
        finish_reason "error" and the message in `error`; the rest run normally."""
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        slots: list[object] = []
        for prompt, p in zip(prompts, plist):
            try:
                slots.append(("ok", self.add_request(prompt, p)))
            except ValueError as e:
                slots.append(("error", str(e)))
        bar = None
        if progress:
            from tqdm.auto import tqdm

            total = sum(self.requests[r].params.max_tokens for k, r in slots if k == "ok")
            bar = tqdm(total=total, desc="generate", unit="tok")
        while self.has_unfinished():
            events = self.step()
            if bar is not None:
                bar.update(sum(len(e.token_ids) for e in events))
        if bar is not None:
            bar.close()
        outs = []
        for kind, v in slots:
            if kind == "error":
                outs.append(RequestOutput(None, [], [], "error", error=v))
            else:
                outs.append(self._output(self.requests.pop(v)))
        return outs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[StepEvent]:
        """Yield this request's tokens as they come (other queued requests advance alongside)."""
        rid = self.add_request(prompt, params)
        while True:
            for e in self.step():
                if e.request_id == rid:
                    yield e
                    if e.finished:
                        self.requests.pop(rid, None)
                        return
            if not self.has_unfinished():
                return
