"""`python -m qwen35`: the project's main job.

    python -m qwen35                 # demo on the built-in tiny preset (default)
    python -m qwen35 info --model qwen35-397b-a17b   # parameter and memory napkin math of a preset

The demo exercises what the package has: the config and its parameter counts, and the Gated DeltaNet layer
(prefill by the chunked rule, then cached decode by the recurrent step, checked against one long prefill).
It will become the serving benchmark once the engine exists.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:8.2f} B" if n >= 1e8 else f"{n / 1e6:8.3f} M"


def cmd_info(args) -> dict:
    from qwen35.config import get_preset

    cfg = get_preset(args.model)
    pc = cfg.param_counts()
    print(f"model: {cfg.name}  ({cfg.num_hidden_layers} layers: {cfg.num_linear_layers} Gated DeltaNet + "
          f"{cfg.num_full_layers} gated attention; MoE {cfg.num_experts} experts, top-{cfg.num_experts_per_tok})")
    print(f"{'component':<16}{'total':>12}{'active/token':>14}")
    for name, c in pc["components"].items():
        print(f"{name:<16}{_fmt_params(c['total']):>12}{_fmt_params(c['active']):>14}")
    print(f"{'TOTAL':<16}{_fmt_params(pc['total']):>12}{_fmt_params(pc['active']):>14}")
    cb = cfg.cache_bytes_per_sequence(args.context)
    print(f"per sequence at {args.context} tokens: KV {cb['kv_bytes'] / 2**20:.1f} MiB "
          f"({cb['kv_bytes_per_token'] / 1024:.1f} KiB/token, bf16), GDN state "
          f"{cb['gdn_recurrent_bytes'] / 2**20:.1f} MiB (fp32) + conv {cb['gdn_conv_bytes'] / 2**20:.2f} MiB")
    return {"model": cfg.name, "params": pc, "cache_bytes_per_sequence": cb}


def cmd_demo(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from qwen35.config import get_preset
    from qwen35.gdn import GatedDeltaNet
    from qwen35.utils import env_summary

    print(env_summary())
    out = cmd_info(args)
    cfg = get_preset(args.model)
    layer = GatedDeltaNet(cfg, rngs=nnx.Rngs(args.seed))
    B, T, D = args.batch, args.prompt_len, args.decode_steps
    x = jax.random.normal(jax.random.key(args.seed + 1), (B, T + D, cfg.hidden_size), jnp.float32)
    graphdef, params = nnx.split(layer)  # pure function of (params, inputs): no module traversal per call
    step = jax.jit(lambda p, x, s: nnx.merge(graphdef, p)(x, s))

    t0 = time.perf_counter()
    y_ref, _ = jax.block_until_ready(step(params, x, None))  # one prefill over everything (reference)
    y_pre, state = jax.block_until_ready(step(params, x[:, :T], None))
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    y_pre, state = jax.block_until_ready(step(params, x[:, :T], None))
    t_prefill = time.perf_counter() - t0
    ys = []
    y1, state = step(params, x[:, T:T + 1], state)  # compile the decode step
    ys.append(y1)
    t0 = time.perf_counter()
    for i in range(1, D):
        y1, state = step(params, x[:, T + i:T + i + 1], state)
        ys.append(y1)
    jax.block_until_ready(state)
    t_decode = (time.perf_counter() - t0) / max(D - 1, 1)
    err = float(jnp.max(jnp.abs(jnp.concatenate([y_pre] + ys, axis=1) - y_ref)))
    print(f"\nGatedDeltaNet layer ({cfg.name}): prefill B={B} x T={T} in {t_prefill * 1e3:.2f} ms "
          f"({B * T / t_prefill:,.0f} tok/s), decode {t_decode * 1e3:.3f} ms/step; compile {t_compile:.1f} s")
    print(f"prefill + {D} cached decode steps vs one long prefill: max |diff| = {err:.2e}")
    ok = err < 1e-3 and bool(np.isfinite(err))
    print("OK" if ok else "MISMATCH")
    out.update(gdn_demo={"prefill_ms": t_prefill * 1e3, "decode_ms_per_step": t_decode * 1e3, "max_abs_diff": err,
                         "ok": ok})
    if not ok:
        raise SystemExit(1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen35", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")

    def common(sp):
        sp.add_argument("--model", default="tiny", help="preset: tiny, qwen35-35b-a3b, qwen35-397b-a17b")
        sp.add_argument("--context", type=int, default=8192, help="context length for the memory napkin math")
        sp.add_argument("--json", default=None, help="also write the results as JSON to this path")

    d = sub.add_parser("demo", help="run the GDN layer on a preset (default command)")
    common(d)
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--prompt-len", type=int, default=100)
    d.add_argument("--decode-steps", type=int, default=8)
    d.add_argument("--seed", type=int, default=0)
    common(sub.add_parser("info", help="parameter and memory napkin math of a preset"))
    args = p.parse_args(argv)
    if args.cmd is None:
        args = p.parse_args(["demo", *(argv if argv is not None else sys.argv[1:])])
    out = {"demo": cmd_demo, "info": cmd_info}[args.cmd](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
