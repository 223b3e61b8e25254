"""Loading and saving Hugging Face safetensors checkpoints of Qwen3.5-MoE.

    model = qwen35.load_hf_checkpoint("path/to/checkpoint")         # config.json + *.safetensors
    qwen35.save_hf_checkpoint(model, "out/", expert_layout="per_expert", max_shard_size_bytes=2**30)
    tok = qwen35.load_tokenizer("path/to/checkpoint")                # tokenizer.json, or None

What the loader accepts (the layouts of the released checkpoints, huggingface.co/Qwen/Qwen3.5-397B-A17B and its
-FP8 release, and of transformers' `Qwen3_5MoeForCausalLM`):
  * one `model.safetensors`, or shards listed by `model.safetensors.index.json`;
  * the text-only key layout (`model.layers.*`, `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`)
    and the released multimodal layout (`model.language_model.*` -> `model.*`; `model.visual.*` is
    skipped, and `mtp.*`, the multi-token-prediction head, too unless `mtp=True` loads it);
  * experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`) or per expert
    (`mlp.experts.{e}.gate_proj.weight [I, H]`, `up_proj [I, H]`, `down_proj [H, I]`), which are written into a
    preallocated fused [E, ...] host buffer expert by expert as they stream in;
  * tied embeddings (`tie_word_embeddings`: no `lm_head.weight` in the file);
  * the official FP8 format: float8_e4m3fn weights with one float32/bf16 scale per 128x128 block,
    `<name>.weight_scale_inv` of shape [ceil(out/128), ceil(in/128)] (a leading [E] for fused experts), and
    w = fp8 * scale_inv over each block (the name is historical: DeepSeek-V3's `weight_dequant` and transformers'
    FineGrainedFP8 `Fp8Dequantize` both *multiply* by it). Partial edge blocks use the scale of their block.
    Dequantised on load (`fp8="dequantize"`), or, with `fp8="keep"`, the routed experts stay FP8 with their
    scales (fused to [E, 2I, H] / [E, H, I] beside [E, ...] scales) and are dequantised on use.

How it loads (memory): the model is first built abstractly with `nnx.eval_shape` (shapes only, no arrays), then
every expected tensor is checked against the safetensors headers (names, shapes, dtypes) BEFORE any data is read:
missing, unexpected and mis-shaped tensors are reported together in one `CheckpointError`. A config.json that does
not match the tensors shows up as mis-shaped tensors. Then tensors are read one at a time from a read-only memory
map of the file, converted (FP8 dequantisation, cast to `param_dtype`) and placed on device (`jax.device_put` with
`shardings(name, shape)` when given), so the host never holds the checkpoint twice. Only when every parameter is
in place is the module assembled (`nnx.merge`), so no half-loaded model is ever returned.

The safetensors format is simple enough to read and write directly: 8 bytes little-endian header length, a JSON
header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the raw row-major
bytes. Reading it ourselves (with `ml_dtypes` for bfloat16 / float8, which `safe_open(framework="numpy")` cannot
represent) gives a zero-copy memory map per file and validation from the header alone.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from qwen35.config import FP8_BLOCK, Qwen35Config
from qwen35.execution import Execution
from qwen35.model import Qwen35ForCausalLM

__all__ = [
    "CheckpointError",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "load_tokenizer",
    "read_safetensors_header",
    "fp8_block_dequantize",
    "fp8_block_quantize",
    "quantize_experts_fp8",
    "FP8_BLOCK",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_ST_TO_NP = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NP_TO_ST = {v: k for k, v in _ST_TO_NP.items()}
_FLOAT_ST = ("F64", "F32", "F16", "BF16")
_FP8_ST = ("F8_E4M3", "F8_E5M2")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config.json describes; the message lists every problem."""


# ------------------------------------------------------------------------------------------------------------
# safetensors files: headers and memory-mapped tensors
@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the safetensors header describes it."""

    file: Path
    dtype: str  # safetensors dtype string: "F32", "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_safetensors_header(file: str | os.PathLike) -> dict[str, TensorInfo]:
    """{name: TensorInfo} from a safetensors file's header (reads only the header bytes)."""
    file = Path(file)
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file} is not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(raw, "little")
        if n <= 0 or n > 100 * 2**20:
            raise CheckpointError(f"{file} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{file}: unreadable safetensors header ({e})") from None
    base = 8 + n
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        b, e = d["data_offsets"]
        out[name] = TensorInfo(file, d["dtype"], tuple(int(s) for s in d["shape"]), base + b, base + e)
    return out


