"""The serving engine: continuous vs static batching, decode step time vs batch size, page size 16 vs 256.

    python benchmarks/serving.py            # tiny preset, a few minutes on a 2-core CPU
    python benchmarks/serving.py --quick    # fewer requests, about a minute
    python benchmarks/serving.py --speculative [--quick]   # only section 5, on the trained model

1. Continuous vs static batching on a mixed-length workload (prompts 8–64 tokens, outputs 4–96), same model, same
   engine settings, one run: static batching admits the next batch of max_num_seqs requests only when the whole
   previous batch has finished (the slots of early finishers idle); continuous batching refills a slot as soon as
   it frees. Reported: output tokens/s of each and their ratio (the issue's target: >= 1.5x), the median over
   `--repeats` static/continuous pairs, each pair run interleaved step by step so both modes see the same
   machine (`serve_interleaved`), for 4 x and 16 x max_num_seqs requests (the first is
   dominated by filling and draining the batch; the second is nearer a server's steady state, and is the
   headline). Two static baselines: "static" keeps every slot of its batch until the batch is done, as a static
   server does (its steps have max_num_seqs rows: `min_batch_rows=max_num_seqs`; the headline compares with it),
   and "static, shrinking" runs the same admission rule on this engine, whose steps shrink to the rows still
   running (a power of two). On a weight-bound accelerator a decode step costs about the same for 2 or 16 rows,
   so the two coincide and the ratio approaches the ratio of steps; on a CPU a smaller step is cheaper, and the
   shrinking baseline is the stronger one. Continuous steps have the scheduled sequences' rows
   (min_batch_rows=1), at most max_num_seqs.
2. Decode step time vs batch size (figure figures/serving_decode_step.png): B sequences at a fixed context.
3. Page size 16 vs 256: the decode step time at the same batch and context.
4. The engine's decode tokens/s against the model's own jitted decode at the same batch (`engine_vs_model`; the
   `small` preset, 8 and 32 sequences, the engine's defaults): what serving machinery costs over a bare loop.
5. Speculative decoding (`--speculative`): the small model trained here (`qwen35.load_trained`, with its MTP head)
   at concurrency 1, 4 and 16, greedy, prompts cut from the standard library's docstrings (its training text):
   decode tokens/s with k = 1, 2, 3 drafts against k = 0 (the engines run interleaved step by step, as in 1), the
   acceptance rate and the tokens each sequence gains per step; the outputs of every k are checked equal.

Prints tables and saves JSON under `qwen35.utils.results_dir()` (serving_<backend>.json).
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from qwen35 import Qwen35ForCausalLM, get_preset
from qwen35.bench import machine_info, save_json
from qwen35.serving import Engine, SamplingParams
from qwen35.serving.workload import decode_step_time
from qwen35.utils import env_summary, figures_dir


def mixed_workload(n: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, size=int(rng.integers(8, 65))).tolist(),
             SamplingParams(max_tokens=int(rng.integers(4, 97)))) for _ in range(n)]


def _drive(engine: Engine, reqs, *, static: bool):
    """Run reqs to completion, yielding after every step; static: a new batch of max_num_seqs only when the engine
    is empty (its early finishers' slots idle until the whole batch is done)."""
    B = engine.max_num_seqs
    if static:
        for i in range(0, len(reqs), B):
            for p, sp in reqs[i:i + B]:
                engine.add_request(p, sp)
            while engine.has_unfinished():
                engine.step()
                yield
    else:
        for p, sp in reqs:
            engine.add_request(p, sp)
        while engine.has_unfinished():
            engine.step()
            yield


def _result(engine: Engine, reqs, seconds: float, steps: int) -> dict:
    n_out = sum(sp.max_tokens for _, sp in reqs)
    n_in = sum(len(p) for p, _ in reqs)
    return {"seconds": seconds, "steps": steps, "output_tokens": n_out, "output_tps": n_out / seconds,
            "total_tps": (n_in + n_out) / seconds}


def serve(engine: Engine, reqs, *, static: bool) -> dict:
    """Run reqs to completion alone; returns seconds, steps and tokens/s."""
    t0, steps0 = time.perf_counter(), engine.num_steps
    for _ in _drive(engine, reqs, static=static):
        pass
    return _result(engine, reqs, time.perf_counter() - t0, engine.num_steps - steps0)


def serve_interleaved(engines: dict, reqs, static=("static",)) -> dict:
    """The same reqs through several engines at once (e.g. a static and a continuous one: the engines named in
    `static` batch statically), one step of each in turn, each engine's time summed over its own steps (host
    work included).

    The two modes then see the same machine: a shared CPU's speed drifts by tens of percent over seconds, which
    back-to-back runs of a few seconds each turn into ratio noise of the same size. The engines share the model's
    weights; each has its own cache."""
    runs = {mode: _drive(e, reqs, static=(mode in static)) for mode, e in engines.items()}
    secs = dict.fromkeys(runs, 0.0)
    steps0 = {mode: e.num_steps for mode, e in engines.items()}
    while runs:
        for mode in list(runs):
            t0 = time.perf_counter()
            try:
                next(runs[mode])
            except StopIteration:
                del runs[mode]
            secs[mode] += time.perf_counter() - t0
    return {mode: _result(e, reqs, secs[mode], e.num_steps - steps0[mode]) for mode, e in engines.items()}


def make_engine(model, B, block_size=16, max_model_len=192, budget=256, min_batch_rows=1):
    return Engine(model, max_num_seqs=B, max_num_batched_tokens=max(budget, B), block_size=block_size,
                  max_model_len=max_model_len, min_batch_rows=min_batch_rows)


def decode_step_ms(model, B: int, context: int, block_size: int, steps: int) -> float:
    """Median decode step time with B sequences at about `context` tokens (after a warm-up run)."""
    n_out = steps + -(-B * context // 256) + 1  # the first admitted still decode when the last joins
    eng = make_engine(model, B, block_size, max_model_len=context + n_out + 8, budget=256)
    return decode_step_time(eng, B, context, n_out, seed=B)["step_s"] * 1e3


def engine_vs_model(model, B: int, prompt_len: int = 16, new_tokens: int = 64, rounds: int = 5) -> dict:
    """Decode tokens/s of the engine (its defaults, as a user gets them) against the model's own jitted decode
    (`model(tok, cache=cache)` per token, greedy) at the same batch B: B prompts of `prompt_len` tokens, then
    `new_tokens` decode steps each. Rounds alternate the two (a shared machine's drift cancels out of each round's
    ratio); the engine's step time is the median of its decode-only steps with all B sequences, the model's the
    mean over its decode loop. Returns both medians and the median of the per-round ratios."""
    import jax.numpy as jnp

    prompts = np.random.default_rng(B).integers(0, model.config.vocab_size, size=(B, prompt_len))

    def model_step():
        cache = model.init_cache(B, prompt_len + new_tokens)
        logits, cache = model(jnp.asarray(prompts), cache=cache)
        tok = jnp.argmax(logits[:, -1], -1)[:, None]
        jax.block_until_ready(tok)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            logits, cache = model(tok, cache=cache)
            tok = jnp.argmax(logits[:, -1], -1)[:, None]
        jax.block_until_ready(tok)
        return (time.perf_counter() - t0) / new_tokens

    engine = Engine(model, max_num_seqs=B)

    def engine_step():
        engine.history.clear()
        for p in prompts:
            engine.add_request(p.tolist(), SamplingParams(max_tokens=new_tokens))
        while engine.has_unfinished():
            engine.step()
        dec = [h["seconds"] for h in engine.history
               if len(h["rows"]) == B and all(k == "decode" for _, _, k in h["rows"])]
        return float(np.median(dec))

    model_step(), engine_step()  # compile
    runs = [(model_step(), engine_step()) for _ in range(rounds)]
    m, e = (float(np.median(x)) for x in zip(*runs))
    return {"batch": B, "model_step_ms": m * 1e3, "engine_step_ms": e * 1e3,
            "engine_over_model": float(np.median([a / b for a, b in runs])),
            "round_ratios": [round(a / b, 3) for a, b in runs]}


def speculative(concurrencies=(1, 4, 16), ks=(0, 1, 2, 3), new_tokens: int = 48, repeats: int = 3) -> list[dict]:
    """Section 5 (see the module docstring): one row per (concurrency, k)."""
    from qwen35 import load_trained
    from qwen35.train import stdlib_corpus

    model, tok = load_trained(mtp=True)
    docs = [d for d in stdlib_corpus(400_000).split("\n\n") if len(d) > 80]
    rng = np.random.default_rng(0)
    rows = []
    for B in concurrencies:
        reqs = [(tok.encode(docs[i]).ids[:8], SamplingParams(max_tokens=new_tokens))
                for i in rng.choice(len(docs), size=2 * B, replace=False)]

        def engines():
            return {k: Engine(model, max_num_seqs=B, max_num_batched_tokens=max(64, 4 * B), block_size=16,
                              max_model_len=128, speculative_tokens=k) for k in ks}

        def run(engs):  # every engine's own steps timed, the engines interleaved step by step
            return {k: r["seconds"] for k, r in serve_interleaved(engs, reqs, static=()).items()}

        warm = engines()
        for k, e in warm.items():  # untimed: compiles every shape, and gives each k's outputs
            outs = e.generate([p for p, _ in reqs], [sp for _, sp in reqs])
            if k == ks[0]:
                first = [o.token_ids for o in outs]
            elif [o.token_ids for o in outs] != first:
                raise AssertionError(f"speculative_tokens={k} changed the greedy output")
        timed = [(run(engs), engs) for engs in (engines() for _ in range(repeats))]
        n_out = sum(sp.max_tokens for _, sp in reqs)
        for k in ks:
            ratios = sorted(t[ks[0]] / t[k] for t, _ in timed)
            secs = float(np.median([t[k] for t, _ in timed]))
            e = timed[0][1][k]
            rows.append({"concurrency": B, "k": k, "seconds": secs, "output_tps": n_out / secs,
                         "speedup": ratios[len(ratios) // 2], "steps": e.num_steps,
                         "acceptance": e.num_accepted / e.num_drafted if e.num_drafted else None,
                         "tokens_per_seq_step": 1 + (e.num_accepted / e.num_drafted * k if e.num_drafted else 0)})
    print(f"\n5. speculative decoding, trained stdlib-small model, greedy, 8-token prompts, {new_tokens} new tokens, "
          f"2 x concurrency requests (median of {repeats} interleaved runs)")
    print(f"{'conc':>5}{'k':>3}{'steps':>7}{'accept':>8}{'tok/seq/step':>14}{'out tok/s':>11}{'vs k=0':>8}")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"{r['concurrency']:>5}{r['k']:>3}{r['steps']:>7}{acc:>8}{r['tokens_per_seq_step']:>14.2f}"
              f"{r['output_tps']:>11,.0f}{r['speedup']:>7.2f}x")
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=5, help="timed static/continuous pairs (the median pair is kept)")
    ap.add_argument("--vs-model-preset", default="small", help="the model of section 4 (engine vs model decode)")
    ap.add_argument("--skip-vs-model", action="store_true")
    ap.add_argument("--speculative", action="store_true", help="only section 5: speculative decoding with MTP drafts")
    args = ap.parse_args(argv)
    print(env_summary())
    if args.speculative:
        rows = speculative(concurrencies=(1, 4) if args.quick else (1, 4, 16), repeats=2 if args.quick else 3)
        out = {"machine": machine_info(), "speculative": rows}
        print(f"saved {save_json(out, args.json, f'serving_speculative_{jax.default_backend()}.json')}")
        return out
    model = Qwen35ForCausalLM(get_preset(args.preset), rngs=nnx.Rngs(0))
    V = model.config.vocab_size
    B = 8 if args.quick else 16

    # 1. continuous vs static batching ------------------------------------------------------------------------
    # Two runs of the same mixed-length workload: n = 4 x max_num_seqs requests, where filling and draining the
    # batch weigh heavily (the last requests run with a half-empty batch in both modes), and n = 16 x max_num_seqs,
    # closer to a server's steady state (the target is judged there).
    batching = {}
    STATIC = ("static", "static, shrinking")

    def engines():
        return {"static": make_engine(model, B, min_batch_rows=B), "static, shrinking": make_engine(model, B),
                "continuous": make_engine(model, B)}

    for n_req in ((4 * B,) if args.quick else (4 * B, 16 * B)):
        reqs = mixed_workload(n_req, V)
        serve_interleaved(engines(), reqs, static=STATIC)  # untimed: compiles every shape it meets
        # Shared machines drift by tens of percent over seconds: the modes run interleaved step by step (each
        # timed over its own steps), `--repeats` times; the median of the per-run ratios is kept (each mode's table
        # row is its run from the median one).
        runs = []
        for _ in range(args.repeats):
            run = serve_interleaved(engines(), reqs, static=STATIC)
            runs.append((run["continuous"]["output_tps"] / run["static"]["output_tps"], run))
        runs.sort(key=lambda x: x[0])
        ratio, res = runs[len(runs) // 2]
        shrink = float(np.median([r["continuous"]["output_tps"] / r["static, shrinking"]["output_tps"]
                                  for _, r in runs]))
        batching[n_req] = {"requests": n_req, "runs": res, "continuous_over_static": ratio,
                           "continuous_over_static_shrinking": shrink,
                           "pair_ratios": [round(r, 3) for r, _ in runs]}
        print(f"\n1. {n_req} requests (prompts 8-64, outputs 4-96 tokens), max_num_seqs {B}")
        print(f"{'batching':<19}{'seconds':>9}{'steps':>7}{'out tok/s':>11}")
        for mode, r in res.items():
            print(f"{mode:<19}{r['seconds']:>9.2f}{r['steps']:>7}{r['output_tps']:>11,.0f}")
        fewer = res["static"]["steps"] / res["continuous"]["steps"]
        print(f"continuous / static: {ratio:.2f}x output tokens/s ({fewer:.2f}x fewer steps); target >= 1.5x\n"
              f"continuous / static, shrinking: {shrink:.2f}x (the CPU's cheaper small steps)\n"
              f"(median of {len(runs)} interleaved runs; all: {', '.join(f'{r:.2f}' for r, _ in runs)})")
    steady = batching[max(batching)]

    # 2. decode step time vs batch size ------------------------------------------------------------------------
    batches = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32, 64)
    ctx, steps = 64, 12
    curve = [{"batch": b, "step_ms": decode_step_ms(model, b, ctx, 16, steps)} for b in batches]
    print(f"\n2. decode step time at context {ctx} (page size 16)")
    print(f"{'batch':>6}{'step ms':>9}{'tok/s':>9}")
    for c in curve:
        c["tokens_per_s"] = c["batch"] / c["step_ms"] * 1e3
        print(f"{c['batch']:>6}{c['step_ms']:>9.2f}{c['tokens_per_s']:>9,.0f}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    bs_ = [c["batch"] for c in curve]
    ax[0].plot(bs_, [c["step_ms"] for c in curve], "o-")
    ax[0].set(xscale="log", xlabel="sequences in the step", ylabel="decode step (ms)", title="step time")
    ax[1].plot(bs_, [c["tokens_per_s"] for c in curve], "o-", color="C1")
    ax[1].set(xscale="log", yscale="log", xlabel="sequences in the step", ylabel="output tokens/s",
              title="throughput")
    fig.suptitle(f"{args.preset} preset, {jax.default_backend()}: decode step vs batch (context {ctx})")
    fig.tight_layout()
    fig_path = figures_dir() / "serving_decode_step.png"
    fig.savefig(fig_path, dpi=120)
    print(f"figure: {fig_path}")

    # 3. page size 16 vs 256 ------------------------------------------------------------------------------------
    Bp, ctxp = (8, 96) if args.quick else (16, 160)
    pages = {ps: decode_step_ms(model, Bp, ctxp, ps, steps) for ps in (16, 256)}
    print(f"\n3. decode step, batch {Bp}, context {ctxp}: page 16 {pages[16]:.2f} ms, page 256 {pages[256]:.2f} ms "
          f"(256/16 = {pages[256] / pages[16]:.2f}x; the Ironwood post's Pallas kernel on v7x: 283/428 = 0.66x)")

    # 4. the engine's decode against the model's own --------------------------------------------------------------
    vs_model = []
    if not args.skip_vs_model:
        small = Qwen35ForCausalLM(get_preset(args.vs_model_preset), rngs=nnx.Rngs(0))
        print(f"\n4. decode tokens/s, the engine (defaults) over the model's own jitted decode, "
              f"{args.vs_model_preset} preset, 16-token prompts, 64 new tokens (target >= 0.8x)")
        print(f"{'batch':>6}{'model ms':>10}{'engine ms':>11}{'engine/model':>14}  per round")
        for b in ((8,) if args.quick else (8, 32)):
            r = engine_vs_model(small, b, rounds=3 if args.quick else 5)
            vs_model.append(r)
            print(f"{b:>6}{r['model_step_ms']:>10.1f}{r['engine_step_ms']:>11.1f}{r['engine_over_model']:>13.2f}x  "
                  f"{', '.join(f'{x:.2f}' for x in r['round_ratios'])}")

    out = {"machine": machine_info(), "preset": args.preset, "batching": steady["runs"], "engine_vs_model": vs_model,
           "continuous_over_static": steady["continuous_over_static"], "pair_ratios": steady["pair_ratios"],
           "continuous_over_static_shrinking": steady["continuous_over_static_shrinking"],
           "batching_by_requests": list(batching.values()), "decode_curve": curve, "page_size_step_ms": pages}
    print(f"saved {save_json(out, args.json, f'serving_{jax.default_backend()}.json')}")
    return out


if __name__ == "__main__":
    main()
