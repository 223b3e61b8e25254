"""qwen35 (jit) vs transformers (eager, CPU) on the same checkpoint, in one run.

    python benchmarks/vs_transformers.py            # the ~120M `small` preset and the tiny one
    python benchmarks/vs_transformers.py --quick    # tiny only, short (a smoke run)

Measures prefill tokens/s (batch 4 x 512) and greedy decode tokens/s (batch 4, 64 new tokens, with a cache),
this machine's matmul FLOP/s and memory bandwidth (same run), and each figure as a fraction of the roofline it
implies: prefill is compute-bound (2 x active parameters FLOPs per token, plus attention), decode is memory-bound
(the bytes of weights the batch touches per step: dense weights + the distinct experts its B·k slots hit).
The two frameworks are timed in alternation, `--repeats` rounds (each round: each framework's prefill
`--prefill-samples` times in a row, then both decodes), so both see the same state of a shared machine. The
speed-ups use the best of each figure; the ratio of the medians is printed beside them, and the ratio within each
round (on a shared machine each framework's own speed moves by 10-30% between runs and rounds, so one run's best-of
ratio moves too; a round's ratio compares times taken seconds apart, so a drift between rounds cancels out of it).
Prints a table and saves JSON (results/vs_transformers.json by default) with every round's times.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np

import qwen35
from qwen35 import bench
from qwen35.config import get_preset
from qwen35.generation import generate


def decode_bytes_per_step(cfg, batch: int, dtype_bytes: int = 4) -> float:
    """Weight bytes one decode step reads: everything but the routed experts, plus the expected distinct experts
    that batch·k routed slots touch per layer, E·(1 − (1 − k/E)^batch)."""
    pc = cfg.param_counts()["components"]
    dense = sum(v["total"] for k, v in pc.items() if k not in ("routed_experts", "embed_tokens"))
    dense += cfg.hidden_size * batch  # embedding rows actually read
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** batch)
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * cfg.num_hidden_layers
    return (dense + touched * per_expert) * dtype_bytes


def prefill_flops_per_token(cfg, T: int) -> float:
    """2 x active parameters (without the embedding lookup) + causal attention scores/values at average length T/2."""
    pc = cfg.param_counts()
    active = pc["active"] - pc["components"]["embed_tokens"]["active"]
    attn = cfg.num_full_layers * 2 * 2 * cfg.num_attention_heads * cfg.head_dim * (T / 2)
    return 2 * active + attn


def build_checkpoint(cfg, path: str, seed: int = 0):
    """A random checkpoint written by transformers (so both sides load the same file)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    from qwen35.parity import hf_text_config

    torch.manual_seed(seed)
    hc = hf_text_config(cfg)
    m = Qwen3_5MoeForCausalLM(hc).eval()
    m.save_pretrained(path)
    return m