class _Reader:
    """Read-only memory maps of the checkpoint's files, one tensor at a time (zero-copy views)."""

    def __init__(self):
        self._maps: dict[Path, np.memmap] = {}

    def get(self, info: TensorInfo) -> np.ndarray:
        if info.dtype not in _ST_TO_NP:
            raise CheckpointError(f"unsupported safetensors dtype {info.dtype} in {info.file}")
        mm = self._maps.get(info.file)
        if mm is None:
            mm = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        dt = _ST_TO_NP[info.dtype]
        count = math.prod(info.shape)
        if info.end - info.begin != count * dt.itemsize or info.end > mm.shape[0]:
            raise CheckpointError(f"{info.file}: tensor data of {info.shape} {info.dtype} is truncated or malformed")
        return mm[info.begin:info.end].view(dt).reshape(info.shape)

    def close(self):
        self._maps.clear()  # the maps close when the last view of them is gone


def _checkpoint_tensors(path: Path) -> dict[str, TensorInfo]:
    """All tensors of the checkpoint folder {name: TensorInfo}, from the index (if any) and the file headers."""
    index = path / INDEX_FILE
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing_files = [fn for fn in files if not (path / fn).exists()]
        if missing_files:
            raise CheckpointError(f"{index} lists shard file(s) that are not in {path}: {missing_files}")
        headers = {fn: read_safetensors_header(path / fn) for fn in files}
        out, problems = {}, []
        for name, fn in weight_map.items():
            if name not in headers[fn]:
                problems.append(f"  {name}: listed in the index under {fn}, but that file does not contain it")
            else:
                out[name] = headers[fn][name]
        if problems:
            raise CheckpointError(f"{index} does not match its shards:\n" + "\n".join(problems))
        return out
    if (path / SINGLE_FILE).exists():
        return read_safetensors_header(path / SINGLE_FILE)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors in {path}")
    out = {}
    for fn in files:
        for name, info in read_safetensors_header(fn).items():
            if name in out:
                raise CheckpointError(f"tensor {name} is in both {out[name].file.name} and {fn.name}")
            out[name] = info
    return out


# ------------------------------------------------------------------------------------------------------------
# FP8 block format
def _blocks(n: int, block: int = FP8_BLOCK) -> int:
    return -(-n // block)


def fp8_block_dequantize(w: np.ndarray, scale_inv: np.ndarray, out_dtype=np.float32, *, block: int = FP8_BLOCK,
                         out: np.ndarray | None = None) -> np.ndarray:
    """Dequantise block-scaled FP8: w [..., R, C] float8, scale_inv [..., ceil(R/b), ceil(C/b)];
    result[..., r, c] = float(w[..., r, c]) * scale_inv[..., r // b, c // b]. Leading dims are done one slice at a
    time (a fused [E, 2I, H] expert tensor never exists in float32 all at once)."""
    R, C = w.shape[-2:]
    if tuple(scale_inv.shape) != (*w.shape[:-2], _blocks(R, block), _blocks(C, block)):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not match weight {tuple(w.shape)} "
                         f"with {block}x{block} blocks")
    if out is None:
        out = np.empty(w.shape, out_dtype)
    for idx in np.ndindex(*w.shape[:-2]):
        s = np.asarray(scale_inv[idx], np.float32)
        s = np.repeat(np.repeat(s, block, axis=0)[:R], block, axis=1)[:, :C]
        out[idx] = (np.asarray(w[idx]).astype(np.float32) * s).astype(out.dtype)
    return out


