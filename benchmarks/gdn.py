"""Gated delta rule: token-by-token recurrent form vs the chunked form, against this device's matmul peak.

    python benchmarks/gdn.py [--quick] [--json PATH]

Both forms run under `jax.jit` (fp32, B=1, H=8 heads, Dk=Dv=128 by default), after a warm-up, timed with
`block_until_ready`; the figure is the median of a few repeats. In the same run it measures the fp32 matmul
peak (a jitted 2048×2048 @ 2048×2048, best of several), so the "% of peak" columns compare numbers taken on the
same, possibly shared and noisy, machine. GFLOP come from `qwen35.gdn.gdn_flops` ("chunked" counts the chunked
algorithm's useful work; see its docstring); the recurrent form is timed against its own count.
The JSON (default `results/gdn.json`) also records each call's process CPU time, a steadier measure when other
jobs share the CPU.
"""

from __future__ import annotations

import argparse
import resource
from functools import partial

import jax
import jax.numpy as jnp

from qwen35.bench import log, machine_info, matmul_peak, save_json, timeit
from qwen35.gdn import chunk_gated_delta_rule, gdn_flops, recurrent_gated_delta_rule


def _inputs(T, H, Dk, Dv, B=1, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, Dk), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, H, Dk), jnp.float32)
    v = jax.random.normal(ks[2], (B, T, H, Dv), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H), jnp.float32))  # log-decay <= 0
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32))
    return q, k, v, g, beta


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _time(fn, args, repeats):
    """Median wall seconds (after one warm-up call, which also compiles) and the median process CPU seconds."""
    cpu = []

    def call():
        c0 = _cpu_seconds()
        out = jax.block_until_ready(fn(*args))
        cpu.append(_cpu_seconds() - c0)
        return out

    t = timeit(call, repeats=repeats, warmup=1)
    cpu = sorted(cpu[1:]) or cpu
    return t["median"], t["best"], cpu[len(cpu) // 2]


def run(Ts, *, H=8, Dk=128, Dv=128, chunk_size=64, repeats=3, peak_n=2048, peak_repeats=7, json_path=None,
        save=True):
    dev = jax.devices()[0]
    info = machine_info()
    log(f"device: {dev.platform} / {dev.device_kind} ({jax.device_count()} device(s)), jax {jax.__version__}")
    peak = matmul_peak(peak_n, repeats=peak_repeats)
    log(f"fp32 matmul peak ({peak_n}x{peak_n} @ {peak_n}x{peak_n}, best of {peak_repeats}): {peak / 1e9:.1f} GFLOP/s")

    rec = jax.jit(recurrent_gated_delta_rule)
    chk = jax.jit(partial(chunk_gated_delta_rule, chunk_size=chunk_size))
    hdr = (f"{'T':>6} {'rec ms':>9} {'chunk ms':>9} {'speed-up':>8} {'rec GF':>8} {'chunk GF':>8} "
           f"{'rec GF/s':>9} {'chk GF/s':>9} {'rec %pk':>8} {'chk %pk':>8}")
    log(hdr)
    rows = []
    for T in Ts:
        args = _inputs(T, H, Dk, Dv)
        t_rec, best_rec, cpu_rec = _time(rec, args, repeats)
        t_chk, best_chk, cpu_chk = _time(chk, args, repeats)
        fl = gdn_flops(T, H, Dk, Dv, chunk_size)
        row = {
            "T": T,
            "recurrent_ms": 1e3 * t_rec, "chunked_ms": 1e3 * t_chk,
            "recurrent_best_ms": 1e3 * best_rec, "chunked_best_ms": 1e3 * best_chk,
            "recurrent_cpu_ms": 1e3 * cpu_rec, "chunked_cpu_ms": 1e3 * cpu_chk,
            "speedup": t_rec / t_chk,
            "recurrent_gflop": fl["recurrent"] / 1e9, "chunked_gflop": fl["chunked"] / 1e9,
            "chunked_executed_gflop": fl["chunked_executed"] / 1e9,
            "recurrent_gflops": fl["recurrent"] / t_rec / 1e9, "chunked_gflops": fl["chunked"] / t_chk / 1e9,
        }
        row["recurrent_pct_peak"] = 100 * row["recurrent_gflops"] * 1e9 / peak
        row["chunked_pct_peak"] = 100 * row["chunked_gflops"] * 1e9 / peak
        rows.append(row)
        log(f"{T:>6} {row['recurrent_ms']:>9.2f} {row['chunked_ms']:>9.2f} {row['speedup']:>7.1f}x "
            f"{row['recurrent_gflop']:>8.3f} {row['chunked_gflop']:>8.3f} {row['recurrent_gflops']:>9.2f} "
            f"{row['chunked_gflops']:>9.2f} {row['recurrent_pct_peak']:>7.1f}% {row['chunked_pct_peak']:>7.1f}%")
    result = {
        "benchmark": "gdn",
        "machine": info,
        "device": {"platform": dev.platform, "kind": dev.device_kind},
        "config": {"B": 1, "H": H, "Dk": Dk, "Dv": Dv, "chunk_size": chunk_size, "dtype": "float32",
                   "repeats": repeats, "timing": "median wall seconds after warm-up"},
        "matmul_peak_gflops": peak / 1e9,
        "matmul_peak_shape": [peak_n, peak_n, peak_n],
        "rows": rows,
    }
    if save:
        p = save_json(result, json_path, "gdn.json")
        log(f"saved {p}")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T up to 4096 only (the smoke-test size)")
    ap.add_argument("--json", default=None, help="where to write the JSON (default results/gdn.json)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=64)
    a = ap.parse_args(argv)
    Ts = [2**i for i in range(8, 13 if a.quick else 15)]  # 256 … 4096 (quick) or … 16384
    return run(Ts, chunk_size=a.chunk_size, repeats=a.repeats, json_path=a.json)


if __name__ == "__main__":
    main()
