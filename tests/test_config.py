"""Qwen35Config: presets, parameter counts, reading HF config.json (text-only and multimodal), validation."""

import dataclasses
import json

import pytest
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig

from qwen35.parity import hf_text_config

import qwen35
from qwen35.config import FULL, LINEAR, ConfigError, Qwen35Config


def test_397b_param_counts_match_model_card():
    c = qwen35.qwen35_397b_a17b()
    p = c.param_counts()
    assert 396e9 <= p["total"] <= 397e9
    assert p["total"] == pytest.approx(396.35e9, rel=1e-4)
    assert p["active"] == pytest.approx(17.35e9, rel=1e-3)
    assert p["components"]["routed_experts"]["total"] == pytest.approx(386.5e9, rel=1e-3)
    assert sum(v["total"] for v in p["components"].values()) == p["total"]
    assert c.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 15
    cache = c.cache_bytes_per_sequence(8192)
    assert cache["kv_bytes_per_token"] == 30 * 1024  # 30 KiB per token in bf16
    assert cache["gdn_recurrent_bytes"] == 180 * 2**20  # 180 MiB per sequence in fp32


def test_param_counts_match_transformers_model():
    """Count the parameters of transformers' own model built from the tiny preset."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    for cfg in (qwen35.tiny(), qwen35.tiny(tie_word_embeddings=True, shared_expert_intermediate_size=24)):
        hc = hf_text_config(cfg)
        with torch.device("meta"):
            m = Qwen3_5MoeForCausalLM(hc)
        n = sum(p.numel() for p in m.parameters())  # parameters() lists a tied weight once
        assert cfg.param_counts()["total"] == n


def test_35b_preset():
    p = qwen35.qwen35_35b_a3b().param_counts()
    assert 34e9 < p["total"] < 36e9
    assert 2.5e9 < p["active"] < 3.5e9


def test_tiny_keeps_the_layout_traps():
    c = qwen35.tiny()
    assert LINEAR in c.layer_types and FULL in c.layer_types
    assert c.linear_key_head_dim != c.linear_value_head_dim
    assert c.linear_num_value_heads > c.linear_num_key_heads
    assert c.moe_intermediate_size != c.shared_expert_intermediate_size
    assert c.num_experts_per_tok > 1 and c.num_experts > c.num_experts_per_tok
    assert c.param_counts()["total"] < 2_000_000
    hash(c)  # frozen and hashable: usable as a static jit argument


def test_from_hf_text_config_roundtrip(tmp_path):
    ref = qwen35.tiny(rope_theta=1e6, tie_word_embeddings=True)
    hc = hf_text_config(ref)
    hc.save_pretrained(tmp_path)  # transformers writes the config.json
    got = Qwen35Config.from_hf(tmp_path)
    for f in dataclasses.fields(Qwen35Config):
        if f.name in ("name", "bos_token_id", "eos_token_id"):
            continue
        assert getattr(got, f.name) == getattr(ref, f.name), f.name
    assert Qwen35Config.from_hf(tmp_path / "config.json") == got


def test_from_hf_multimodal_release_form(tmp_path):
    """The released checkpoint nests text fields under text_config and rope fields under rope_parameters."""
    text = Qwen3_5MoeTextConfig(
        hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
        linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024, vocab_size=248320, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    )
    full = Qwen3_5MoeConfig(text_config=text.to_dict())
    d = full.to_dict()
    d["text_config"]["mtp_num_hidden_layers"] = 1
    d["some_future_field"] = {"x": 1}  # unknown fields are ignored
    (tmp_path / "config.json").write_text(json.dumps(d))
    got = Qwen35Config.from_hf(tmp_path)
    want = qwen35.qwen35_397b_a17b()
    for f in dataclasses.fields(Qwen35Config):
        if f.name in ("name", "bos_token_id", "eos_token_id"):
            continue
        assert getattr(got, f.name) == getattr(want, f.name), f.name
    assert got.param_counts() == want.param_counts()


def test_from_hf_old_style_rope_and_interval():
    d = qwen35.tiny().to_hf_dict()
    del d["rope_parameters"], d["layer_types"]
    d.update(rope_theta=5e5, partial_rotary_factor=0.5, full_attention_interval=2)
    c = Qwen35Config.from_hf(d)
    assert c.rope_theta == 5e5 and c.partial_rotary_factor == 0.5
    assert c.layer_types == (LINEAR, FULL) * 4


def test_from_hf_yarn():
    d = qwen35.tiny().to_hf_dict()
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "factor": 4.0,
                            "original_max_position_embeddings": 262144}
    c = Qwen35Config.from_hf(d)
    assert c.rope_scaling_dict == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
    hash(c)


def test_from_hf_missing_fields_is_a_clear_error(tmp_path):
    d = qwen35.tiny().to_hf_dict()
    del d["num_experts"], d["hidden_size"]
    with pytest.raises(ConfigError, match=r"missing required field\(s\) \['hidden_size', 'num_experts'\]"):
        Qwen35Config.from_hf(d)
    with pytest.raises(ConfigError, match="No config.json"):
        Qwen35Config.from_hf(tmp_path)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_attention_heads .* multiple of num_key_value_heads"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads .* multiple of"),
        (dict(layer_types=("linear_attention",) * 3), "layer_types has 3 entries but num_hidden_layers is 8"),
        (dict(layer_types=("linear_attention",) * 7 + ("mamba",)), "layer_types contains"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) cannot exceed num_experts \(8\)"),
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(partial_rotary_factor=0.3), "must be an even integer"),
        (dict(rope_scaling={"rope_type": "longrope"}), "not supported"),
    ],
)
def test_validate_names_field_and_fix(changes, match):
    with pytest.raises(ConfigError, match=match):
        qwen35.tiny(**changes)


def test_replace_validates():
    c = qwen35.tiny()
    assert c.replace(vocab_size=512).vocab_size == 512
    with pytest.raises(ConfigError):
        c.replace(num_experts=1)


@pytest.mark.parametrize("preset", ["tiny", "qwen35-397b-a17b"])
def test_mtp_param_counts_match_the_module(preset):
    """`param_counts()["mtp"]` counts the MTP head's parameters as built (abstractly: shapes only), outside
    `total`; a config without the head counts none."""
    import jax
    from flax import nnx

    from qwen35.model import Qwen35ForCausalLM

    cfg = qwen35.get_preset(preset).replace(mtp_num_hidden_layers=1)
    head = Qwen35ForCausalLM.abstract(cfg, mtp=True).mtp
    n = sum(x.size for x in jax.tree.leaves(nnx.state(head, nnx.Param)))
    p = cfg.param_counts()
    assert p["mtp"]["total"] == n
    E, k, I, H = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size
    assert p["mtp"]["active"] == n - (E - k) * 3 * I * H
    assert cfg.replace(mtp_num_hidden_layers=0).param_counts()["mtp"] == {"total": 0, "active": 0}