def fp8_block_quantize(w: np.ndarray, *, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """The inverse, as the official release does it: per 128x128 block, scale_inv = amax / 448 (the float8_e4m3fn
    maximum) and q = float8(w / scale_inv). Returns (q [..., R, C] float8_e4m3fn, scale_inv float32)."""
    w = np.asarray(w, np.float32)
    R, C = w.shape[-2:]
    nr, nc = _blocks(R, block), _blocks(C, block)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, nr * block - R), (0, nc * block - C)]
    wp = np.pad(w, pad).reshape(*w.shape[:-2], nr, block, nc, block)
    amax = np.abs(wp).max(axis=(-3, -1))
    fmax = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    scale = np.where(amax > 0, amax / fmax, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale, block, axis=-2)[..., :R, :], block, axis=-1)[..., :C]
    q = np.clip(w / full, -fmax, fmax).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def quantize_experts_fp8(model: Qwen35ForCausalLM) -> Qwen35ForCausalLM:
    """A copy of `model` with its routed experts block-quantised to FP8 as the official release does it
    (`fp8_block_quantize`: float8_e4m3fn + one float32 scale per 128x128 block), everything else shared as it
    is. `save_hf_checkpoint` writes it in the official format: the way to make FP8 checkpoints to test and teach
    with. The original is untouched."""
    if model.placed:
        raise ValueError("quantize_experts_fp8 takes an unsharded model (quantise first, then shard it)")
    abstract = Qwen35ForCausalLM.abstract(model.config, param_dtype=model.model.embed_tokens.weight[...].dtype,
                                          dtype=model.dtype, execution=model.execution, fp8_experts=True,
                                          mtp=model.mtp is not None)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    dst = {".".join(map(str, path)): var for path, var in flat}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, value = ".".join(map(str, path)), var.get_value()
        if name + _SCALE_SUFFIX in dst:
            q, scale = fp8_block_quantize(np.asarray(jax.device_get(value), np.float32))
            value = jnp.asarray(q)
            dst[name + _SCALE_SUFFIX].set_value(jnp.asarray(scale))
        dst[name].set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ------------------------------------------------------------------------------------------------------------
# The load plan: which checkpoint tensors make each model parameter
_PER_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SKIP_PREFIXES = ("model.visual.", "visual.")
_MTP_PREFIX = "mtp."


def _normalise_key(key: str, mtp: bool = False) -> str | None:
    """Checkpoint key -> model key (None: skipped: the vision tower, and the MTP head unless `mtp`)."""
    if key.startswith(_SKIP_PREFIXES) or (key.startswith(_MTP_PREFIX) and not mtp):
        return None
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key.startswith("language_model."):  # some multimodal exports drop the leading "model."
        rest = key[len("language_model."):]
        return rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
    return key


@dataclass
class _Source:
    """A checkpoint tensor (and its FP8 scale, if any) feeding a slice of a model parameter."""

    key: str  # normalised name
    info: TensorInfo
    scale: TensorInfo | None = None
    # where it goes: None = the whole parameter; (e,) = expert e of a fused tensor; (e, slice) = rows of expert e
    index: tuple | None = None


@dataclass
class _Plan:
    sources: dict[str, list[_Source]] = field(default_factory=dict)  # param name -> sources
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)
    bad_dtype: list[str] = field(default_factory=list)


def _expected_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], _blocks(shape[-2]), _blocks(shape[-1]))


