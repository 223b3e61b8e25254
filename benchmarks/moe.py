"""Time the three MoE expert paths (and the grouped-matmul methods inside the sorted path) under jit.

    python benchmarks/moe.py            # N=4096 tokens, H=512, E=32, k=4, I=256
    python benchmarks/moe.py --quick    # small shapes, seconds

Prints a table with each row's time, its matmul FLOPs, and its speed-up over the dense baseline measured in the
same run, and saves the numbers as JSON under `qwen35.utils.results_dir()` (moe_<backend>.json).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from qwen35 import moe
from qwen35.utils import env_summary, results_dir


def _time(fn, *args, repeats: int) -> float:
    """Median wall time of fn(*args) in seconds, after one compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def make_inputs(N: int, H: int, E: int, k: int, I: int, seed: int = 0):
    key = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(key[0], (N, H), jnp.float32)
    router_w = 0.02 * jax.random.normal(key[1], (E, H), jnp.float32)
    gate_up = 0.02 * jax.random.normal(key[2], (E, 2 * I, H), jnp.float32)
    down = 0.02 * jax.random.normal(key[3], (E, H, I), jnp.float32)
    weights, experts, _ = moe.route(x, router_w, k)
    return x, weights, experts, gate_up, down


def run(N: int, H: int, E: int, k: int, I: int, *, repeats: int = 3, capacity_factor: float = 1.25) -> dict:
    x, weights, experts, gate_up, down = make_inputs(N, H, E, k, I)
    flops = moe.moe_flops(N, H, E, k, I, capacity_factor)
    paths = {
        "dense (one-hot)": (jax.jit(moe.experts_dense), flops["dense"]),
        "sorted + tiles": (jax.jit(lambda *a: moe.experts_sorted(*a, grouped=moe.grouped_tiles)), flops["sorted"]),
        "sorted + ragged_dot": (jax.jit(lambda *a: moe.experts_sorted(*a, grouped=moe.grouped_ragged)),
                                flops["sorted"]),
        f"capacity cf={capacity_factor}": (
            jax.jit(lambda *a: moe.experts_capacity(*a, capacity_factor=capacity_factor)[0]), flops["capacity"]),
    }
    rows = []
    for name, (fn, fl) in paths.items():
        rows.append({"name": name, "seconds": _time(fn, x, weights, experts, gate_up, down, repeats=repeats),
                     "flops": fl})
    # The grouped matmul alone, on rows already sorted by expert.
    order, group_sizes = moe.sort_by_expert(experts, E)
    x_sorted = x[order // k]
    for method, fn in (("tiles", jax.jit(moe.grouped_tiles)), ("ragged_dot", jax.jit(moe.grouped_ragged))):
        rows.append({"name": f"grouped_swiglu {method}",
                     "seconds": _time(fn, x_sorted, group_sizes, gate_up, down, repeats=repeats),
                     "flops": flops["sorted"]})
    base = rows[0]["seconds"]
    for r in rows:
        r["speedup_vs_dense"] = base / r["seconds"]
        r["gflops_per_s"] = r["flops"] / r["seconds"] / 1e9
    load = moe.expert_load(experts, E)
    return {
        "shape": {"N": N, "H": H, "E": E, "k": k, "I": I, "capacity_factor": capacity_factor},
        "backend": jax.default_backend(),
        "imbalance": float(load.imbalance),
        "rows": rows,
    }


def format_table(result: dict) -> str:
    s = result["shape"]
    lines = [f"MoE experts, N={s['N']} H={s['H']} E={s['E']} k={s['k']} I={s['I']} on {result['backend']} "
             f"(router imbalance max/mean {result['imbalance']:.2f})",
             f"{'path':<28}{'ms':>10}{'GFLOP':>10}{'GFLOP/s':>10}{'vs dense':>10}"]
    for r in result["rows"]:
        lines.append(f"{r['name']:<28}{1e3 * r['seconds']:>10.1f}{r['flops'] / 1e9:>10.2f}"
                     f"{r['gflops_per_s']:>10.1f}{r['speedup_vs_dense']:>9.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (N=256, H=64, E=8, k=2, I=32)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-save", action="store_true", help="print only, write no JSON")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.hidden, a.experts, a.top_k, a.width, a.repeats = 256, 64, 8, 2, 32, 2
    print(env_summary())
    result = run(a.tokens, a.hidden, a.experts, a.top_k, a.width, repeats=a.repeats)
    print(format_table(result))
    if not a.no_save:
        path = results_dir() / f"moe_{result['backend']}{'_quick' if a.quick else ''}.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"saved {path}")
    return result


if __name__ == "__main__":
    main()
