"""Continuous batching: which tokens of which requests run in the next step.

Each step has a budget of `max_num_batched_tokens` tokens and at most `max_num_seqs` running sequences.
  1. Running requests first, oldest first: a decoding request takes 1 token (1 + its drafts in a speculative
     engine, when the budget has room: the step verifies them), a request still in prefill takes the
     rest of its prompt, cut to the budget left (chunked prefill). Each needs pages for its new tokens; when the
     free list is empty the newest running request is preempted — its pages and GDN state blocks freed, its
     progress dropped, and it goes back to the front of the queue to be recomputed (prompt + tokens generated so
     far) later. If the request that needs the page is itself the newest, it preempts itself and the step stops there.
  2. Then, if nothing was preempted, waiting requests in arrival order (first come, first served) while budget,
     sequence places (max_num_seqs) and blocks last: a new request takes its GDN state blocks and the pages of
     its first chunk from the same pool of blocks (`cache.BlockAllocator`).
Prefill chunks and decode tokens thus share a step. With `enable_chunked_prefill=False` a prompt is admitted only
when it fits the budget whole (a recomputation after preemption may still be chunked).

Since the oldest running request is never the victim while an older one exists, and a single request is checked at
admission to fit the whole cache, the engine always makes progress: it never fails for lack of cache.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque

from qwen35.serving.cache import BlockAllocator
from qwen35.serving.sampling import SamplingParams

__all__ = ["Request", "Scheduler", "WAITING", "RUNNING", "FINISHED"]

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: object
    prompt: list[int]
    params: SamplingParams
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V and state are in the cache
    status: str = WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    rank: int = 0  # the data-parallel rank that runs it (`Engine` on a mesh)
    load: int = 0  # tokens it may hold: prompt + max_tokens (what the engine balances ranks by)
    drafts: list[int] = dataclasses.field(default_factory=list)  # the MTP head's guesses (speculative engine)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def tokens(self, start: int, stop: int) -> list[int]:
        P = len(self.prompt)
        if stop <= P:
            return self.prompt[start:stop]
        return (self.prompt + self.output)[start:stop]


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, blocks: BlockAllocator,
                 enable_chunked_prefill: bool = True, lookahead: int = 0):
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.blocks, self.chunked = blocks, enable_chunked_prefill
        self.lookahead = lookahead  # pages for this many tokens past a step's own (the MTP drafts' K/V)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, req: Request) -> None:
        self.blocks.free(id(req))  # its pages and its GDN state blocks

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed, req.status, req.drafts = 0, WAITING, []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        req.status, req.finish_reason = FINISHED, reason
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def schedule(self) -> list[tuple[Request, int]]:
        """The next step: [(request, number of its tokens to run)], rows in this order."""
        budget = self.max_num_batched_tokens
        out: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            if n == 1 and req.drafts and 1 + len(req.drafts) <= budget:  # a decode with drafts: verify them too
                n += len(req.drafts)
            while not self.blocks.can_allocate(id(req), req.num_computed + n + self.lookahead):
                victim = max(self.running, key=lambda r: r.arrival)  # the newest
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != RUNNING:
                break
            self.blocks.allocate(id(req), req.num_computed + n + self.lookahead)
            out.append((req, n))
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed
            if n > budget:
                if not self.chunked and req.num_preemptions == 0:
                    break
                n = budget
            if not self.blocks.can_admit(id(req), n + self.lookahead):  # its state blocks and first pages
                break
            self.waiting.popleft()
            self.blocks.allocate_state(id(req))
            self.blocks.allocate(id(req), n + self.lookahead)
            req.status = RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival)  # running stays in arrival order
            out.append((req, n))
            budget -= n
        return out