def _plan(expected: dict[str, tuple[int, ...]], tensors: dict[str, TensorInfo], config: Qwen35Config,
          mtp: bool = False) -> _Plan:
    plan = _Plan()
    # normalise names (keep the original for messages)
    by_key: dict[str, tuple[str, TensorInfo]] = {}
    for orig, info in tensors.items():
        k = _normalise_key(orig, mtp)
        if k is None:
            continue
        if k in by_key:
            plan.unexpected.append(f"{orig} (duplicate of {by_key[k][0]})")
            continue
        by_key[k] = (orig, info)
    used: set[str] = set()

    def shown(k: str) -> str:
        orig = by_key[k][0] if k in by_key else k
        return orig if orig == k else f"{orig} (as {k})"

    def take(k: str, shape: tuple[int, ...], param: str, index=None) -> bool:
        """Check tensor k (and its scale) against `shape`; add it as a source of `param`. False if absent."""
        if k not in by_key:
            return False
        used.add(k)
        _, info = by_key[k]
        scale = None
        if info.dtype in _FP8_ST:
            sk = k + "_scale_inv"
            if sk not in by_key:
                plan.missing.append(f"{sk} (the FP8 block scales of {k})")
            else:
                used.add(sk)
                scale = by_key[sk][1]
                want = _expected_scale_shape(shape)
                if scale.shape != want:
                    plan.misshaped.append(f"{shown(sk)}: expected {list(want)}, found {list(scale.shape)}")
                if scale.dtype not in _FLOAT_ST:
                    plan.bad_dtype.append(f"{shown(sk)}: dtype {scale.dtype} (scales must be float)")
        elif info.dtype not in _FLOAT_ST:
            plan.bad_dtype.append(f"{shown(k)}: dtype {info.dtype} (expected a float type)")
        if info.shape != shape:
            plan.misshaped.append(f"{shown(k)}: expected {list(shape)}, found {list(info.shape)}")
        plan.sources.setdefault(param, []).append(_Source(k, info, scale, index))
        return True

    E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
    for name, shape in expected.items():
        m = re.match(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m and name not in by_key:
            prefix, which = m.groups()
            per = [f"{prefix}.{e}.{p}.weight" for e in range(E)
                   for p in (("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",))]
            if not any(k in by_key for k in per):
                plan.missing.append(name + " (or its per-expert tensors)")
                continue
            for e in range(E):
                if which == "gate_up_proj":
                    ok_g = take(f"{prefix}.{e}.gate_proj.weight", (I, H), name, (e, slice(0, I)))
                    ok_u = take(f"{prefix}.{e}.up_proj.weight", (I, H), name, (e, slice(I, 2 * I)))
                    plan.missing += [f"{prefix}.{e}.{p}.weight" for p, ok in (("gate_proj", ok_g), ("up_proj", ok_u))
                                     if not ok]
                elif not take(f"{prefix}.{e}.down_proj.weight", (H, I), name, (e,)):
                    plan.missing.append(f"{prefix}.{e}.down_proj.weight")
            continue
        if not take(name, shape, name):
            plan.missing.append(name)
    for k, (orig, _) in by_key.items():
        if k in used:
            continue
        note = ""
        if k == "lm_head.weight" and config.tie_word_embeddings:
            note = " (config.json has tie_word_embeddings=true: the model has no lm_head)"
        elif _PER_EXPERT.match(k) and int(_PER_EXPERT.match(k).group(2)) >= E:
            note = f" (config.json has num_experts={E})"
        plan.unexpected.append(shown(k) + note)
    return plan


def _plan_error(plan: _Plan, path: Path, config: Qwen35Config) -> CheckpointError | None:
    parts = []
    for title, items in (("missing", plan.missing), ("unexpected", plan.unexpected),
                         ("mis-shaped (name: expected vs found)", plan.misshaped), ("wrong dtype", plan.bad_dtype)):
        if items:
            shown = items if len(items) <= 40 else items[:40] + [f"... and {len(items) - 40} more"]
            parts.append(f"{len(items)} {title} tensor(s):\n" + "\n".join("  " + s for s in shown))
    if not parts:
        return None
    hint = ""
    if plan.misshaped:
        hint = ("\nMis-shaped tensors usually mean config.json does not describe these weights (hidden_size, head "
                "counts, expert width...); the model was built from it as: "
                f"hidden_size={config.hidden_size}, num_hidden_layers={config.num_hidden_layers}, "
                f"num_experts={config.num_experts}, moe_intermediate_size={config.moe_intermediate_size}.")
    return CheckpointError(f"checkpoint {path} does not match its config:\n" + "\n".join(parts) + hint)


# ------------------------------------------------------------------------------------------------------------
def _progress(iterable, total: int, desc: str, progress: bool | None):
    enabled = progress if progress is not None else sys.stderr.isatty()
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="tensor", leave=False)


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=None,
    execution: Execution = Execution(),
    shardings: Callable[[str, tuple[int, ...]], jax.sharding.Sharding | None] | None = None,
    fp8: str = "dequantize",
    mtp: bool = False,
    progress: bool | None = None,
) -> Qwen35ForCausalLM:
    """Load a Hugging Face Qwen3.5-MoE safetensors checkpoint folder into a `Qwen35ForCausalLM`.

    Args:
      path: folder with `config.json` and `model.safetensors` or `model.safetensors.index.json` + shards.
      dtype: activation dtype of the model.
      param_dtype: dtype of the parameters (default: `dtype`). Every tensor is cast to it as it is read.
      execution: how the model runs (`qwen35.execution.Execution`: kernels, expert path, W8A8), as in
        `Qwen35ForCausalLM`; `Execution(w8a8=True)` needs fp8="keep" and a checkpoint whose routed experts are FP8.
      shardings: `(name, shape) -> jax.sharding.Sharding | None`, called per parameter with its HF name (e.g.
        "model.layers.0.mlp.experts.gate_up_proj", and with fp8="keep" "...gate_up_proj_scale_inv"); the tensor
        is `jax.device_put` there (None: default device).
      fp8: "dequantize" (default) turns FP8 weights + block scales into `param_dtype` on load: every matmul is
        then a plain one, which is also what the parity tests compare. "keep" keeps the routed experts of an FP8
        checkpoint as float8_e4m3fn with their block scales (`qwen35.moe.Experts` with `fp8=True`), a quarter
        of float32's bytes and half of bfloat16's: how the 397B model (720 GiB of experts in bf16) fits
        one serving host. Everything else (attention, GDN, router, shared expert: 2.5% of the 397B model's weights) is
        dequantised as with "dequantize". The experts are dequantised on use, layer by layer, inside the
        jitted forward (`Experts.dequantized`), so logits equal the "dequantize" model's. A checkpoint whose
        experts are not FP8 loads as with "dequantize". Per-expert FP8 tensors need moe_intermediate_size to
        be a multiple of 128 (gate and up rows then fill whole scale blocks of the fused [E, 2I, H] tensor;
        every released Qwen3.5 size is).
      mtp: also load the multi-token-prediction head (`mtp.*`, `model.mtp`; see `qwen35.mtp`). Without it the
        `mtp.*` tensors are skipped, and a checkpoint that has none loads as before.
      progress: show a tqdm bar (default: only when stderr is a terminal).

    Raises `CheckpointError` (a ValueError) listing every missing, unexpected and mis-shaped tensor, before any
    tensor data is read. A `ConfigError` if config.json itself is invalid.
    """
    if fp8 not in ("dequantize", "keep"):
        raise ValueError(f"fp8 must be 'dequantize' or 'keep', got {fp8!r}")
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder")
    if execution.w8a8 and fp8 != "keep":
        raise ValueError("Execution(w8a8=True) multiplies FP8 activations with the checkpoint's FP8 experts: load "
                         "with fp8='keep'")
    config = Qwen35Config.from_hf(path)
    param_dtype = jnp.dtype(param_dtype or dtype)
    np_param_dtype = np.dtype(param_dtype)

    # 1. The model's shapes, without allocating anything.
    def build(fp8_experts: bool):  # W8A8 needs the FP8 experts; the shapes checked first are the same without it
        ex = execution if fp8_experts else execution.replace(w8a8=False)
        abstract = Qwen35ForCausalLM.abstract(config, param_dtype=param_dtype, dtype=dtype, execution=ex,
                                              fp8_experts=fp8_experts, mtp=mtp)
        graphdef, state = nnx.split(abstract)
        flat = nnx.to_flat_state(state)
        params = {".".join(str(p) for p in path_): var for path_, var in flat}
        return graphdef, flat, {name: tuple(var.get_value().shape) for name, var in params.items()}

    if mtp and config.mtp_num_hidden_layers < 1:
        raise CheckpointError(f"checkpoint {path}: config.json has no MTP layer (mtp_num_hidden_layers is "
                              f"{config.mtp_num_hidden_layers}); load it with mtp=False")
    graphdef, flat, expected = build(False)

    # 2. Validate against the headers: no data read yet.
    tensors = _checkpoint_tensors(path)
    if mtp and not any(k.startswith(_MTP_PREFIX) for k in tensors):
        raise CheckpointError(f"checkpoint {path} has no mtp.* tensors (its multi-token-prediction head was not "
                              f"saved); load it with mtp=False")
    plan = _plan(expected, tensors, config, mtp)
    err = _plan_error(plan, path, config)
    if err is not None:
        raise err
    keep = fp8 == "keep" and _fp8_experts(plan, path, config)
    if execution.w8a8 and not keep:
        raise CheckpointError(f"checkpoint {path}: its routed experts are not FP8, so Execution(w8a8=True) has no "
                              f"FP8 weights to multiply; load it with w8a8=False")
    if keep:  # the model with FP8 experts: the same parameters plus the experts' scale tensors
        graphdef, flat, expected = build(True)

    # 3. Stream: one parameter at a time, read -> convert -> place.
    reader = _Reader()
    values: dict[str, jax.Array] = {}
    try:
        for name in _progress(expected, len(expected), f"loading {path.name}", progress):
            shape = expected[name]
            if keep and name.endswith(_SCALE_SUFFIX):  # read with its weight, below
                continue
            sources = plan.sources[name]
            if keep and _EXPERT_PARAM.match(name):
                host, scale = _read_fp8(reader, sources, shape, expected[name + _SCALE_SUFFIX])
                for n, a in ((name, host), (name + _SCALE_SUFFIX, scale)):
                    sharding = shardings(n, a.shape) if shardings is not None else None
                    values[n] = jax.device_put(a, sharding) if sharding is not None else jax.device_put(a)
                del host, scale
                continue
            if len(sources) == 1 and sources[0].index is None:
                host = _convert(reader, sources[0], np_param_dtype)
            else:  # per-expert tensors into a preallocated fused buffer
                host = np.empty(shape, np_param_dtype)
                for src in sources:
                    _convert(reader, src, np_param_dtype, out=host[src.index])
            sharding = shardings(name, shape) if shardings is not None else None
            values[name] = jax.device_put(host, sharding) if sharding is not None else jax.device_put(host)
            del host
    finally:
        reader.close()
    if set(values) != set(expected):  # cannot happen after validation; never return a partial model
        raise CheckpointError(f"internal error: parameters not loaded: {sorted(set(expected) - set(values))}")
    for path_, var in flat:
        var.set_value(values[".".join(str(p) for p in path_)])
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