def transformers_runs(hm, prompt: np.ndarray, dprompt: np.ndarray, new_tokens: int) -> dict:
    """Transformers' timed pieces: prefill() -> seconds; decode() -> (seconds of its new_tokens - 1 cached steps,
    greedy tokens [B, new_tokens])."""
    import torch
    from transformers.cache_utils import DynamicCache

    torch.set_num_threads(os.cpu_count() or 1)
    ids, dids = torch.from_numpy(prompt), torch.from_numpy(dprompt)

    def prefill():
        with torch.no_grad():
            return _t(lambda: hm(ids, use_cache=False).logits)

    def decode():
        with torch.no_grad():
            cache = DynamicCache(config=hm.config)
            out = hm(dids, cache=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            toks = [tok]
            for _ in range(new_tokens - 1):
                out = hm(tok, cache=cache, use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(tok)
            return time.perf_counter() - t0, torch.cat(toks, 1).numpy()

    return {"prefill": prefill, "decode": decode}


def _t(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def qwen35_runs(model, prompt: np.ndarray, dprompt: np.ndarray, new_tokens: int) -> dict:
    """qwen35's timed pieces, as `transformers_runs`. The whole greedy loop runs in one jitted lax.scan, so the
    decode time is generate(new_tokens) minus generate(1) (the prefill and first token), each timed once here."""
    import jax

    from qwen35.model import forward_fn

    f, params = forward_fn(model)
    ids = jnp.asarray(prompt)

    def prefill():
        return _t(lambda: jax.block_until_ready(f(params, ids, None)[0]))

    def decode():
        t0 = time.perf_counter()
        toks = generate(model, dprompt, new_tokens)  # numpy: already on the host when it returns
        full = time.perf_counter() - t0
        one = _t(lambda: generate(model, dprompt, 1))
        return max(full - one, 1e-9), toks

    prefill(), generate(model, dprompt, new_tokens), generate(model, dprompt, 1)  # compile
    return {"prefill": prefill, "decode": decode}


def measure(runs: dict, repeats: int, prefill_samples: int = 3) -> dict:
    """Every figure of both frameworks, `repeats` rounds, the frameworks alternating within each round (a shared
    machine's speed drifts by tens of percent over seconds: interleaving lets both see the same machine); the
    best of each figure is kept. Each round times each framework's prefill `prefill_samples` times in a row
    (seconds each; one decode is several seconds), so the best prefill comes from more samples."""
    pre = {n: [] for n in runs}
    dec = {n: [] for n in runs}
    toks = {}
    for i in range(repeats):
        for name, r in runs.items():
            pre[name] += [r["prefill"]() for _ in range(prefill_samples)]
        for name, r in runs.items():
            t, toks[name] = r["decode"]()
            dec[name].append(t)
        bench.log(f"  round {i + 1}/{repeats}: " + ", ".join(
            f"{n} prefill {' / '.join(f'{t:.2f}' for t in pre[n][-prefill_samples:])} s, decode {dec[n][-1]:.2f} s"
            for n in runs))
    return {n: {"prefill_s": min(pre[n]), "decode_s": min(dec[n]), "prefill_all_s": pre[n], "decode_all_s": dec[n],
                "prefill_rounds_s": [pre[n][i * prefill_samples:(i + 1) * prefill_samples] for i in range(repeats)],
                "tokens": toks[n]} for n in runs}


def paired_speedups(m: dict) -> dict:
    """qwen35's speed-up within each round: transformers' time over qwen35's, both from the same round (the
    median of its prefill samples, its one decode). The two were measured seconds apart, so a drift of the
    machine's speed between rounds, which moves both, cancels out of each round's ratio."""
    t, q = m["transformers"], m["qwen35"]
    rounds = zip(t["prefill_rounds_s"], q["prefill_rounds_s"])
    return {"prefill": [float(np.median(a) / np.median(b)) for a, b in rounds],
            "decode": [float(a / b) for a, b in zip(t["decode_all_s"], q["decode_all_s"])]}


def run(preset: str, *, batch: int, prompt_len: int, new_tokens: int, decode_prompt_len: int, repeats: int,
        peak: float, bw: float, prefill_samples: int = 3) -> dict:
    import torch

    cfg = get_preset(preset)
    bench.log(f"[{preset}] {cfg.param_counts()['total'] / 1e6:.1f} M parameters: writing a transformers checkpoint")
    with tempfile.TemporaryDirectory() as d:
        hm = build_checkpoint(cfg, d)
        model = qwen35.load_hf_checkpoint(d, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    dprompt = prompt[:, :decode_prompt_len]
    bench.log(f"[{preset}] warming up transformers (eager, {torch.get_num_threads()} threads) and qwen35 (jit: "
              "compiling)")
    runs = {"transformers": transformers_runs(hm, prompt, dprompt, new_tokens),
            "qwen35": qwen35_runs(model, prompt, dprompt, new_tokens)}
    runs["transformers"]["prefill"](), runs["transformers"]["decode"]()
    bench.log(f"[{preset}] timing, {repeats} rounds")
    m = measure(runs, repeats, prefill_samples)
    paired = paired_speedups(m)
    same = float(np.mean(m["qwen35"]["tokens"] == m["transformers"]["tokens"]))

    flops_tok = prefill_flops_per_token(cfg, prompt_len)
    dbytes = decode_bytes_per_step(cfg, batch)
    roof_prefill = peak / flops_tok  # tokens/s if compute-bound at the measured matmul peak
    roof_decode = bw / dbytes * batch  # tokens/s if every step only streams the touched weights
    rows = {}
    steps = new_tokens - 1  # cached decode steps timed (the first new token comes from the prefill)
    for name, r in m.items():
        pre_tps = batch * prompt_len / r["prefill_s"]
        dec_tps = batch * steps / r["decode_s"]
        rows[name] = {
            "prefill_tokens_per_s": pre_tps,
            "decode_tokens_per_s": dec_tps,
            "decode_ms_per_step": 1e3 * r["decode_s"] / steps,
            "prefill_s_all": [float(t) for t in r["prefill_all_s"]],  # unrounded: a tiny prefill takes ~1 ms
            "decode_ms_per_step_all": [1e3 * t / steps for t in r["decode_all_s"]],
            "prefill_frac_of_roofline": pre_tps / roof_prefill,
            "decode_frac_of_roofline": dec_tps / roof_decode,
        }
    return {
        "preset": preset,
        "params": cfg.param_counts()["total"],
        "batch": batch,
        "prompt_len": prompt_len,
        "decode_prompt_len": decode_prompt_len,
        "new_tokens": new_tokens,
        "prefill_flops_per_token": flops_tok,
        "decode_bytes_per_step": dbytes,
        "roofline_prefill_tokens_per_s": roof_prefill,
        "roofline_decode_tokens_per_s": roof_decode,
        "greedy_tokens_agree": same,
        "results": rows,
        "speedup_prefill": rows["qwen35"]["prefill_tokens_per_s"] / rows["transformers"]["prefill_tokens_per_s"],
        "speedup_decode": rows["qwen35"]["decode_tokens_per_s"] / rows["transformers"]["decode_tokens_per_s"],
        # the same ratios from each framework's median time (all samples): less sensitive to one lucky sample
        "speedup_prefill_median": float(np.median(m["transformers"]["prefill_all_s"])
                                        / np.median(m["qwen35"]["prefill_all_s"])),
        "speedup_decode_median": float(np.median(m["transformers"]["decode_all_s"])
                                       / np.median(m["qwen35"]["decode_all_s"])),
        # one ratio per round, from times measured within that round (see `paired_speedups`)
        "speedup_prefill_rounds": paired["prefill"],
        "speedup_decode_rounds": paired["decode"],
    }


def format_table(res: dict) -> str:
    lines = [f"\n== {res['preset']} ({res['params'] / 1e6:.1f} M params; prefill {res['batch']}x{res['prompt_len']}, "
             f"decode {res['batch']}x{res['new_tokens']} after a {res['decode_prompt_len']}-token prompt) ==",
             f"roofline: prefill {res['roofline_prefill_tokens_per_s']:,.0f} tok/s "
             f"({res['prefill_flops_per_token'] / 1e6:.1f} MFLOP/token), decode "
             f"{res['roofline_decode_tokens_per_s']:,.0f} tok/s ({res['decode_bytes_per_step'] / 1e6:.0f} MB/step)",
             f"{'':<14}{'prefill tok/s':>15}{'% roof':>8}{'decode tok/s':>14}{'ms/step':>9}{'% roof':>8}"]
    for name, r in res["results"].items():
        lines.append(f"{name:<14}{r['prefill_tokens_per_s']:>15,.0f}{100 * r['prefill_frac_of_roofline']:>7.1f}%"
                     f"{r['decode_tokens_per_s']:>14,.1f}{r['decode_ms_per_step']:>9.2f}"
                     f"{100 * r['decode_frac_of_roofline']:>7.1f}%")
    lines.append(f"qwen35 / transformers: prefill x{res['speedup_prefill']:.2f}, decode x{res['speedup_decode']:.2f} "
                 f"(best times; medians: prefill x{res['speedup_prefill_median']:.2f}, decode "
                 f"x{res['speedup_decode_median']:.2f}); greedy tokens agree on "
                 f"{100 * res['greedy_tokens_agree']:.0f}%")
    lines.append("  within each round: prefill " + " / ".join(f"x{r:.2f}" for r in res["speedup_prefill_rounds"])
                 + ", decode " + " / ".join(f"x{r:.2f}" for r in res["speedup_decode_rounds"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny preset only, short prompts (smoke run)")
    p.add_argument("--presets", default=None, help="comma-separated presets (default: small,tiny)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefill-samples", type=int, default=3, help="prefills of each framework per round")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    presets = (a.presets or ("tiny" if a.quick else "small,tiny")).split(",")
    batch, prompt_len, new_tokens, dprompt = (2, 32, 8, 16) if a.quick else (4, 512, 64, 64)
    bench.log("measuring this machine: matmul peak and memory bandwidth")
    peak = bench.matmul_peak(1024 if a.quick else 2048)
    bw = bench.memory_bandwidth(64 * 2**20 if a.quick else 256 * 2**20)
    bench.log(f"{bench.cpu_model()}, {os.cpu_count()} cores: fp32 matmul {peak / 1e9:.1f} GFLOP/s, memory "
              f"{bw / 1e9:.1f} GB/s")
    out = {"machine": bench.machine_info(), "matmul_flops": peak, "memory_bytes_per_s": bw, "runs": []}
    for preset in presets:
        res = run(preset, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, decode_prompt_len=dprompt,
                  repeats=1 if a.quick else a.repeats, peak=peak, bw=bw,
                  prefill_samples=2 if a.quick else a.prefill_samples)
        bench.log(format_table(res))
        out["runs"].append(res)
    path = bench.save_json(out, a.json, "vs_transformers.json")
    bench.log(f"saved {path}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
