"""`python -m qwen35`: the project's main job.

    python -m qwen35                 # the serving benchmark on the tiny preset (default; about a minute on CPU)
    python -m qwen35 bench --workload prefill-heavy|decode-heavy --concurrency 64 [--checkpoint PATH | --preset tiny]
                           [--scale S] [--json out.json]      # the Ironwood post's 8K/1K and 1K/8K workloads, TPS/chip
    python -m qwen35 generate --checkpoint PATH --prompt "..."  # stream one completion through the engine
    python -m qwen35 demo            # the Gated DeltaNet layer: chunked prefill + cached decode vs one prefill
    python -m qwen35 info --model qwen35-397b-a17b   # parameter and memory napkin math of a preset
    python -m qwen35 roofline --hardware tpu-v7x --chips 4 --concurrency 64 --input-len 1024 --output-len 8192

`bench` serves the workloads with `qwen35.serving.Engine` (continuous batching, paged hybrid cache) and prints
tokens per second per chip = (input + output tokens) / duration / chips, with output tokens/s and the mean time
per output token beside it. On a CPU it scales the lengths down 64x (128/16 and 16/128 tokens).
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
    if pc["mtp"]["total"]:
        print(f"{'+ MTP head':<16}{_fmt_params(pc['mtp']['total']):>12}{_fmt_params(pc['mtp']['active']):>14}"
              "   (the speculative drafter, beside the decoder)")
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


def cmd_roofline(args) -> dict:
    """First-principles decode/prefill/wave times and tokens/s/chip of a preset on a chip (`qwen35.roofline`)."""
    from qwen35 import roofline

    sc = roofline.Scenario.make(args.model, args.hardware, args.chips, args.layout, args.precision,
                                page_size=args.page_size, exchange=args.exchange)
    r = roofline.report(sc, args.concurrency, args.input_len, args.output_len)
    print(json.dumps(r, indent=2, default=float) if args.as_json else roofline.format_report(r))
    return r


def _add_roofline_parser(sub) -> None:
    from qwen35.config import PRESETS
    from qwen35.roofline import EXCHANGES, HARDWARE, LAYOUTS, PRECISIONS

    def positive(s: str) -> int:
        v = int(s)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
        return v

    r = sub.add_parser("roofline", help="first-principles roofline: decode step, prefill, tokens/s/chip")
    r.add_argument("--model", default="qwen35-397b-a17b", choices=sorted(PRESETS))
    r.add_argument("--hardware", default="tpu-v7x", choices=sorted(HARDWARE))
    r.add_argument("--chips", type=positive, default=4)
    r.add_argument("--concurrency", type=positive, default=64, help="sequences decoded together")
    r.add_argument("--input-len", type=positive, default=1024)
    r.add_argument("--output-len", type=positive, default=8192)
    r.add_argument("--layout", default="playbook", choices=sorted(LAYOUTS))
    r.add_argument("--precision", default="fp8", choices=sorted(PRECISIONS))
    r.add_argument("--page-size", type=positive, default=256, help="KV page (block) size in tokens")
    r.add_argument("--exchange", default="overlapped", choices=EXCHANGES,
                   help="the MoE exchange on the interconnect: hidden under the step, added to it, or ignored")
    r.add_argument("--json", dest="as_json", action="store_true", help="print the full breakdown as JSON")
    r.set_defaults(json=None)  # the shared --json PATH writer does not apply here


# -- serving: generate and bench (qwen35.serving) -------------------------------------------------------------
def _serving_model(args):
    """The model to serve: a checkpoint folder, or a preset with random weights (tiny/small on a CPU)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from qwen35.config import get_preset
    from qwen35.model import Qwen35ForCausalLM

    dtype = jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
    ep = args.expert_parallel
    if ep is None:  # a checkpoint on an accelerator host: its experts over every device (the Ironwood post's layout)
        ep = jax.device_count() if args.checkpoint and jax.default_backend() != "cpu" else 1
    if not 1 <= ep <= jax.device_count():
        raise SystemExit(f"--expert-parallel {ep}: this host has {jax.device_count()} devices")
    mesh = None
    if ep > 1:
        from qwen35.sharding import make_mesh

        mesh = make_mesh(expert=ep, devices=jax.devices()[:ep])
        print(f"experts split over {ep} devices (EP); attention data-parallel: one engine rank per device")
    if args.checkpoint:
        from qwen35.sharding import load_sharded
        from qwen35.weights import load_hf_checkpoint, load_tokenizer

        fp8 = args.fp8 or ("dequantize" if jax.default_backend() == "cpu" else "keep")
        if mesh is None:
            model = load_hf_checkpoint(args.checkpoint, dtype=dtype, fp8=fp8, progress=True)
        else:  # each tensor straight to its devices as it is read: no device ever holds the whole checkpoint
            model = load_sharded(args.checkpoint, mesh, dtype=dtype, fp8=fp8, progress=True)
        return model, load_tokenizer(args.checkpoint)
    model = Qwen35ForCausalLM(get_preset(args.preset), rngs=nnx.Rngs(args.seed), param_dtype=dtype)
    if mesh is not None:
        from qwen35.sharding import shard_model

        model = shard_model(model, mesh)
    return model, None


