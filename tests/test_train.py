"""The training step (`qwen35.train`) and the small checkpoint trained with it (`qwen35.load_trained`).

The loss parts against numpy cross-entropies of the model's own logits; a few optimiser steps lower the loss; the
committed checkpoint loads in this package (with its MTP head) and in transformers with the same logits, and its
greedy continuation of a docstring prompt is text."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import assert_close, model_terms
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import qwen35
from qwen35 import train as T
from qwen35.parity import hf_text_config
from qwen35.weights import TRAINED


def numpy_ce(logits, targets):
    logits = np.asarray(logits, np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return float(np.mean(logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]))


def test_loss_parts_are_the_cross_entropies():
    cfg = qwen35.tiny(num_hidden_layers=4, mtp_num_hidden_layers=1)
    model = qwen35.Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0), mtp=True)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    with jax.default_matmul_precision("highest"):
        total, parts = T.loss_fn(model, jnp.asarray(ids))
        logits, _ = model(ids[:, :-1])
        h = model.final_hidden(model.forward_with_details(ids[:, :-1]))
        mtp_logits, _ = model.mtp_logits(h[:, :-1], jnp.asarray(ids[:, 1:-1]))
    np.testing.assert_allclose(float(parts["ce"]), numpy_ce(logits, ids[:, 1:]), rtol=1e-5)
    np.testing.assert_allclose(float(parts["mtp"]), numpy_ce(mtp_logits, ids[:, 2:]), rtol=1e-5)
    want = parts["ce"] + cfg.router_aux_loss_coef * parts["aux"] + T.MTP_LOSS_WEIGHT * parts["mtp"]
    np.testing.assert_allclose(float(total), float(want), rtol=1e-6)
    assert 1.9 < float(parts["aux"]) < 8.0  # between balanced (k = 2) and collapsed (E = 8)


@pytest.mark.timeout(300)
def test_a_few_steps_learn_a_repeating_text():
    """40 AdamW steps on a stream that repeats one 24-token phrase: both the next-token and the MTP loss fall far
    below a uniform guess (ln 512 = 6.2)."""
    cfg = qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                      mtp_num_hidden_layers=1)
    phrase = np.random.default_rng(1).integers(0, cfg.vocab_size, 24)
    tokens = np.tile(phrase, 200).astype(np.int32)
    _, history = T.train(cfg, tokens, steps=40, batch=4, seq=32, lr=1e-2, progress=False)
    first, last = history[0], history[-1]
    assert last[0] == 40 and first[2] > 5.5
    assert last[2] < 2.0 and last[4] < 3.0, history


def test_corpus_and_tokenizer():
    text = T.stdlib_corpus(max_bytes=200_000)
    assert len(text) == 200_000 and "Return" in text
    tok = T.train_tokenizer(text, 300)
    sample = text[1000:3000]
    assert tok.decode(tok.encode(sample).ids) == sample  # byte-level: every text round-trips
    assert tok.get_vocab_size() == 300


@pytest.fixture(scope="module")
def trained():
    return qwen35.load_trained()


def test_trained_checkpoint_loads_in_transformers_with_the_same_logits(trained):
    model, tok = trained
    assert model.mtp is not None and tok is not None
    info = json.loads((TRAINED / "training.json").read_text())
    assert info["steps"] > 0 and "machine" in info
    ids = np.asarray([tok.encode("Return a new list containing the items of the sequence").ids])
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(model(ids)[0])
    theirs_model = hf.Qwen3_5MoeForCausalLM.from_pretrained(TRAINED, config=hf_text_config(model.config),
                                                            dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = theirs_model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    assert_close(ours, theirs, terms=model_terms(model.config, ids.shape[1]), name="trained model vs transformers")


def test_trained_model_writes_text(trained):
    """Greedy continuation of a docstring opening: printable text of words, mostly letters and spaces, and the
    model predicts held-in docstring text far better than chance (ln 1024 = 6.9 nats)."""
    model, tok = trained
    prompt = tok.encode("Return the").ids
    out = np.asarray(qwen35.generate(model, [prompt], 24))[0]
    text = tok.decode([int(t) for t in out])
    letters = sum(c.isalpha() or c.isspace() for c in text)
    assert text.isprintable() or "\n" in text, text
    assert letters >= 0.7 * len(text) and len(text.split()) >= 3, text
    ids = np.asarray([tok.encode("Return a list of the lines in the string, breaking at line boundaries.").ids])
    logits = np.asarray(model(ids)[0])
    assert numpy_ce(logits[:, :-1], ids[:, 1:]) < 4.5
