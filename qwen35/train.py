"""Train a small Qwen3.5-MoE on this machine, so the notebooks and tests can show words instead of random ids.

    python -m qwen35.train --out qwen35/assets/stdlib-small    # the committed checkpoint: 1,000 steps, <= 10 min

The text is the docstrings of Python's own standard library, read from its source files with `ast` (nothing is
imported or downloaded; every machine with Python has them; a different Python version gives a slightly
different corpus). A byte-level BPE (`tokenizers`, 1,024 tokens) is trained on it, then the `stdlib_small`
preset (about 2.6 million parameters, the [L, L, L, F] pattern, 8 experts top-2) with AdamW on

    loss = next-token cross-entropy + router_aux_loss_coef · load-balancing loss + mtp_loss_weight · MTP loss,

the MTP loss being the multi-token-prediction head's cross-entropy on the token after next (`qwen35.mtp`).
The result is a Hugging Face folder (config.json, model.safetensors in bfloat16, tokenizer.json) that
`load_hf_checkpoint` (with or without mtp=True) and transformers load, and the loss curve as a figure.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from qwen35.config import Qwen35Config
from qwen35.execution import Execution
from qwen35.model import Qwen35ForCausalLM
from qwen35.moe import load_balancing_loss

__all__ = ["stdlib_small", "stdlib_corpus", "train_tokenizer", "loss_fn", "train", "MTP_LOSS_WEIGHT"]

MTP_LOSS_WEIGHT = 0.3  # the MTP head's share of the loss (a drafter, not the model: a smaller weight)


def stdlib_small(**overrides) -> Qwen35Config:
    """The trained model's shape: 2.3M parameters (with its MTP layer), both layer types, grouped GDN value heads, GQA, 8 experts top-2,
    a shared expert, one MTP layer, tied embeddings (half the checkpoint otherwise)."""
    kw = dict(name="stdlib-small", hidden_size=160, num_hidden_layers=4, vocab_size=1024,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              num_attention_heads=4, num_key_value_heads=2, head_dim=40, partial_rotary_factor=0.25,
              max_position_embeddings=2048, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
              shared_expert_intermediate_size=160, tie_word_embeddings=True, mtp_num_hidden_layers=1,
              router_aux_loss_coef=0.01)
    kw.update(overrides)
    return Qwen35Config(**kw).validate()


def stdlib_corpus(max_bytes: int = 4_000_000) -> str:
    """Docstrings of the standard library's modules, classes and functions (sorted file order, deterministic
    for one Python version), separated by blank lines; test suites and vendored packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if any(p in ("test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__") for p in rel):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    out.append(doc.strip())
                    size += len(doc) + 2
        if size >= max_bytes:
            break
    return "\n\n".join(out)[:max_bytes]


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE (`tokenizers`): every byte is a token to begin with, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer)
    return tok


def loss_fn(model: Qwen35ForCausalLM, ids: jax.Array, mtp_weight: float = MTP_LOSS_WEIGHT):
    """(total loss, parts) on a batch ids [B, T]: next-token cross-entropy, the router's load-balancing loss
    (weighted by `config.router_aux_loss_coef`), and with an MTP head its cross-entropy on the token after next."""
    out = model.forward(ids[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, ids[:, 1:]).mean()
    c = model.config
    aux = load_balancing_loss(out.router_logits, c.num_experts, c.num_experts_per_tok)
    total = ce + c.router_aux_loss_coef * aux
    mtp = jnp.zeros((), jnp.float32)
    if model.mtp is not None:  # h_t and token t + 1 -> token t + 2
        h = model.final_hidden(out)[:, :-1]
        logits, _ = model.mtp_logits(h, ids[:, 1:-1])
        mtp = optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 2:]).mean()
        total = total + mtp_weight * mtp
    return total, {"ce": ce, "aux": aux, "mtp": mtp}


def train(config: Qwen35Config, tokens: np.ndarray, *, steps: int = 1000, minutes: float = 10.0, batch: int = 16,
          seq: int = 128, lr: float = 3e-3, seed: int = 0, progress: bool = True):
    """AdamW (warmup, then cosine decay over `steps`) on random windows of `tokens`, for `steps` steps or until
    `minutes` pass, whichever comes first. Returns (model, history: list of (step, seconds, ce, aux, mtp)). The experts use the dense path,
    which is differentiable and the fastest for 8 small experts."""
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(seed), mtp=config.mtp_num_hidden_layers > 0,
                              execution=Execution(experts="dense"))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10), steps, lr / 10)
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.05)),
                        wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, ids):
        (loss, parts), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, ids)
        opt.update(model, grads)
        return loss, parts

    rng = np.random.default_rng(seed)
    history, t0, i = [], time.time(), 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, unit="step", desc="training", file=sys.stderr)
    while i < steps and time.time() - t0 < minutes * 60:
        starts = rng.integers(0, len(tokens) - seq - 1, batch)
        ids = jnp.asarray(np.stack([tokens[s:s + seq + 1] for s in starts]), jnp.int32)
        loss, parts = step(model, opt, ids)
        i += 1
        if i % 25 == 0 or i == 1 or i == steps:
            p = {k: float(v) for k, v in parts.items()}
            history.append((i, time.time() - t0, p["ce"], p["aux"], p["mtp"]))
            if bar is not None:
                bar.n = i
                bar.set_postfix(step=i, ce=f"{p['ce']:.3f}", mtp=f"{p['mtp']:.3f}")
                bar.refresh()
    if bar is not None:
        bar.close()
    return model, history


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="qwen35/assets/stdlib-small")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=10.0, help="stop earlier when this much time has passed")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--figure", default="figures/stdlib_small_loss.png")
    args = ap.parse_args(argv)
    from qwen35.weights import save_hf_checkpoint

    config = stdlib_small()
    text = stdlib_corpus()
    tok = train_tokenizer(text, config.vocab_size)
    tokens = np.asarray(tok.encode(text).ids, np.int32)
    print(f"corpus: {len(text):,} characters of standard-library docstrings (Python "
          f"{sys.version.split()[0]}), {len(tokens):,} tokens of a {tok.get_vocab_size()}-token BPE")
    model, history = train(config, tokens, steps=args.steps, minutes=args.minutes, batch=args.batch, seq=args.seq, seed=args.seed)
    out = Path(args.out)
    model.config = model.config.replace(eos_token_id=tok.token_to_id("<|endoftext|>"))
    save_hf_checkpoint(model, out, dtype=jnp.bfloat16)
    tok.save(str(out / "tokenizer.json"))
    steps = [h[0] for h in history]
    (out / "training.json").write_text(json.dumps({
        "corpus_characters": len(text), "tokens": int(len(tokens)), "python": sys.version.split()[0],
        "batch": args.batch, "seq": args.seq, "steps": steps[-1] if steps else 0,
        "seconds": history[-1][1] if history else 0.0, "machine": _machine(),
        "history": [dict(zip(("step", "seconds", "ce", "aux", "mtp"), h)) for h in history]}, indent=1))
    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(steps, [h[2] for h in history], label="next token")
        ax.plot(steps, [h[4] for h in history], label="MTP (token after next)")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(f"{config.name}: {sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))):,} "
                     f"parameters on stdlib docstrings")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.figure, dpi=100)
    print(f"saved {out} after {steps[-1] if steps else 0} steps; final next-token loss {history[-1][2]:.3f}")
    return 0


def _machine() -> str:
    import platform

    return f"{platform.processor() or platform.machine()}, {jax.device_count()} {jax.default_backend()} device(s)"


if __name__ == "__main__":
    raise SystemExit(main())
