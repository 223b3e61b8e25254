"""The serving engine's decode step on this machine's accelerator, against that device's HBM roofline.

    python benchmarks/engine_device.py --preset small --batches 1,8,32,128
    python benchmarks/engine_device.py --preset qwen35-35b-a3b --batches 1,16,64     # ~70 GB of bf16 weights

The model gets random bf16 weights, made on the device (no checkpoint, no host copy: a 35B model is ~70 GB).
For each batch B the engine prefills B prompts of `--context` tokens in one step, then decodes `--new-tokens`
tokens each; the figure is the median decode step with all B rows (after a first, compiling pass).

The roofline is the time to read, at the device's HBM bandwidth, what one decode step must read: the dense
weights, the routed experts the step's B·k slots are expected to touch (E · (1 − (1 − k/E)^B)), the KV pages of
B sequences and their GDN states (fp32, as the engine stores them, read and written back). Known chips take the
spec sheet (`qwen35.roofline.HARDWARE`); an unknown device (a CPU) a bandwidth measured here. The ratio
roofline / step is the fraction of the bandwidth bound the engine reaches.

Prints a table and saves JSON under `qwen35.utils.results_dir()` (engine_device_<preset>_<backend>.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35 import Qwen35ForCausalLM, get_preset
from qwen35.bench import machine_info, save_json
from qwen35.layers import abstract_init
from qwen35.roofline import PRECISIONS, Scenario, device_hardware
from qwen35.serving import Engine
from qwen35.serving.workload import decode_step_time
from qwen35.utils import env_summary


def random_model(config, dtype=jnp.bfloat16, seed: int = 0, std: float = 0.02):
    """The model with N(0, std²) weights made on the default device, one jitted generator per distinct shape:
    the model's own initialiser draws on the host, which for tens of billions of parameters takes minutes."""
    with abstract_init():
        abstract = nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0), param_dtype=dtype))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree.flatten(state)

    @jax.jit(static_argnums=(1, 2))
    def draw(key, shape, dt):
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dt)

    keys = jax.random.split(jax.random.key(seed), len(leaves))
    filled = [draw(k, tuple(x.shape), jnp.dtype(x.dtype)) for k, x in zip(keys, leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, filled))


def decode_step(model, B: int, context: int, new_tokens: int, block_size: int, fused, prefill_tokens=None) -> dict:
    """The engine's median decode step (`qwen35.serving.workload.decode_step_time`) with B sequences at about
    `context` tokens; the prompts are prefilled `prefill_tokens` tokens a step (None: all in one step)."""
    max_len = context + new_tokens + 8
    budget = max(B, min(B * context, prefill_tokens or B * context))
    eng = Engine(model, max_num_seqs=B, max_num_batched_tokens=budget, block_size=block_size,
                 max_model_len=max_len, min_batch_rows=B, min_page_width=-(-max_len // block_size), fused=fused)
    return {**decode_step_time(eng, B, context, new_tokens, seed=B), "fused": eng.fused}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--fused", choices=("auto", "yes", "no"), default="auto",
                    help="one program per step (the engine's default off CPU) or one per layer (compiles faster)")
    ap.add_argument("--prefill-tokens", type=int, default=None, help="tokens prefilled per step (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(env_summary())
    cfg = get_preset(args.preset)
    fused = {"auto": None, "yes": True, "no": False}[args.fused]
    t0 = time.perf_counter()
    model = random_model(cfg)
    jax.block_until_ready(nnx.state(model))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    print(f"{args.preset}: {n_params / 1e9:.2f} B parameters in bf16, made in {time.perf_counter() - t0:.1f} s")

    hw = device_hardware()
    # What the engine serves: bf16 weights and KV pages, the GDN state in fp32 (read and written back each step).
    served = dataclasses.replace(PRECISIONS["bf16"], name="engine-bf16", state_bytes=4)
    sc = Scenario(cfg, hw, chips=1, layout=dataclasses.replace(Scenario.make().layout, name="one-device",
                                                                experts="touched"),
                  precision=served, page_size=args.block_size, state_writeback=True)
    bw = sc.bandwidth_per_device
    print(f"roofline: {hw.name}, {bw / 1e12:.2f} TB/s HBM per device ({'measured' if hw.measured else 'spec sheet'})")
    print(f"\n{'batch':>6}{'step ms':>10}{'roofline ms':>13}{'of bound':>10}{'GB/step':>10}{'tok/s':>10}"
          f"{'1st pass s':>12}")
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        r = decode_step(model, B, args.context, args.new_tokens, args.block_size, fused, args.prefill_tokens)
        ctx = args.context + args.new_tokens / 2
        roof = sc.decode_step(B, ctx)
        r.update(batch=B, context=ctx, roofline_s=float(roof["memory_s"]), compute_s=float(roof["compute_s"]),
                 bytes={k: float(v) for k, v in roof["bytes"].items()},
                 fraction_of_bound=float(roof["memory_s"]) / r["step_s"], tokens_per_s=B / r["step_s"])
        rows.append(r)
        print(f"{B:>6}{r['step_s'] * 1e3:>10.2f}{r['roofline_s'] * 1e3:>13.2f}{r['fraction_of_bound']:>9.0%}"
              f"{r['bytes']['total'] / 1e9:>10.2f}{r['tokens_per_s']:>10,.0f}{r['first_pass_s']:>12.1f}", flush=True)
    out = {"machine": machine_info(), "preset": args.preset, "parameters": n_params, "hardware": hw.as_dict(),
           "context": args.context, "new_tokens": args.new_tokens, "block_size": args.block_size, "rows": rows}
    print(f"saved {save_json(out, args.json, f'engine_device_{args.preset}_{jax.default_backend()}.json')}")
    return out


if __name__ == "__main__":
    main()