def _serving_common(sp) -> None:
    src = sp.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", default=None, help="Hugging Face checkpoint folder (config.json + safetensors)")
    src.add_argument("--preset", default="tiny", help="preset with random weights when no checkpoint (default tiny)")
    sp.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, else bfloat16)")
    sp.add_argument("--expert-parallel", type=int, default=None, metavar="N",
                    help="split the experts over N devices (EP) and serve attention data-parallel, one engine "
                         "rank per device. Default: every device for a checkpoint on an accelerator host, else 1 "
                         "(unsharded)")
    sp.add_argument("--fp8", choices=["keep", "dequantize"], default=None,
                    help="an FP8 checkpoint's experts: keep them FP8 with their block scales (half of bf16's "
                         "memory; default on an accelerator) or dequantise them on load (default on CPU)")
    sp.add_argument("--max-num-seqs", type=int, default=None,
                    help="sequences in flight per data-parallel rank (default: concurrency / ranks)")
    sp.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step and rank (Ironwood post: 1024)")
    sp.add_argument("--block-size", type=int, default=256, help="KV page size in tokens (Ironwood post: 256)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--json", default=None, help="also write the results as JSON to this path")


def cmd_generate(args) -> dict:
    from qwen35.serving import Engine, SamplingParams

    model, tok = _serving_model(args)
    prompt_ids = tok.encode(args.prompt).ids if tok is not None else None
    n_prompt = len(prompt_ids) if prompt_ids is not None else len(args.prompt.encode())
    engine = Engine(model, max_num_seqs=args.max_num_seqs or 1,
                    max_num_batched_tokens=args.max_num_batched_tokens or 1024, block_size=args.block_size,
                    max_model_len=min(model.config.max_position_embeddings, n_prompt + args.max_tokens + 1),
                    tokenizer=tok)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    print(args.prompt, end="", flush=True)
    ids = []
    for event in engine.stream(prompt_ids if prompt_ids is not None else args.prompt, params):
        ids += event.token_ids
        print(engine.tokenizer.decode(event.token_ids) if engine.tokenizer is not None else f" {event.token_ids}",
              end="", flush=True)
    print()
    if args.checkpoint is None:
        print(f"(preset {args.preset!r} with random weights: the text is noise; pass --checkpoint for a real model)")
    return {"prompt": args.prompt, "token_ids": ids}