_EXPERT_PARAM = re.compile(r"^(?:model|mtp)\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_SCALE_SUFFIX = "_scale_inv"


def _fp8_experts(plan: _Plan, path: Path, config: Qwen35Config) -> bool:
    """fp8="keep": whether the routed experts are FP8 (all of them: True; none: False, load as usual). Mixed
    experts, another FP8 format, or per-expert gate/up rows that do not fill whole scale blocks: CheckpointError."""
    srcs = [src for name, ss in plan.sources.items() if _EXPERT_PARAM.match(name) for src in ss]
    fp8 = [src for src in srcs if src.scale is not None]
    if not fp8:
        return False
    if len(fp8) != len(srcs):
        raise CheckpointError(f"checkpoint {path}: {len(fp8)} of {len(srcs)} routed-expert tensors are FP8; "
                              f"fp8='keep' needs all or none of them (load it with fp8='dequantize')")
    other = sorted({src.info.dtype for src in fp8} - {"F8_E4M3"})
    if other:
        raise CheckpointError(f"checkpoint {path}: expert tensors in {other}; fp8='keep' keeps float8_e4m3fn "
                              f"(F8_E4M3) only (load it with fp8='dequantize')")
    if any(src.index is not None and len(src.index) == 2 for src in fp8) and config.moe_intermediate_size % FP8_BLOCK:
        raise CheckpointError(
            f"checkpoint {path}: per-expert FP8 gate/up tensors with moe_intermediate_size "
            f"{config.moe_intermediate_size}, not a multiple of {FP8_BLOCK}: their scale blocks cannot be joined "
            f"into the fused [E, 2I, H] layout; load it with fp8='dequantize'")
    return True


def _read_fp8(reader: _Reader, sources: list[_Source], shape, scale_shape) -> tuple[np.ndarray, np.ndarray]:
    """An expert parameter kept in FP8: (weights float8_e4m3fn `shape`, scales float32 `scale_shape`), filled
    from its sources (one fused tensor, or per-expert tensors and their scales)."""
    w = np.empty(shape, ml_dtypes.float8_e4m3fn)
    s = np.empty(scale_shape, np.float32)
    for src in sources:
        raw, sc = reader.get(src.info), np.asarray(reader.get(src.scale), np.float32)
        if src.index is None or len(src.index) == 1:  # the whole tensor, or one expert's down_proj
            idx = () if src.index is None else src.index
            w[idx], s[idx] = raw, sc
        else:  # gate or up rows of expert e: rows a..b fill scale rows a/128..b/128 (I % 128 == 0, checked)
            e, rows = src.index
            w[e, rows] = raw
            s[e, rows.start // FP8_BLOCK: rows.start // FP8_BLOCK + sc.shape[0]] = sc
    return w, s


def _convert(reader: _Reader, src: _Source, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """Read one checkpoint tensor, dequantise (FP8) or cast, into `out` (or a new array that owns its memory)."""
    raw = reader.get(src.info)
    if src.scale is not None:
        scale = np.asarray(reader.get(src.scale), np.float32)
        return fp8_block_dequantize(raw, scale, dtype, out=out)
    if out is None:
        return np.array(raw, dtype=dtype, copy=True)  # a copy: never alias the memory map
    out[...] = raw.astype(dtype, copy=False)
    return out


# ------------------------------------------------------------------------------------------------------------
# Saving
def _to_numpy(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


class _Dequantized:
    """FP8 experts [E, R, C] + scales seen as float32, dequantised only where indexed (`[e]`, `[e, rows]`) or
    converted (`np.asarray`), so saving them dequantised never holds more than the tensor being written."""

    def __init__(self, q, scale):
        self.q, self.scale = q, scale
        self.shape, self.dtype = tuple(q.shape), np.dtype(np.float32)

    def _expert(self, e) -> np.ndarray:
        return fp8_block_dequantize(_to_numpy(self.q[e]), _to_numpy(self.scale[e]), np.float32)

    def __getitem__(self, idx):
        e, rows = idx if isinstance(idx, tuple) else (idx, slice(None))
        return self._expert(e)[rows]

    def __array__(self, dtype=None, copy=None):
        out = np.stack([self._expert(e) for e in range(self.shape[0])])
        return out if dtype is None else out.astype(dtype)


def _save_items(model: Qwen35ForCausalLM, expert_layout: str, dequantize_fp8: bool = False):
    """(name, shape, np dtype, producer) for every tensor to write, in the HF order; producers fetch lazily.

    FP8 experts (`Experts.fp8`) are written as FP8 weights + their `_scale_inv` blocks (per expert: gate rows,
    then up rows, of the fused scales), or dequantised to float32 with `dequantize_fp8`."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    values = {".".join(str(p) for p in path_): var.get_value() for path_, var in flat}
    for name, value in values.items():
        if name.endswith(_SCALE_SUFFIX):  # written with its weight
            continue
        m = _EXPERT_PARAM.match(name)
        scale = values.get(name + _SCALE_SUFFIX) if m else None
        if scale is not None and dequantize_fp8:  # float32, one expert at a time when it is written
            value, scale = _Dequantized(value, scale), None
        if m and expert_layout == "per_expert":
            prefix = name.rsplit(".", 1)[0]
            E = value.shape[0]
            if m.group(1) == "gate_up_proj":
                I = value.shape[1] // 2
                if scale is not None and I % FP8_BLOCK:
                    raise ValueError(
                        f"{name}: FP8 experts with moe_intermediate_size {I}, not a multiple of {FP8_BLOCK}, "
                        f"share scale blocks between gate and up rows, which per-expert tensors cannot express; "
                        f"save with expert_layout='fused', or dequantised with dtype=")
                parts = (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I)))
            else:
                parts = (("down_proj", slice(None)),)
            for e in range(E):
                for proj, rows in parts:
                    w = f"{prefix}.{e}.{proj}.weight"
                    shape = tuple(value.shape[1:]) if rows.start is None else (rows.stop - rows.start, value.shape[2])
                    yield w, shape, value.dtype, lambda v=value, e=e, r=rows: _to_numpy(v[e, r])
                    if scale is not None:  # I % 128 == 0 (a loaded FP8 model), so gate/up own whole scale rows
                        if rows.start is None:
                            sr, sshape = rows, tuple(scale.shape[1:])
                        else:
                            sr = slice(rows.start // FP8_BLOCK, -(-rows.stop // FP8_BLOCK))
                            sshape = (sr.stop - sr.start, scale.shape[2])
                        yield w + _SCALE_SUFFIX, sshape, scale.dtype, lambda s=scale, e=e, r=sr: _to_numpy(s[e, r])
        else:
            yield name, tuple(value.shape), value.dtype, lambda v=value: _to_numpy(v)
            if scale is not None:
                yield name + _SCALE_SUFFIX, tuple(scale.shape), scale.dtype, lambda s=scale: _to_numpy(s)


def _write_safetensors(file: Path, items: list[tuple[str, tuple, np.dtype, Callable[[], np.ndarray]]]):
    """Write tensors to one safetensors file, fetching each only when its bytes are written."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, dt, _ in items:
        n = math.prod(shape) * dt.itemsize
        header[name] = {"dtype": _NP_TO_ST[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the format aligns the data to 8 bytes
    tmp = file.with_suffix(file.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        for name, shape, dt, produce in items:
            arr = np.ascontiguousarray(produce(), dtype=dt)
            if arr.shape != shape:
                raise RuntimeError(f"{name}: produced {arr.shape}, expected {shape}")
            f.write(arr.tobytes())
    os.replace(tmp, file)


def save_hf_checkpoint(
    model: Qwen35ForCausalLM,
    path: str | os.PathLike,
    *,
    expert_layout: str = "fused",
    max_shard_size_bytes: int | None = None,
    dtype=None,
) -> Path:
    """Write `config.json` and safetensors weights that `transformers.Qwen3_5MoeForCausalLM.from_pretrained` and
    `load_hf_checkpoint` both load.

    expert_layout: "fused" (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, the in-memory layout
      of transformers 5) or "per_expert" (`mlp.experts.{e}.gate_proj.weight` ..., what transformers' own
      `save_pretrained` writes). dtype: cast every tensor (e.g. jnp.bfloat16; FP8 experts are dequantised
      first); default: keep the model's (FP8 experts stay FP8 with their `_scale_inv` blocks, the official
      format, which `load_hf_checkpoint` reads back with either `fp8` mode; config.json gets no
      `quantization_config`, so transformers would not dequantise them: save with a `dtype` for transformers).
    max_shard_size_bytes: split into `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json` when
      the weights are larger (a single tensor larger than the limit gets a shard of its own).
    Tensors are fetched from the device one at a time as they are written. Returns the folder.
    """
    if expert_layout not in ("fused", "per_expert"):
        raise ValueError(f"expert_layout must be 'fused' or 'per_expert', got {expert_layout!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out_dt = None if dtype is None else np.dtype(jnp.dtype(dtype))
    items = []
    for name, shape, dt, produce in _save_items(model, expert_layout, dequantize_fp8=out_dt is not None):
        dt = np.dtype(dt) if out_dt is None else out_dt
        if dt not in _NP_TO_ST:
            raise ValueError(f"cannot write {name} as {dt} in safetensors")
        items.append((name, shape, dt, produce))
    sizes = [math.prod(s) * dt.itemsize for _, s, dt, _ in items]
    total = sum(sizes)

    hf = model.config.to_hf_dict()
    hf["dtype"] = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                   np.dtype(np.float16): "float16"}.get(items[0][2], "float32")
    with open(path / "config.json", "w") as f:
        json.dump(hf, f, indent=2)
    for stale in [path / SINGLE_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)

    if max_shard_size_bytes is None or total <= max_shard_size_bytes:
        _write_safetensors(path / SINGLE_FILE, items)
        return path
    shards: list[list] = [[]]
    cur = 0
    for item, n in zip(items, sizes):
        if shards[-1] and cur + n > max_shard_size_bytes:
            shards.append([])
            cur = 0
        shards[-1].append(item)
        cur += n
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(path / fn, shard)
        weight_map.update({name: fn for name, *_ in shard})
    with open(path / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return path


# ------------------------------------------------------------------------------------------------------------
def load_tokenizer(path: str | os.PathLike):
    """`tokenizers.Tokenizer` from `path/tokenizer.json` (or `path` itself if it is that file); None if absent.
    Never downloads anything."""
    p = Path(path)
    file = p if p.is_file() else p / "tokenizer.json"
    if not file.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


TRAINED = Path(__file__).resolve().parent / "assets" / "stdlib-small"


def load_trained(*, mtp: bool = True, dtype=jnp.float32, **kwargs):
    """(model, tokenizer) of the small Qwen3.5-MoE trained here on the standard library's docstrings
    (`qwen35.train`; 2.3M parameters with its MTP head, bfloat16 on disk): a model that writes words, for the
    notebooks and tests. `kwargs` go to `load_hf_checkpoint`."""
    return load_hf_checkpoint(TRAINED, mtp=mtp, dtype=dtype, progress=False, **kwargs), load_tokenizer(TRAINED)
