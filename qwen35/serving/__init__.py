"""Serving Qwen3.5: a continuous-batching engine over a paged hybrid cache.

    from qwen35.serving import Engine, SamplingParams
    engine = Engine(model, max_num_seqs=64, max_num_batched_tokens=1024, block_size=256)
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))

Modules: `cache` (one pool of blocks for KV pages and GDN states: its allocator, layout and bytes per sequence), `scheduler`
(continuous batching, chunked prefill, preemption), `sampling` (greedy / temperature / top-k / top-p, per-request
seeds), `runner` (the jitted step built on the model's modules), `engine` (the API), `workload` (the Ironwood post's
benchmark workloads and the TPS/chip table).
"""

from qwen35.kernels.state_pool import PoolLayout
from qwen35.pool import pool_layout
from qwen35.serving.cache import BlockAllocator, PagedHybridCache, init_paged_cache, layout_bytes
from qwen35.serving.engine import ByteTokenizer, Engine, RequestOutput, StepEvent
from qwen35.serving.sampling import SamplingParams, sample, sampling_probs

__all__ = ["Engine", "SamplingParams", "RequestOutput", "StepEvent", "ByteTokenizer", "BlockAllocator",
           "PagedHybridCache", "PoolLayout", "pool_layout", "init_paged_cache", "layout_bytes", "sample", "sampling_probs"]
