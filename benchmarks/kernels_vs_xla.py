"""Time each Pallas kernel against its XLA reference, next to the device's roofline.

    python benchmarks/kernels_vs_xla.py [--only attention,moe,gdn] [--repeats 5] [--json PATH]

Cases (each a `Case`: `applies()` says whether it runs here and why not, `run()` builds the inputs, times the
kernel and the reference in the same process, jitted, median of `repeats` after a warm-up, and checks they agree):

  ragged paged attention  the 397B model's attention heads (Hq = 32, Hkv = 2, Dh = 256, bf16): 64 decode
                          sequences at 8K context with page size 16 and with 256, and a mixed prefill + decode batch;
                          reference: gather the pages, then attend (`ragged_paged_attention_reference`)
  grouped SwiGLU          512 experts, top-10 routing of 1024 tokens (M = 10240 rows), H = 4096, I = 1024, bf16;
                          reference: `qwen35.moe.grouped_swiglu` with `ragged_dot` (XLA's grouped GEMM)
  permute / unpermute     the same 10240 rows of H = 4096; reference: XLA gather / scatter-add
  GDN, reduce-scatter     `benchmarks/kernels_gdn.py`'s `CASES`, when that file is present

Each row: kernel and reference time, their ratio, FLOPs and bytes from napkin math, achieved FLOP/s and bytes/s,
and the fraction of the roofline (time bound max(FLOPs / peak, bytes / bandwidth) over the time taken). Peaks come
from `qwen35.roofline.HARDWARE` for known TPUs/GPUs, else they are measured here (`qwen35.bench`).

Where it runs what: on a TPU, the realistic sizes. On a GPU, the kernels (Mosaic TPU) do not compile: the
realistic-size XLA references are timed and the kernel column says why it is empty. On a CPU, the correctness
sizes only, with the kernels in TPU interpret mode (a simulator: those timings are not kernel speed; the script
says so). Results: a table on stdout and JSON under `qwen35.utils.results_dir()` (kernels_<backend>.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if __name__ == "__main__":  # fake 8 CPU devices for the reduce-scatter case when run directly (before jax starts)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared `Case` and the GDN cases beside this file
from kernel_case import Case, log_backend  # noqa: E402

from qwen35.bench import log, machine_info, save_json
from qwen35.roofline import device_roofline
from qwen35.kernels.grouped_matmul import gmm_cost, grouped_swiglu, grouped_swiglu_reference
from qwen35.kernels.permute import permute, permute_reference, unpermute, unpermute_reference
from qwen35.kernels.ragged_paged_attention import (ragged_paged_attention, ragged_paged_attention_reference,
                                                   rpa_cost)

__all__ = ["Case", "CASES", "all_cases", "run_cases", "main"]


# ------------------------------------------------------------------------------------------------------------
# Ragged paged attention
def _attention_case(name, q_lens, kv_lens, *, page_size, Hq, Hkv, D, size, block_q=8, pages_per_block=None,
                    dtype=jnp.bfloat16):
    def build():
        S = len(q_lens)
        P = max(-(-kv // page_size) for kv in kv_lens)
        ks = jax.random.split(jax.random.key(0), 4)
        num_pages = S * P
        k_pages = jax.random.normal(ks[0], (num_pages, page_size, Hkv, D), dtype)
        v_pages = jax.random.normal(ks[1], (num_pages, page_size, Hkv, D), dtype)
        page_indices = jax.random.permutation(ks[2], num_pages).reshape(S, P).astype(jnp.int32)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        q = jax.random.normal(ks[3], (int(sum(q_lens)), Hq, D), dtype)
        args = (q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32), page_indices, cu, jnp.array([S], jnp.int32))
        kernel = jax.jit(lambda *a: ragged_paged_attention(*a, block_q=block_q, pages_per_block=pages_per_block))
        cost = rpa_cost(kv_lens, q_lens, num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=page_size,
                        dtype_bytes=jnp.dtype(dtype).itemsize)
        return kernel, jax.jit(ragged_paged_attention_reference), args, cost["flops"], cost["bytes"]

    return Case(name, "ragged_paged_attention", size, build)


# ------------------------------------------------------------------------------------------------------------
# Grouped SwiGLU, permute, unpermute
def _routing(N, E, k, seed=0):
    logits = jax.random.normal(jax.random.key(seed), (N, E), jnp.float32)
    w, experts = jax.lax.top_k(jax.nn.softmax(logits), k)
    return (w / w.sum(-1, keepdims=True)), experts.astype(jnp.int32)


def _gmm_case(name, N, E, k, H, I, *, size, tm=128, ti=512, th=512, dtype=jnp.bfloat16):
    def build():
        from qwen35.moe import grouped_ragged
        from qwen35.moe import sort_by_expert

        _, experts = _routing(N, E, k)
        _, group_sizes = sort_by_expert(experts, E)
        ks = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(ks[0], (N * k, H), dtype)
        gate_up = (jax.random.normal(ks[1], (E, 2 * I, H), jnp.float32) * H**-0.5).astype(dtype)
        down = (jax.random.normal(ks[2], (E, H, I), jnp.float32) * I**-0.5).astype(dtype)
        kernel = jax.jit(lambda *a: grouped_swiglu(*a, tm=tm, ti=ti, th=th))
        if jax.default_backend() == "cpu":
            ref = jax.jit(grouped_swiglu_reference)
        else:
            ref = jax.jit(grouped_ragged)
        cost = gmm_cost(N * k, H, I, int(jnp.sum(group_sizes > 0)), jnp.dtype(dtype).itemsize)
        return kernel, ref, (x, group_sizes, gate_up, down), cost["flops"], cost["bytes"]

    return Case(name, "grouped_swiglu", size, build, tol=0.1)


def _permute_case(name, N, E, k, H, *, size, which, dtype=jnp.bfloat16):
    def build():
        from qwen35.moe import sort_by_expert

        w, experts = _routing(N, E, k)
        order, _ = sort_by_expert(experts, E)
        b = jnp.dtype(dtype).itemsize
        if which == "permute":
            x = jax.random.normal(jax.random.key(2), (N, H), dtype)
            return (jax.jit(lambda x, o: permute(x, o, k)), jax.jit(lambda x, o: permute_reference(x, o, k)),
                    (x, order), 0.0, 2.0 * N * k * H * b)
        y = jax.random.normal(jax.random.key(3), (N * k, H), dtype)
        return (jax.jit(unpermute), jax.jit(unpermute_reference), (y, order, w.astype(dtype)),
                2.0 * N * k * H, float((N * k + N) * H * b))

    return Case(name, which, size, build, tol=5e-2)


def _attention_cases():
    big = dict(Hq=32, Hkv=2, D=256, size="realistic")
    tiny = dict(Hq=4, Hkv=2, D=128, size="correctness", dtype=jnp.float32)
    return [
        _attention_case("rpa decode 64 seq x 8K, page 16", [1] * 64, [8192] * 64, page_size=16, **big),
        _attention_case("rpa decode 64 seq x 8K, page 256", [1] * 64, [8192] * 64, page_size=256, **big),
        _attention_case("rpa mixed 2x128 prefill + 62 decode @4K, page 256", [128, 128] + [1] * 62,
                        [4096] * 64, page_size=256, **big),
        _attention_case("rpa decode 8 seq x 40 (CPU), page 16", [1] * 8, [40] * 8, page_size=16, block_q=8, **tiny),
        _attention_case("rpa mixed 6+1+1 (CPU), page 16", [6, 1, 1], [6, 33, 17], page_size=16, block_q=8,
                        **tiny),
    ]


def _moe_cases():
    big = dict(N=1024, E=512, k=10, H=4096, size="realistic")
    return [
        _gmm_case("gmm swiglu 512 experts top-10 of 1024 tokens", I=1024, **big),
        _permute_case("permute 1024 tokens x top-10", which="permute", **{k: v for k, v in big.items()}),
        _permute_case("unpermute 1024 tokens x top-10", which="unpermute", **big),
        _gmm_case("gmm swiglu 8 experts top-2 of 16 tokens (CPU)", N=16, E=8, k=2, H=128, I=128,
                  size="correctness", tm=8, ti=128, th=128, dtype=jnp.float32),
        _permute_case("permute 16 tokens x top-2 (CPU)", N=16, E=8, k=2, H=128, size="correctness",
                      which="permute", dtype=jnp.float32),
        _permute_case("unpermute 16 tokens x top-2 (CPU)", N=16, E=8, k=2, H=128, size="correctness",
                      which="unpermute", dtype=jnp.float32),
    ]


CASES: list[Case] = _attention_cases() + _moe_cases()


def all_cases(only: set[str] | None = None) -> list:
    """This file's cases plus `benchmarks/kernels_gdn.py`'s (GDN and reduce-scatter), when that file exists."""
    groups = {"attention": [c for c in CASES if c.kernel == "ragged_paged_attention"],
              "moe": [c for c in CASES if c.kernel != "ragged_paged_attention"], "gdn": []}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import kernels_gdn
        groups["gdn"] = list(kernels_gdn.CASES)
    except ImportError as e:
        log(f"(benchmarks/kernels_gdn.py not importable: {e}; GDN cases skipped)")
    return [c for g, cs in groups.items() if only is None or g in only for c in cs]


def run_cases(cases, repeats: int = 5) -> list[dict[str, Any]]:
    rows = []
    for c in cases:
        ok, why = c.applies()
        if not ok:
            continue
        log(f"  {c.name} ...")
        rows.append(c.run(repeats=repeats))
    return rows


def _ms(t):
    return "-" if t is None else f"{t * 1e3:9.3f}"


def _fmt(r) -> str:
    ratio = "-" if r.get("speedup_vs_reference") is None else f"{r['speedup_vs_reference']:6.2f}x"
    return (f"{r['name']:<52} {_ms(r['kernel_s']):>9} {_ms(r['reference_s']):>9} {ratio:>7} "
            f"{r['achieved_flops'] / 1e9:10.1f} {r['achieved_bytes_per_s'] / 1e9:9.2f} "
            f"{100 * r['roofline_fraction']:6.1f}% {r['bound']}")


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated groups: attention,moe,gdn (default all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="output path (default results/kernels_<backend>.json)")
    args = ap.parse_args(argv)
    backend = log_backend()
    only = None if args.only is None else set(args.only.split(","))
    rows = run_cases(all_cases(only), repeats=args.repeats)
    peak_f, peak_b, source = device_roofline()
    log(f"\nroofline: {peak_f / 1e9:,.0f} GFLOP/s, {peak_b / 1e9:,.1f} GB/s ({source})")
    log(f"{'case':<52} {'kernel ms':>9} {'ref ms':>9} {'ratio':>7} {'GFLOP/s':>10} {'GB/s':>9} {'roof':>7}")
    for r in rows:
        log(_fmt(r))
    result = {"machine": machine_info(), "roofline": {"flops": peak_f, "bytes_per_s": peak_b, "source": source},
              "rows": rows}
    p = save_json(result, args.json, f"kernels_{backend}.json")
    log(f"saved {p}")
    return result


if __name__ == "__main__":
    main()