def cmd_bench(args) -> dict:
    """The Ironwood post's workloads through the engine; a table of TPS/chip (input + output tokens / s / chip)."""
    import jax

    from qwen35.serving import Engine
    from qwen35.serving.workload import WORKLOADS, format_table, make_requests, run_workload
    from qwen35.utils import env_summary

    print(env_summary())
    model, _ = _serving_model(args)
    cpu = jax.default_backend() == "cpu"
    scale = args.scale or (64 if cpu and args.checkpoint is None else 1)
    workloads = [args.workload] if args.workload else sorted(WORKLOADS)
    conc = args.concurrency or ([8] if cpu else [64])
    budget = args.max_num_batched_tokens or (1024 if scale == 1 else 256)
    src = args.checkpoint or f"preset {args.preset} (random weights)"
    print(f"serving {src}: workloads {workloads}, concurrency {conc}, lengths / {scale}, "
          f"max_num_batched_tokens {budget}, block size {args.block_size}")
    ranks = getattr(getattr(model, "mesh", None), "size", 1)  # a sharded model: one engine rank per device
    rows = []
    for w in workloads:
        n_in, n_out = (max(1, n // scale) for n in WORKLOADS[w])
        for c in conc:
            seqs = args.max_num_seqs or -(-c // ranks)
            engine = Engine(model, max_num_seqs=seqs, max_num_batched_tokens=max(budget, seqs),
                            block_size=args.block_size, max_model_len=n_in + n_out + 1)
            # An untimed run of the same workload first: a step's shape follows its rows and context, so this
            # compiles every program the timed run meets (prefill blocks, and decodes as sequences finish).
            warm = make_requests(w, c * args.waves, scale, model.config.vocab_size, seed=args.seed + 1)
            for p, sp in warm:
                engine.add_request(p, sp)
            while engine.has_unfinished():
                engine.step()
            reqs = make_requests(w, c * args.waves, scale, model.config.vocab_size, seed=args.seed)
            r = run_workload(engine, reqs, desc=f"{w} c={c}")
            r.update(workload=w, concurrency=c, in_out=f"{n_in}/{n_out}")
            rows.append(r)
            print(format_table([r]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    print("TPS/chip = (input + output tokens) / duration / chips, the metric of the Google Developers Blog post on "
          "serving Qwen 3.5 MoE on Ironwood TPUs (its 4-chip v7x host at concurrency 64: 3,707 prefill-heavy, "
          "677 decode-heavy).")
    return {"scale": scale, "max_num_batched_tokens": budget, "block_size": args.block_size, "rows": rows}


def _add_serving_parsers(sub) -> None:
    g = sub.add_parser("generate", help="stream one completion through the serving engine")
    _serving_common(g)
    g.add_argument("--prompt", default="The quick brown fox")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    b = sub.add_parser("bench", help="serving benchmark: the Ironwood post's workloads, TPS/chip (default command)")
    _serving_common(b)
    b.add_argument("--workload", choices=["prefill-heavy", "decode-heavy"], default=None,
                   help="default: both")
    b.add_argument("--concurrency", type=int, nargs="+", default=None, help="one or more tiers (default 8 on CPU)")
    b.add_argument("--scale", type=int, default=None, help="divide the 8K/1K and 1K/8K lengths (default 64 on CPU)")
    b.add_argument("--waves", type=int, default=1, help="requests = concurrency x waves")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen35", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")

    def common(sp):
        sp.add_argument("--model", default="tiny", help="preset: tiny, qwen35-35b-a3b, qwen35-397b-a17b")
        sp.add_argument("--context", type=int, default=8192, help="context length for the memory napkin math")
        sp.add_argument("--json", default=None, help="also write the results as JSON to this path")

    d = sub.add_parser("demo", help="run the GDN layer on a preset")
    common(d)
    d.add_argument("--batch", type=int, default=2)
    d.add_argument("--prompt-len", type=int, default=100)
    d.add_argument("--decode-steps", type=int, default=8)
    d.add_argument("--seed", type=int, default=0)
    common(sub.add_parser("info", help="parameter and memory napkin math of a preset"))
    _add_roofline_parser(sub)
    _add_serving_parsers(sub)
    args = p.parse_args(argv)
    if args.cmd is None:
        args = p.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    out = {"demo": cmd_demo, "info": cmd_info, "roofline": cmd_roofline, "generate": cmd_generate,
           "bench": cmd_bench}[args.cmd](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
