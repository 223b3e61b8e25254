"""Logits parity with transformers' `Qwen3_5MoeForCausalLM` through real checkpoints.

Each test builds a tiny random model WITH transformers (norm weights, dt_bias and A_log randomised, so a
zero-initialised weight cannot hide a layout bug), `save_pretrained`s it, optionally rewrites the files into
another layout (fused experts, the released multimodal key layout, shards), loads them with
`qwen35.load_hf_checkpoint` and compares logits for a prefill of T = 70 (not a multiple of the GDN chunk 64),
4 cached decode steps and a 4-token continuation, against transformers running the same phases with its own
cache. On failure the message carries the per-layer divergence report (`qwen35.parity`).

Helpers here are shared with test_weights.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from helpers import assert_close, fp32_tol, model_terms
from safetensors.numpy import load_file, save_file

import qwen35
from qwen35 import parity
from qwen35.parity import divergence_report, hf_hidden_states

PREFILL, DECODE, CONT = 70, 4, 4
TOTAL = PREFILL + DECODE + CONT


def parity_tol(cfg, values, seq_len=TOTAL):
    """Two float32 evaluations of the whole decoder (the float32 rule over the decoder's chain, at the size of
    the values compared)."""
    return fp32_tol(max(float(np.max(np.abs(v))) for v in values), model_terms(cfg, seq_len))


# ------------------------------------------------------------------------------------------------------------
# Configs
def odd_config() -> qwen35.Qwen35Config:
    """Everything unequal that can be: Dk != Dv, I != Is, hidden 40, top-3, GQA 4:1, tied embeddings; one layer
    of each type (two layers keep the compile short)."""
    return qwen35.tiny(
        name="odd", hidden_size=40, num_hidden_layers=2, vocab_size=300,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=20,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=36,
        tie_word_embeddings=True,
    )


CONFIGS = {"tiny": qwen35.tiny, "odd": odd_config}


# ------------------------------------------------------------------------------------------------------------
# Building checkpoints with transformers
hf_config = parity.hf_text_config


def random_hf_model(cfg: qwen35.Qwen35Config, seed: int = 0):
    """A transformers model with every weight random (zero-initialised norms and constant dt_bias would let
    a wrong mapping of those tensors pass)."""
    torch.manual_seed(seed)
    hm = transformers.Qwen3_5MoeForCausalLM(hf_config(cfg)).eval()
    with torch.no_grad():
        for name, p in hm.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "norm" in name or name.endswith("dt_bias"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.05)
    return hm


def rewrite_fused(src: Path, dst: Path):
    """transformers saves experts per expert; write the same weights with fused experts."""
    shutil.copytree(src, dst)
    sd = load_file(src / "model.safetensors")
    out, experts = {}, {}
    for k, v in sd.items():
        parts = k.split(".")
        if ".mlp.experts." in k:  # model.layers.{i}.mlp.experts.{e}.{proj}.weight
            prefix, e, proj = ".".join(parts[:5]), int(parts[5]), parts[6]
            experts.setdefault(prefix, {}).setdefault(proj, {})[e] = v
        else:
            out[k] = v
    for prefix, projs in experts.items():
        E = len(projs["down_proj"])
        out[f"{prefix}.gate_up_proj"] = np.stack(
            [np.concatenate([projs["gate_proj"][e], projs["up_proj"][e]], 0) for e in range(E)])
        out[f"{prefix}.down_proj"] = np.stack([projs["down_proj"][e] for e in range(E)])
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def rewrite_multimodal(src: Path, dst: Path):
    """The released layout: `model.language_model.*`, vision tower and MTP head beside it, config nested."""
    shutil.copytree(src, dst)
    sd = load_file(src / "model.safetensors")
    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    out["model.visual.x"] = np.zeros((3, 5), np.float32)
    out["mtp.y"] = np.ones((7,), np.float32)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((src / "config.json").read_text())
    tie = text.pop("tie_word_embeddings")
    text["model_type"] = "qwen3_5_moe_text"
    top = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": tie}
    (dst / "config.json").write_text(json.dumps(top))
    return dst


# ------------------------------------------------------------------------------------------------------------
# The three phases, on both sides
def hf_phases(hm, ids: np.ndarray) -> list[np.ndarray]:
    """transformers: prefill, DECODE single-token steps, a CONT-token continuation, with its own cache."""
    t = torch.from_numpy(ids.astype(np.int64))
    outs = []
    with torch.no_grad():
        o = hm(t[:, :PREFILL], use_cache=True)
        outs.append(o.logits.float().numpy())
        pkv = o.past_key_values
        for i in range(PREFILL, PREFILL + DECODE):
            o = hm(t[:, i:i + 1], cache=pkv, use_cache=True)
            pkv = o.past_key_values
            outs.append(o.logits.float().numpy())
        o = hm(t[:, PREFILL + DECODE:TOTAL], cache=pkv, use_cache=True)
        outs.append(o.logits.float().numpy())
    return outs


def our_phases(model, ids: np.ndarray) -> list[np.ndarray]:
    cache = model.init_cache(ids.shape[0], TOTAL)
    outs = []
    lg, cache = model(ids[:, :PREFILL], cache)
    outs.append(np.asarray(lg))
    for i in range(PREFILL, PREFILL + DECODE):
        lg, cache = model(ids[:, i:i + 1], cache)
        outs.append(np.asarray(lg))
    lg, cache = model(ids[:, PREFILL + DECODE:TOTAL], cache)
    outs.append(np.asarray(lg))
    return outs


PHASES = ["prefill"] + [f"decode {i}" for i in range(DECODE)] + ["continuation"]


def assert_parity(model, hm, ids, ref_phases=None):
    ref_phases = ref_phases if ref_phases is not None else hf_phases(hm, ids)
    ours = our_phases(model, ids)
    atol = parity_tol(model.config, ref_phases)
    errs = [float(np.max(np.abs(a - b))) for a, b in zip(ours, ref_phases)]
    if max(errs) > atol:  # only then pay for the per-layer report
        prefill = ids[:, :PREFILL]
        report = divergence_report(model.forward_with_details(prefill), hf_hidden_states(hm, prefill),
                                   atol=atol / 10, layer_types=model.config.layer_types)
        table = ", ".join(f"{p}: {e:.2e}" for p, e in zip(PHASES, errs))
        pytest.fail(f"logits differ beyond {atol:.3g} ({table})\nprefill divergence report:\n{report}")
    return errs


# ------------------------------------------------------------------------------------------------------------
# Fixtures: one transformers model + saved checkpoint + reference logits per config
def make_hf_checkpoint(name: str, root: Path) -> dict:
    cfg = CONFIGS[name]()
    hm = random_hf_model(cfg, seed=1)
    path = root / "ckpt"
    hm.save_pretrained(path)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, TOTAL))
    return {"name": name, "cfg": cfg, "hm": hm, "path": path, "ids": ids, "ref": hf_phases(hm, ids)}


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_hf_checkpoint("tiny", tmp_path_factory.mktemp("hf_tiny"))


@pytest.fixture(scope="module")
def odd_ckpt(tmp_path_factory):
    return make_hf_checkpoint("odd", tmp_path_factory.mktemp("hf_odd"))


@pytest.fixture(params=list(CONFIGS))
def hf_ckpt(request):
    return request.getfixturevalue(f"{request.param}_ckpt")


LAYOUTS = {
    "per_expert": lambda src, dst: src,  # transformers 5.24 save_pretrained writes experts one by one
    "fused": rewrite_fused,
    "multimodal": rewrite_multimodal,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers(hf_ckpt, layout, tmp_path):
    path = LAYOUTS[layout](hf_ckpt["path"], tmp_path / layout)
    model = qwen35.load_hf_checkpoint(path, progress=False)
    assert model.config.tie_word_embeddings == (hf_ckpt["name"] == "odd")
    assert (model.lm_head is None) == model.config.tie_word_embeddings
    assert_parity(model, hf_ckpt["hm"], hf_ckpt["ids"], hf_ckpt["ref"])


def test_sharded_checkpoint_with_index(tiny_ckpt, tmp_path):
    hf_ckpt = tiny_ckpt
    path = tmp_path / "sharded"
    hf_ckpt["hm"].save_pretrained(path, max_shard_size="150KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    model = qwen35.load_hf_checkpoint(path, progress=False)
    assert_parity(model, hf_ckpt["hm"], hf_ckpt["ids"], hf_ckpt["ref"])


def test_divergence_report_names_the_broken_layer(odd_ckpt):
    """The report that failure messages carry: all rows tiny for a correct load, and a weight broken on purpose
    in one layer shows up first at exactly that layer."""
    cfg = odd_ckpt["cfg"]
    model = qwen35.load_hf_checkpoint(odd_ckpt["path"], progress=False)
    ids = odd_ckpt["ids"][:, :PREFILL]
    theirs = hf_hidden_states(odd_ckpt["hm"], ids)
    assert len(theirs) == cfg.num_hidden_layers + 1
    out = model.forward_with_details(ids)
    their_logits = odd_ckpt["hm"](torch.from_numpy(ids)).logits.detach()
    tol = parity_tol(cfg, theirs, PREFILL)  # the hidden states' bound (every layer's chain: the worst case)
    report = divergence_report(out, theirs, atol=tol, layer_types=cfg.layer_types, logits=(out.logits, their_logits))
    assert report.ok and report.first_divergent is None, str(report)
    assert report.logits_max_abs < parity_tol(cfg, [their_logits.numpy()], PREFILL), str(report)
    text = str(report)
    assert "layer 0 (GDN)" in text and "layer 1 (attention)" in text and "logits" in text

    w = model.model.layers[1].self_attn.o_proj.weight
    w.set_value(w.get_value() * 1.5)
    broken = divergence_report(model.forward_with_details(ids), theirs, atol=tol, layer_types=cfg.layer_types)
    assert not broken.ok
    assert broken.first_divergent == 2, str(broken)  # entry 0 is the embeddings: layer 1 is entry 2
    assert "first divergence" in str(broken) and "<-- first beyond atol" in str(broken)


def test_hf_hidden_states_convention(tiny_ckpt):
    """transformers' last hidden state is normed; hf_hidden_states hands back the raw last-layer output."""
    hf_ckpt = tiny_ckpt
    hm = hf_ckpt["hm"]
    ids = torch.from_numpy(hf_ckpt["ids"][:1, :10].astype(np.int64))
    with torch.no_grad():
        raw = hm(ids, output_hidden_states=True).hidden_states
    ours = hf_hidden_states(hm, ids)
    np.testing.assert_allclose(ours[-2], raw[-2].numpy())
    with torch.no_grad():
        normed = hm.model.norm(torch.from_numpy(ours[-1])).numpy()
    assert_close(normed, raw[-1].numpy(), terms=hm.config.hidden_size, name="normed last hidden state")

