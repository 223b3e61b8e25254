"""The Ironwood post's serving workloads and the tokens-per-second-per-chip measurement (`python -m qwen35 bench`).

  prefill-heavy: 8,192 input / 1,024 output tokens per request;  decode-heavy: 1,024 input / 8,192 output.
  TPS/chip = (input + output tokens) / duration / chips — the Ironwood post's metric (4 chips, concurrency 64–512).
Both lengths are divided by `scale` on small machines (scale 64 on a CPU: 128/16 and 16/128).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from qwen35.serving.engine import Engine
from qwen35.serving.sampling import SamplingParams

__all__ = ["WORKLOADS", "make_requests", "num_chips", "run_workload", "decode_step_time", "format_table"]

WORKLOADS = {"prefill-heavy": (8192, 1024), "decode-heavy": (1024, 8192)}


def make_requests(workload: str, num_requests: int, scale: int = 1, vocab_size: int = 512, seed: int = 0):
    """[(prompt ids, SamplingParams)] of the workload at 1/scale length: random prompts, fixed output lengths
    (no stop tokens, like the Ironwood post's benchmark with ignore_eos)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale}")
    n_in, n_out = (max(1, n // scale) for n in WORKLOADS[workload])
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab_size, size=n_in).tolist(), SamplingParams(max_tokens=n_out))
            for _ in range(num_requests)]


def num_chips() -> int:
    """Chips, not logical devices: a TPU v7x chip holds 2 TensorCores, each a JAX device. A CPU host counts as 1."""
    devs = jax.devices()
    if devs[0].platform == "cpu":
        return 1
    coords = {tuple(getattr(d, "coords", (d.id,))) for d in devs}
    return len(coords)


def run_workload(engine: Engine, requests, *, progress: bool = True, desc: str = "bench") -> dict:
    """Serve `requests` to completion (all queued at once; the engine keeps max_num_seqs in flight) and time it.

    Returns input/output tokens, duration, TPS/chip, output tokens/s, mean time to first token and mean time per
    output token (TPOT, between a request's first and last token)."""
    first, last, count = {}, {}, {}
    ids = [engine.add_request(p, sp) for p, sp in requests]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(sp.max_tokens for _, sp in requests), desc=desc, unit="tok", leave=False)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            first.setdefault(e.request_id, now)
            last[e.request_id] = now
            count[e.request_id] = count.get(e.request_id, 0) + len(e.token_ids)
        if bar is not None:
            bar.update(sum(len(e.token_ids) for e in events))
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    n_in = sum(len(p) for p, _ in requests)
    n_out = sum(count.values())
    for rid in ids:
        engine.requests.pop(rid, None)
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in ids if count[r] > 1]
    chips = num_chips()
    return {"requests": len(requests), "input_tokens": n_in, "output_tokens": n_out, "duration_s": duration,
            "chips": chips, "tps_per_chip": (n_in + n_out) / duration / chips, "output_tps": n_out / duration,
            "mean_ttft_s": float(np.mean([first[r] - t0 for r in ids])),
            "mean_tpot_ms": float(np.mean(tpot)) * 1e3 if tpot else float("nan"),
            "steps": engine.num_steps, "preemptions": engine.num_preemptions}


def decode_step_time(engine: Engine, batch: int, context: int, max_tokens: int, seed: int = 0) -> dict:
    """The engine's decode step with `batch` sequences at about `context` tokens: `batch` random prompts of
    `context` tokens, `max_tokens` new tokens each, served twice (the first pass compiles the prefill and decode
    programs and is timed whole). Returns the median of the second pass's steps that decoded all `batch` rows and
    nothing else (`step_s`), how many there were, and the first pass's seconds."""
    rng = np.random.default_rng(seed)
    first_pass_s = 0.0
    for rnd in range(2):
        t0 = time.perf_counter()
        for _ in range(batch):
            engine.add_request(rng.integers(0, engine.config.vocab_size, size=context).tolist(),
                               SamplingParams(max_tokens=max_tokens))
        engine.history.clear()
        while engine.has_unfinished():
            engine.step()
        if rnd == 0:
            first_pass_s = time.perf_counter() - t0
    dec = [h["seconds"] for h in engine.history
           if len(h["rows"]) == batch and all(kind == "decode" for _, _, kind in h["rows"])]
    if not dec:
        raise RuntimeError(f"no decode step ran all {batch} sequences: give each more new tokens (max_tokens)")
    return {"step_s": float(np.median(dec)), "decode_steps": len(dec), "first_pass_s": first_pass_s}


def format_table(rows: list[dict]) -> str:
    head = f"{'workload':<14}{'conc':>6}{'in/out':>12}{'seconds':>9}{'TPS/chip':>11}{'out tok/s':>11}{'TPOT ms':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['workload']:<14}{r['concurrency']:>6}{r['in_out']:>12}{r['duration_s']:>9.2f}"
                     f"{r['tps_per_chip']:>11,.0f}{r['output_tps']:>11,.0f}{r['mean_tpot_ms']:>9.2f}")
    return "\n".join(lines)
