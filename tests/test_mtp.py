"""The multi-token-prediction head (`qwen35.mtp`, `mtp.*`): its logits against the same composition built from
transformers' own Qwen3.5-MoE modules (decoder layer, zero-centred RMSNorm, rotary embedding, lm_head) with the
weights read back from a saved checkpoint; the cached call against the whole-sequence one; loading in every
layout, and what happens without the head."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import assert_close, model_terms
from safetensors.numpy import load_file, save_file
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import qwen35
from qwen35.parity import hf_text_config
from qwen35.weights import CheckpointError


def mtp_config():
    return qwen35.tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"),
                       mtp_num_hidden_layers=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = mtp_config()
    model = qwen35.Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(3), mtp=True)
    for _, var in nnx.to_flat_state(nnx.state(model.mtp, nnx.Param)):  # norms off zero, so they are exercised
        var.set_value(var.get_value() + 0.1 * jax.random.normal(jax.random.key(1), var.get_value().shape))
    path = qwen35.save_hf_checkpoint(model, tmp_path_factory.mktemp("mtp") / "fused")
    return cfg, model, path


def torch_mtp_logits(path, cfg, ids):
    """transformers' modules composed as vLLM's Qwen3.5 MTP model does: the main model's normed last hidden state
    at t and the embedding of token t + 1, each through its RMSNorm, concatenated (embedding first), fc, one
    full-attention decoder layer (causal, RoPE position t), the MTP norm, the shared lm_head."""
    tc = hf_text_config(cfg, attn_implementation="sdpa")
    main = hf.Qwen3_5MoeForCausalLM.from_pretrained(path, config=tc, dtype=torch.float32).eval()
    sd = {k: torch.from_numpy(v) for k, v in load_file(path / "model.safetensors").items() if k.startswith("mtp.")}
    layer = hf.Qwen3_5MoeDecoderLayer(tc, layer_idx=cfg.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in sd.items() if k.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = hf.Qwen3_5MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].load_state_dict({"weight": sd[f"mtp.{name}.weight"]})
    t_ids = torch.from_numpy(np.asarray(ids, np.int64))
    with torch.no_grad():
        h = main(t_ids, output_hidden_states=True, use_cache=False).hidden_states[-1][:, :-1]  # after model.norm
        e = main.model.embed_tokens(t_ids[:, 1:])
        u = torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](h)], -1) @ sd["mtp.fc.weight"].T
        pos = torch.arange(u.shape[1])[None].expand(u.shape[0], -1)
        v = layer(u, position_embeddings=main.model.rotary_emb(u, pos), position_ids=pos)
        return main.lm_head(norms["norm"](v)).numpy()


def test_mtp_logits_match_transformers_modules(saved):
    cfg, model, path = saved
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    with jax.default_matmul_precision("highest"):
        out = model.forward_with_details(ids)
        got, _ = model.mtp_logits(model.final_hidden(out)[:, :-1], jnp.asarray(ids[:, 1:]))  # token 9 unknown
        want = torch_mtp_logits(path, cfg, ids)
    assert got.shape == (2, 8, cfg.vocab_size)
    assert_close(got, want, terms=model_terms(cfg, 9) + cfg.hidden_size * 2, name="MTP logits vs transformers")


def test_mtp_cache_continues_the_sequence(saved):
    """Position by position through the MTP layer's own K/V cache (a prompt of 5, then 1, 1, 1) equals one call on
    the whole sequence."""
    cfg, model, _ = saved
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)))
    with jax.default_matmul_precision("highest"):
        h = model.final_hidden(model.forward_with_details(ids))
        whole, none = model.mtp_logits(h[:, :-1], ids[:, 1:])
        cache = model.mtp.init_cache(2, 16)
        parts = []
        for a, b in ((0, 5), (5, 6), (6, 7), (7, 8)):
            lg, cache = model.mtp_logits(h[:, a:b], ids[:, a + 1:b + 1], cache=cache, cache_index=a)
            parts.append(lg)
    assert none is None
    assert_close(jnp.concatenate(parts, 1), whole, terms=model_terms(cfg, 9), name="cached MTP vs whole")


def test_mtp_loads_in_every_layout_and_is_optional(saved, tmp_path):
    """Fused and per-expert, the released multimodal layout (`model.language_model.*` beside top-level `mtp.*`):
    the same MTP parameters. Without mtp=True the head is skipped; a checkpoint without `mtp.*` loads as before,
    and asking it for the head is a clear error, as is a model built without one."""
    cfg, model, path = saved
    want = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model.mtp, nnx.Param))}

    def same(loaded):
        got = {k: np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(loaded.mtp, nnx.Param))}
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))

    per = qwen35.save_hf_checkpoint(model, tmp_path / "per", expert_layout="per_expert")
    sd = load_file(per / "model.safetensors")
    assert "mtp.layers.0.mlp.experts.3.up_proj.weight" in sd
    mm = tmp_path / "multimodal"
    mm.mkdir()
    save_file({("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in sd.items()},
              mm / "model.safetensors")
    text = json.loads((per / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "architectures": ["X"],
                                                "tie_word_embeddings": text.pop("tie_word_embeddings"),
                                                "text_config": text}))
    for p in (path, per, mm):
        same(qwen35.load_hf_checkpoint(p, mtp=True, progress=False))
    plain = qwen35.load_hf_checkpoint(mm, progress=False)
    assert plain.mtp is None
    with pytest.raises(ValueError, match="mtp=True"):
        plain.mtp_logits(jnp.zeros((1, 1, cfg.hidden_size)), jnp.zeros((1, 1), jnp.int32))
    no_head = qwen35.save_hf_checkpoint(plain, tmp_path / "no_head")
    with pytest.raises(CheckpointError, match="no mtp.* tensors.*mtp=False"):
        qwen35.load_hf_checkpoint(no_head, mtp=True)
    assert qwen35.load_hf_checkpoint(no_head, progress=False).mtp is None
    with pytest.raises(ValueError, match="no MTP layer"):
        qwen35.Qwen35ForCausalLM(cfg.replace(mtp_num_hidden_layers=0), mtp=True)
