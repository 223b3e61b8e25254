"""Gated delta rule: token-by-token recurrent form vs the chunked form, against this device's matmul peak.

    python benchmarks/gdn.py [--quick] [--json PATH]

Both forms run under `jax.jit` (fp32, B=1, H=8 heads, Dk=Dv=128 by default), after a warm-up, timed with
`block_until_ready`; the figure is the median of a few repeats. In the same run it measures the fp32 matmul
peak (a jitted 2048×2048 @ 2048×2048, best of several), so the "% of peak" columns compare numbers taken on the
same, possibly shared and noisy, machine. GFLOP come from `qwen35.gdn.gdn_flops` ("chunked" counts the chunked
algorithm's useful work; see its docstring); the recurrent form is timed against its own count.
The JSON (default `results/gdn.json`) also records each call's process CPU time, a steadier measure when other
jobs share the CPU.

    python benchmarks/gdn.py --chunk-sweep      # the chunked rule at C = 8, 16, 32, 64 on the package's shapes

The sweep times `chunk_gated_delta_rule` at each chunk size C on the shapes the package runs (the `small`
preset's prefill, a serving step's short prompts with the tiny preset's heads, long sequences with 128-wide
heads), interleaving the sizes call by call so that drift on a shared machine hits them alike; it prints the
times and the fastest C, saves each as a ratio to C = 64 (transformers' choice), and checks that every C gives
the same result. It is the
measurement behind `qwen35.gdn.default_chunk_size` (JSON: `results/gdn_chunk_sweep.json`).
"""

from __future__ import annotations

import argparse
import resource
from functools import partial

import jax
import jax.numpy as jnp

from qwen35.bench import log, machine_info, matmul_peak, save_json, timeit
from qwen35.gdn import chunk_gated_delta_rule, default_chunk_size, gdn_flops, recurrent_gated_delta_rule


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


def run(Ts, *, H=8, Dk=128, Dv=128, chunk_size=None, repeats=3, peak_n=2048, peak_repeats=7, json_path=None,
        save=True):
    chunk_size = chunk_size or default_chunk_size()
    dev = jax.devices()[0]
    info = machine_info()
    log(f"device: {dev.platform} / {dev.device_kind} ({jax.device_count()} device(s)), jax {jax.__version__}")
    peak = matmul_peak(peak_n, repeats=peak_repeats)
    log(f"fp32 matmul peak ({peak_n}x{peak_n} @ {peak_n}x{peak_n}, best of {peak_repeats}): {peak / 1e9:.1f} GFLOP/s")

    rec = jax.jit(recurrent_gated_delta_rule)
    chk = jax.jit(partial(chunk_gated_delta_rule, chunk_size=chunk_size))
    hdr = (f"{'T':>6} {'rec ms':>9} {'chunk ms':>9} {'speed-up':>8} {'rec GF':>8} {'chunk GF':>8} "
           f"{'rec GF/s':>9} {'chk GF/s':>9} {'rec %pk':>8} {'chk %pk':>8}")
    log(f"chunked rule with C = {chunk_size}")
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


# (name, B, T, H, Dk, Dv): the shapes `chunk_sweep` times by default.
SWEEP_SHAPES = (
    ("serving step: 1 prompt of 64 tokens, tiny heads", 1, 64, 4, 16, 24),
    ("serving step: 16 prompts of 64 tokens, tiny heads", 16, 64, 4, 16, 24),
    ("small preset prefill: 4 x 512, 8 heads of 64", 4, 512, 8, 64, 64),
    ("2048 tokens, 8 heads of 64", 1, 2048, 8, 64, 64),
    ("1024 tokens, 16 heads of 128", 1, 1024, 16, 128, 128),
)


def chunk_sweep(shapes=SWEEP_SHAPES, sizes=(8, 16, 32, 64), *, repeats=7, json_path=None, save=True):
    """Median time of `chunk_gated_delta_rule` at each chunk size in `sizes` on each shape, the sizes interleaved
    call by call (10x `repeats` for shapes under 512 tokens); each as a ratio to the largest size, and the largest
    output difference from it."""
    ref_c = max(sizes)
    rows = []
    log(f"{'shape':<52}" + "".join(f"{f'C={c} ms':>11}" for c in sizes) + f"{'best':>6}{'max |diff|':>12}")
    for name, B, T, H, Dk, Dv in shapes:
        args = _inputs(T, H, Dk, Dv, B=B)
        fns = {c: jax.jit(partial(chunk_gated_delta_rule, chunk_size=c, use_qk_l2norm=True)) for c in sizes}
        outs = {c: jax.block_until_ready(f(*args)) for c, f in fns.items()}  # compiles; the results for the check
        diff = max(float(jnp.max(jnp.abs(outs[c][0] - outs[ref_c][0]))) for c in sizes)
        scale = float(jnp.max(jnp.abs(outs[ref_c][0])))  # the outputs' size, for judging diff by float32 rounding
        times = {c: [] for c in sizes}
        for _ in range(repeats if B * T >= 512 else 10 * repeats):  # sub-millisecond calls: more samples
            for c, f in fns.items():
                times[c].append(timeit(lambda f=f: jax.block_until_ready(f(*args)), repeats=1, warmup=0)["best"])
        ms = {c: 1e3 * sorted(t)[len(t) // 2] for c, t in times.items()}
        best = min(ms, key=ms.get)
        rows.append({"shape": name, "B": B, "T": T, "H": H, "Dk": Dk, "Dv": Dv, "ms": {str(c): ms[c] for c in sizes},
                     f"ratio_to_C{ref_c}": {str(c): ms[c] / ms[ref_c] for c in sizes}, "best": best,
                     "max_abs_diff": diff, "max_abs_out": scale})
        log(f"{name:<52}" + "".join(f"{ms[c]:>11.2f}" for c in sizes) + f"{best:>6}{diff:>12.1e}")
    result = {"benchmark": "gdn_chunk_sweep", "machine": machine_info(), "sizes": list(sizes), "repeats": repeats,
              "default_chunk_size": default_chunk_size(), "rows": rows}
    if save:
        log(f"saved {save_json(result, json_path, 'gdn_chunk_sweep.json')}")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="T up to 4096 only (the smoke-test size)")
    ap.add_argument("--json", default=None, help="where to write the JSON (default results/gdn.json)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="C of the chunked rule (default: qwen35.gdn.default_chunk_size() on this backend)")
    ap.add_argument("--chunk-sweep", action="store_true", help="time C = 8, 16, 32, 64 on the package's shapes")
    a = ap.parse_args(argv)
    if a.chunk_sweep:
        return chunk_sweep(repeats=max(a.repeats, 3), json_path=a.json)
    Ts = [2**i for i in range(8, 13 if a.quick else 15)]  # 256 … 4096 (quick) or … 16384
    return run(Ts, chunk_size=a.chunk_size, repeats=a.repeats, json_path=a.json)


if __name__ == "__main__":
    main()
