"""Measurement helpers shared by the benchmarks and notebooks: a careful timer, this machine's matmul peak and
memory bandwidth (measured in the same run as what they are compared with: machines are shared and noisy), and
a JSON writer that records the machine."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp


def timeit(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, min_time: float = 0.0) -> dict[str, float]:
    """Run `fn` (which must return jax arrays or None) `warmup` times, then `repeats` times; block on the
    result each time. Returns best, median and mean seconds. With `min_time`, repeats until that much time."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    t_start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - t_start) < min_time:
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    times.sort()
    return {"best": times[0], "median": times[len(times) // 2], "mean": sum(times) / len(times), "n": len(times)}


def matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5) -> float:
    """Achieved FLOP/s of a jitted n×n @ n×n matmul (best of `repeats`): this device's practical matmul peak."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    t = timeit(lambda: f(a, b), repeats=repeats)["best"]
    return 2 * n**3 / t


def memory_bandwidth(n_bytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Achieved read bytes/s of a jitted sum over `n_bytes` of float32 (best of `repeats`).

    A reduction reads the array once and writes almost nothing: a copy-style kernel (y = a·x + b) would also
    pay for its fresh output buffer, which XLA's CPU runtime maps anew per call (a page fault per 4 KiB page),
    and under-report the bandwidth a weight-streaming decode step sees."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: jnp.sum(x))
    t = timeit(lambda: f(x), repeats=repeats)["best"]
    return n_bytes / t


def cpu_model() -> str:
    """The host CPU's model name (from /proc/cpuinfo on Linux, else `platform.processor()`): the same benchmark can
    rank two libraries differently on different CPUs (e.g. MKL, which torch uses, on an AMD EPYC vs an Intel Xeon)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    d = jax.devices()[0]
    return {
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": d.device_kind,
        "num_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def save_json(result: dict, path: str | os.PathLike | None, default_name: str) -> Path:
    from qwen35.utils import results_dir

    p = Path(path) if path else results_dir() / default_name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, default=float))
    return p


def log(msg: str) -> None:
    """Progress line, flushed at once (benchmarks can run for minutes)."""
    print(msg, flush=True, file=sys.stdout)
