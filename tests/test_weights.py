"""Checkpoint loading and saving: the FP8 block format, bad checkpoints, save -> transformers, shards, dtypes,
the tokenizer, and the lazy top-level exports.

One small config (two layers, expert width 132 > 128 so FP8 blocks are partial) keeps every forward pass to one
compiled shape."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import F32_EPS, assert_close, assert_same_greedy, greedy_step_logits, model_terms
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as torch_save_file

import qwen35
from qwen35.model import Qwen35ForCausalLM
from qwen35.weights import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
B = 128  # FP8 block


def small_config() -> qwen35.Qwen35Config:
    return qwen35.tiny(
        name="fp8", hidden_size=40, num_hidden_layers=2, vocab_size=256,
        layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=132, shared_expert_intermediate_size=136,
    )


def random_model(cfg, seed=0, scale=0.05):
    """A model with every parameter random (norms, dt_bias and A_log included), filled from numpy: no eager jax
    initialisation (dozens of tiny compiles) and no zero-initialised weight to hide a mapping bug."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))))
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        name = ".".join(str(p) for p in path)
        shape = var.get_value().shape
        if name.endswith("linear_attn.norm.weight"):
            value = rng.uniform(0.5, 1.5, shape)
        elif len(shape) == 1:
            value = rng.uniform(-0.5, 0.5, shape)
        else:
            value = rng.normal(0.0, scale, shape)
        var.set_value(jnp.asarray(value, jnp.float32))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def params(model) -> dict[str, np.ndarray]:
    return {".".join(str(p) for p in path): np.asarray(v.get_value())
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A random model, its fp32 checkpoint (per-expert layout, as the official release) and its logits."""
    cfg = small_config()
    model = random_model(cfg)
    path = qwen35.save_hf_checkpoint(model, tmp_path_factory.mktemp("ref") / "ckpt", expert_layout="per_expert")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    logits = np.asarray(model(ids)[0])
    return {"cfg": cfg, "model": model, "path": path, "ids": ids, "logits": logits}


# ------------------------------------------------------------------------------------------------------------
# FP8: the test writes the official format itself and dequantises with its own (naive) reference
FP8_ELIGIBLE = ("mlp.experts.", "mlp.shared_expert.", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                "self_attn.o_proj", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")


def quantize_blocks(w: np.ndarray):
    """Per 128x128 block (edge blocks partial): scale = amax / 448, q = e4m3(w / scale)."""
    R, C = w.shape
    s = np.ones((-(-R // B), -(-C // B)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = np.abs(w[i * B:(i + 1) * B, j * B:(j + 1) * B]).max()
            s[i, j] = amax / 448.0 if amax > 0 else 1.0
    scaled = w / np.repeat(np.repeat(s, B, 0), B, 1)[:R, :C]
    q = torch.from_numpy(scaled.astype(np.float32)).to(torch.float8_e4m3fn)
    return q, s


def dequant_reference(q: torch.Tensor, s: np.ndarray) -> np.ndarray:
    """w[r, c] = q[r, c] * s[r // 128, c // 128], block by block."""
    qf = q.to(torch.float32).numpy()
    out = np.empty_like(qf)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * B:(i + 1) * B, j * B:(j + 1) * B] = qf[i * B:(i + 1) * B, j * B:(j + 1) * B] * s[i, j]
    return out


def write_fp8(src: Path, dst: Path, *, bf16_attention_scales=True):
    """Quantise the eligible weights of a per-expert fp32 checkpoint into fp8 + weight_scale_inv; return the
    numpy-dequantised tensors {name: array} (what the loader must produce) and write their fp32 checkpoint too."""
    sd = load_file(src / "model.safetensors")
    fp8, deq = {}, {}
    n_partial = 0
    for k, v in sd.items():
        if k.endswith(".weight") and any(p in k for p in FP8_ELIGIBLE):
            q, s = quantize_blocks(v)
            n_partial += (v.shape[0] % B != 0 and v.shape[0] > B) or (v.shape[1] % B != 0 and v.shape[1] > B)
            scale = torch.from_numpy(s)
            if bf16_attention_scales and "self_attn" in k:
                scale = scale.to(torch.bfloat16)
                s = scale.float().numpy()
            fp8[k], fp8[k + "_scale_inv"] = q, scale
            deq[k] = dequant_reference(q, s)
        else:
            fp8[k] = torch.from_numpy(v)
    assert n_partial > 0, "the config must exercise partial 128-blocks on a dim > 128"
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    torch_save_file(fp8, dst / "model.safetensors", metadata={"format": "pt"})
    deq_dir = dst.parent / (dst.name + "_dequantized")
    deq_dir.mkdir()
    shutil.copy(src / "config.json", deq_dir / "config.json")
    save_file({k: deq.get(k, v) for k, v in sd.items()}, deq_dir / "model.safetensors", metadata={"format": "pt"})
    return deq, deq_dir


def fuse(name: str) -> tuple[str, int, str] | None:
    parts = name.split(".")
    if ".mlp.experts." in name:
        return ".".join(parts[:5]), int(parts[5]), parts[6]
    return None


def test_fp8_block_checkpoint_dequantises_like_the_reference(ref, tmp_path):
    deq, deq_dir = write_fp8(ref["path"], tmp_path / "fp8")
    model = qwen35.load_hf_checkpoint(tmp_path / "fp8", progress=False)
    got = params(model)
    I = ref["cfg"].moe_intermediate_size
    for k, want in deq.items():  # every dequantised tensor equals the naive numpy dequant
        f = fuse(k)
        if f is None:
            have = got[k]
        else:
            prefix, e, proj = f
            if proj == "down_proj":
                have = got[f"{prefix}.down_proj"][e]
            else:
                gu = got[f"{prefix}.gate_up_proj"][e]
                have = gu[:I] if proj == "gate_proj" else gu[I:]
        assert_close(have, want, atol=0, rtol=DEQUANT_RTOL, name=k)
    reference = qwen35.load_hf_checkpoint(deq_dir, progress=False)
    lg, lg_ref = np.asarray(model(ref["ids"])[0]), np.asarray(reference(ref["ids"])[0])
    assert_close(lg, lg_ref, terms=model_terms(ref["cfg"], ref["ids"].shape[1]), name="logits")
    # and FP8 is a quantisation, not noise: close to the unquantised model on average (a routing flip may
    # move single logits more)
    assert np.mean(np.abs(lg - ref["logits"])) < 0.1 * np.mean(np.abs(ref["logits"]))


# a dequantised weight is one float32 product (fp8 value x block scale, the fp8 value exact in float32): within an
# ulp of each other however the product is formed
DEQUANT_RTOL = 2 * F32_EPS


def write_fused_fp8(src: Path, d: Path) -> dict[str, np.ndarray]:
    """The experts of a per-expert fp32 checkpoint fused to [E, 2I, H] / [E, H, I] and quantised per expert into
    fp8 + [E, ceil(R/128), ceil(C/128)] scales (everything else as it is); returns the naive dequantised experts."""
    sd = load_file(src / "model.safetensors")
    out, experts = {}, {}
    for k, v in sd.items():
        f = fuse(k)
        if f is None:
            out[k] = torch.from_numpy(v)
        else:
            experts.setdefault(f[0], {}).setdefault(f[2], {})[f[1]] = v
    want = {}
    for prefix, projs in experts.items():
        E = len(projs["down_proj"])
        for name, w in ((f"{prefix}.gate_up_proj", np.stack([np.concatenate([projs["gate_proj"][e],
                                                                                projs["up_proj"][e]]) for e in range(E)])),
                        (f"{prefix}.down_proj", np.stack([projs["down_proj"][e] for e in range(E)]))):
            qs = [quantize_blocks(w[e]) for e in range(E)]
            out[name] = torch.stack([q for q, _ in qs])
            out[name + "_scale_inv"] = torch.from_numpy(np.stack([s for _, s in qs]))
            assert out[name + "_scale_inv"].shape[1:] == (-(-w.shape[1] // B), -(-w.shape[2] // B))
            want[name] = np.stack([dequant_reference(q, s) for q, s in qs])
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    torch_save_file(out, d / "model.safetensors", metadata={"format": "pt"})
    return want


def test_fp8_fused_experts_with_stacked_scales(ref, tmp_path):
    """Fused [E, 2I, H] fp8 experts carry [E, ceil(2I/128), ceil(H/128)] scales."""
    want = write_fused_fp8(ref["path"], tmp_path / "fused_fp8")
    got = params(qwen35.load_hf_checkpoint(tmp_path / "fused_fp8", progress=False))
    for name, w in want.items():
        assert_close(got[name], w, atol=0, rtol=DEQUANT_RTOL, name=name)


def expert_arrays(model, layer=0):
    ex = model.model.layers[layer].mlp.experts
    return {n: np.asarray(getattr(ex, n)[...]) for n in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv",
                                                          "down_proj_scale_inv") if hasattr(ex, n)}


def test_fp8_keep_fused_experts_stay_fp8_and_give_the_dequantised_logits(ref, tmp_path):
    """fp8="keep" keeps the routed experts as float8_e4m3fn + float32 block scales (a quarter of the fp32 bytes;
    partial 128-blocks, as I = 132 here) and dequantises them on use: prefill and cached-decode logits equal
    those of the same checkpoint loaded with fp8="dequantize"; everything else is loaded as before."""
    want = write_fused_fp8(ref["path"], tmp_path / "fused_fp8")
    kept = qwen35.load_hf_checkpoint(tmp_path / "fused_fp8", fp8="keep", progress=False)
    deq = qwen35.load_hf_checkpoint(tmp_path / "fused_fp8", progress=False)
    ex = expert_arrays(kept)
    assert ex["gate_up_proj"].dtype == ml_dtypes.float8_e4m3fn and ex["down_proj"].dtype == ml_dtypes.float8_e4m3fn
    cfg = ref["cfg"]
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert ex["gate_up_proj_scale_inv"].shape == (E, -(-2 * I // B), -(-H // B))
    assert ex["down_proj_scale_inv"].shape == (E, -(-H // B), -(-I // B))
    assert ex["gate_up_proj"].nbytes * 4 == np.asarray(deq.model.layers[0].mlp.experts.gate_up_proj[...]).nbytes
    assert_close(  # the model's own dequantisation is the test's naive one
        np.asarray(qwen35.moe.fp8_dequantize(ex["gate_up_proj"], ex["gate_up_proj_scale_inv"], jnp.float32)),
        want["model.layers.0.mlp.experts.gate_up_proj"], atol=0, rtol=DEQUANT_RTOL)
    pk, pd = params(kept), params(deq)
    for name in pd:
        if ".mlp.experts." not in name:
            np.testing.assert_array_equal(pk[name], pd[name], err_msg=name)
    ids = ref["ids"]
    ck, cd = kept.init_cache(2, 20), deq.init_cache(2, 20)
    for sl in (slice(0, 15), slice(15, 16)):  # prefill, then one cached decode step
        lk, ck = kept(ids[:, sl], cache=ck)
        ld, cd = deq(ids[:, sl], cache=cd)
        assert_close(lk, ld, terms=model_terms(cfg, 16), name=f"logits of tokens {sl.start}:{sl.stop}")
    # gate and up rows share a scale block at I = 132: per-expert tensors cannot carry that, so saving them refuses
    with pytest.raises(ValueError, match="expert_layout='fused'"):
        qwen35.save_hf_checkpoint(kept, tmp_path / "per_expert", expert_layout="per_expert")
    # ... but dequantised (with a dtype) they can: each expert is dequantised whole, then split into gate and up
    back = qwen35.load_hf_checkpoint(qwen35.save_hf_checkpoint(kept, tmp_path / "per_expert_f32", dtype=jnp.float32,
                                                               expert_layout="per_expert"), progress=False)
    np.testing.assert_array_equal(expert_arrays(back)["gate_up_proj"], expert_arrays(deq)["gate_up_proj"])
    # a checkpoint without FP8 experts loads as with "dequantize"
    plain = qwen35.load_hf_checkpoint(ref["path"], fp8="keep", progress=False)
    assert expert_arrays(plain)["gate_up_proj"].dtype == np.float32


def test_fp8_keep_per_expert_round_trips_through_save(tmp_path):
    """The official per-expert layout kept in FP8 (I = 256: gate and up fill whole scale blocks): the same logits
    and greedy tokens as the dequantised load; `save_hf_checkpoint` writes FP8 + scales back (fused or per expert)
    bit for bit, or dequantised with `dtype`."""
    cfg = small_config().replace(moe_intermediate_size=256)
    model = random_model(cfg, seed=1)
    src = qwen35.save_hf_checkpoint(model, tmp_path / "fp32", expert_layout="per_expert")
    write_fp8(src, tmp_path / "fp8")
    kept = qwen35.load_hf_checkpoint(tmp_path / "fp8", fp8="keep", progress=False)
    deq = qwen35.load_hf_checkpoint(tmp_path / "fp8", progress=False)
    assert expert_arrays(kept)["gate_up_proj"].dtype == ml_dtypes.float8_e4m3fn
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
    assert_close(kept(ids)[0], deq(ids)[0], terms=model_terms(cfg, 9), name="logits, fp8 kept vs dequantised")
    got, want = qwen35.generate(kept, ids, 4), qwen35.generate(deq, ids, 4)
    for b in range(2):
        assert_same_greedy(got[b], want[b], greedy_step_logits(deq, ids[b], want[b]), model_terms(cfg, 13),
                           name=f"row {b}, fp8 kept vs dequantised")
    ex = expert_arrays(kept)
    for layout in ("fused", "per_expert"):
        again = qwen35.load_hf_checkpoint(qwen35.save_hf_checkpoint(kept, tmp_path / layout, expert_layout=layout),
                                          fp8="keep", progress=False)
        for name, a in expert_arrays(again).items():
            np.testing.assert_array_equal(a.view(np.uint8) if a.dtype.itemsize == 1 else a,
                                          ex[name].view(np.uint8) if a.dtype.itemsize == 1 else ex[name],
                                          err_msg=f"{layout}: {name}")
    flat = qwen35.load_hf_checkpoint(qwen35.save_hf_checkpoint(kept, tmp_path / "f32", dtype=jnp.float32),
                                     progress=False)
    np.testing.assert_array_equal(expert_arrays(flat)["down_proj"], expert_arrays(deq)["down_proj"])


def test_fp8_keep_refuses_what_it_cannot_keep(ref, tmp_path):
    """Per-expert FP8 gate/up rows that do not fill whole scale blocks (I = 132) cannot be fused with their scales:
    a clear error naming the fix; an unknown mode is a ValueError."""
    write_fp8(ref["path"], tmp_path / "fp8")
    with pytest.raises(CheckpointError, match="multiple of 128.*fp8='dequantize'"):
        qwen35.load_hf_checkpoint(tmp_path / "fp8", fp8="keep", progress=False)
    with pytest.raises(ValueError, match="fp8"):
        qwen35.load_hf_checkpoint(ref["path"], fp8="fp4")


def test_fp8_without_scales_is_reported(ref, tmp_path):
    write_fp8(ref["path"], tmp_path / "fp8")
    path = tmp_path / "fp8"
    sd = load_file_torch(path)
    del sd["model.layers.1.self_attn.q_proj.weight_scale_inv"]
    torch_save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj\.weight_scale_inv"):
        qwen35.load_hf_checkpoint(path, progress=False)


def load_file_torch(path: Path) -> dict:
    from safetensors.torch import load_file as tl

    return tl(path / "model.safetensors")


# ------------------------------------------------------------------------------------------------------------
# Bad checkpoints: every problem listed, before any data is read
@pytest.fixture
def no_reads(monkeypatch):
    """Fail the test if tensor data is read (validation must come first)."""
    import qwen35.weights as w

    calls = []
    orig = w._Reader.get
    monkeypatch.setattr(w._Reader, "get", lambda self, info: calls.append(info) or orig(self, info))
    return calls


def test_missing_unexpected_and_misshaped_are_listed_together(ref, tmp_path, no_reads):
    path = tmp_path / "bad"
    shutil.copytree(ref["path"], path)
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.0.linear_attn.A_log"]
    del sd["model.layers.1.mlp.experts.2.up_proj.weight"]
    sd["model.layers.0.linear_attn.extra.weight"] = np.zeros((2, 2), np.float32)
    sd["model.norm.weight"] = np.zeros((41,), np.float32)
    sd["model.layers.1.self_attn.q_proj.weight"] = sd["model.layers.1.self_attn.q_proj.weight"][:, :39]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as ei:
        qwen35.load_hf_checkpoint(path, progress=False)
    msg = str(ei.value)
    assert "2 missing" in msg and "1 unexpected" in msg and "2 mis-shaped" in msg, msg
    for s in ("model.layers.0.linear_attn.A_log", "model.layers.1.mlp.experts.2.up_proj.weight",
              "model.layers.0.linear_attn.extra.weight", "model.norm.weight: expected [40], found [41]",
              "model.layers.1.self_attn.q_proj.weight: expected [256, 40], found [256, 39]"):
        assert s in msg, f"{s!r} not in:\n{msg}"
    assert not no_reads


@pytest.mark.parametrize("change", ["moe_intermediate_size", "hidden_size", "num_experts", "tie_word_embeddings"])
def test_wrong_config_shows_up_as_tensor_problems(ref, tmp_path, change, no_reads):
    path = tmp_path / "wrongcfg"
    shutil.copytree(ref["path"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg[change] = {"moe_intermediate_size": 128, "hidden_size": 48, "num_experts": 3,
                   "tie_word_embeddings": True}[change]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as ei:
        qwen35.load_hf_checkpoint(path, progress=False)
    msg = str(ei.value)
    expect = {
        "moe_intermediate_size": "model.layers.0.mlp.experts.0.gate_proj.weight: expected [128, 40], found [132, 40]",
        "hidden_size": "model.embed_tokens.weight: expected [256, 48], found [256, 40]",
        "num_experts": "model.layers.0.mlp.experts.3.down_proj.weight (config.json has num_experts=3)",
        "tie_word_embeddings": "lm_head.weight (config.json has tie_word_embeddings=true",
    }[change]
    assert expect in msg, msg
    assert not no_reads


def test_sharded_index_problems(ref, tmp_path):
    path = qwen35.save_hf_checkpoint(ref["model"], tmp_path / "sh", max_shard_size_bytes=100_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        qwen35.load_hf_checkpoint(path, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(path / "config.json", empty / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        qwen35.load_hf_checkpoint(empty, progress=False)


def test_truncated_file_raises_and_returns_nothing(ref, tmp_path):
    """A file cut short passes the header check but fails while streaming: the error propagates, and since the
    module is only assembled after the last tensor, no half-loaded model exists."""
    path = tmp_path / "trunc"
    shutil.copytree(ref["path"], path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        qwen35.load_hf_checkpoint(path, progress=False)


# ------------------------------------------------------------------------------------------------------------
# Saving
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_save_loads_in_transformers_with_same_logits(ref, tmp_path, layout):
    path = qwen35.save_hf_checkpoint(ref["model"], tmp_path / layout, expert_layout=layout)
    names = json.loads((path / "config.json").read_text())
    assert names["architectures"] == ["Qwen3_5MoeForCausalLM"]
    hm = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        theirs = hm(torch.from_numpy(ref["ids"])).logits.numpy()
    assert_close(theirs, ref["logits"], terms=model_terms(ref["cfg"], ref["ids"].shape[1]), name="transformers logits")
    # transformers' state dict is exactly our weights
    sd = hm.state_dict()
    for name, value in params(ref["model"]).items():
        np.testing.assert_array_equal(sd[name].numpy(), value, err_msg=name)


def test_save_per_expert_sharded_and_load_again(ref, tmp_path):
    path = qwen35.save_hf_checkpoint(ref["model"], tmp_path / "s", expert_layout="per_expert",
                                     max_shard_size_bytes=150_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((path / f).exists() for f in files)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in index["weight_map"]
    assert not (path / "model.safetensors").exists()
    model = qwen35.load_hf_checkpoint(path, progress=False)
    want = params(ref["model"])
    for name, value in params(model).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    assert_close(model(ref["ids"])[0], ref["logits"], terms=model_terms(ref["cfg"], ref["ids"].shape[1]), name="logits")
    # saving again into the same folder (fused, single file) removes the old shards
    qwen35.save_hf_checkpoint(model, path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


def test_bf16_save_and_load(ref, tmp_path):
    path = qwen35.save_hf_checkpoint(ref["model"], tmp_path / "bf16", dtype=jnp.bfloat16)
    header_len = int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((path / "model.safetensors").read_bytes()[8:8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    model = qwen35.load_hf_checkpoint(path, dtype=jnp.bfloat16, progress=False)
    want = params(ref["model"])
    for name, value in params(model).items():
        assert value.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(value, want[name].astype(ml_dtypes.bfloat16), err_msg=name)
    m32 = qwen35.load_hf_checkpoint(path, param_dtype=jnp.float32, dtype=jnp.float32, progress=False)
    assert all(v.dtype == np.float32 for v in params(m32).values())


def test_shardings_callable_places_each_tensor(ref):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    seen = []

    def shardings(name, shape):
        seen.append(name)
        return NamedSharding(mesh, P("x")) if name.endswith("gate_up_proj") else None

    model = qwen35.load_hf_checkpoint(ref["path"], shardings=shardings, progress=False)
    assert set(seen) == set(params(ref["model"]))
    gu = model.model.layers[0].mlp.experts.gate_up_proj.get_value()
    assert gu.sharding.spec == P("x") and len(gu.sharding.device_set) == 2


# ------------------------------------------------------------------------------------------------------------
def test_load_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "qwen": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = qwen35.load_tokenizer(tmp_path)
    assert loaded.encode("hello qwen world again").ids == [1, 3, 2, 0]
    assert qwen35.load_tokenizer(tmp_path / "tokenizer.json").encode("world").ids == [2]
    assert qwen35.load_tokenizer(tmp_path / "nothing_here") is None


def test_lazy_top_level_exports():
    code = (
        "import sys, qwen35; assert 'jax' not in sys.modules, 'import qwen35 pulled in jax';"
        "names = ('load_hf_checkpoint', 'save_hf_checkpoint', 'load_tokenizer');"
        "assert all(n in dir(qwen35) for n in names);"
        "import qwen35.weights as w;"
        "assert all(getattr(qwen35, n) is getattr(w, n) for n in names); print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
