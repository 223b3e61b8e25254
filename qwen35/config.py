"""Qwen3.5-MoE text-decoder configuration.

`Qwen35Config` is a frozen (hashable, so usable as a static jit argument) dataclass whose field names are the
Hugging Face ones (`transformers.Qwen3_5MoeTextConfig`). `Qwen35Config.from_hf` reads a checkpoint's
`config.json` in either the text-only form or the released multimodal form (text fields under `text_config`,
rope fields under `rope_parameters`).

Notation used throughout the package (see notebook 00):
  B batch, T tokens, H hidden, V vocab, L layers
  GDN:       Hk / Hv key / value heads, Dk / Dv head dims, Kc conv width
  attention: Hq / Hkv query / kv heads, Dh head dim, rd rotary dims
  MoE:       E experts, k experts per token, I expert width, Is shared-expert width
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"
# The official FP8 release stores one float32 scale per 128x128 block of a quantised weight (weight_block_size).
FP8_BLOCK = 128
# W8A8 experts quantise their activations with one float32 scale per row and 512 columns (the Ironwood post's
# "512 sub-channel" activation quantisation).
ACT_BLOCK = 512


class ConfigError(ValueError):
    """A configuration that cannot describe a working model; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    # --- model size ---------------------------------------------------------------------------------------
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    layer_types: tuple[str, ...] | None = None  # None -> [linear, linear, linear, full] repeating
    # --- Gated DeltaNet (linear attention) ---------------------------------------------------------------
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # --- gated GQA (full attention) ---------------------------------------------------------------------
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000.0
    # YaRN and friends: the HF rope_parameters minus theta/partial factor, as sorted (key, value) pairs so the
    # config stays hashable. None means plain RoPE. Read it with `rope_scaling_dict`.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 262_144
    attention_bias: bool = False
    # --- sparse MoE ---------------------------------------------------------------------------------------
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 1024
    shared_expert_intermediate_size: int = 1024
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    # --- misc ----------------------------------------------------------------------------------------------
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mtp_num_hidden_layers: int = 0  # multi-token-prediction layers (qwen35.mtp; the decoder does not run them)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # --- not an HF field: the preset or checkpoint this config came from; how it runs is `qwen35.execution` -----
    name: str = "custom"

    def __post_init__(self):
        # Normalise list-ish inputs so the dataclass stays hashable.
        if self.layer_types is None:
            lt = tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", lt)
        elif not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    # ------------------------------------------------------------------------------------------------------
    # Derived sizes (names follow the notation table).
    @property
    def linear_key_dim(self) -> int:  # Hk * Dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # Hv * Dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:  # channels of the causal conv: q | k | v
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def rotary_dim(self) -> int:  # rd
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    @property
    def num_full_layers(self) -> int:
        return sum(t == FULL for t in self.layer_types)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else {k: _thaw(v) for k, v in self.rope_scaling}

    def replace(self, **changes) -> Qwen35Config:
        """A copy with some fields changed, validated."""
        return dataclasses.replace(self, **changes).validate()

    # ------------------------------------------------------------------------------------------------------
    def validate(self) -> Qwen35Config:
        """Raise `ConfigError` naming the field and the fix if this config cannot describe a working model.

        Returns `self`, so `Qwen35Config(...).validate()` chains.
        """
        pos = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for field, value in pos.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{field} must be a positive integer, got {value!r}.")
        if not isinstance(self.shared_expert_intermediate_size, int) or self.shared_expert_intermediate_size < 0:
            raise ConfigError(
                f"shared_expert_intermediate_size must be an integer >= 0 (0 = no shared expert), "
                f"got {self.shared_expert_intermediate_size!r}."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; give one entry per layer (or leave layer_types=None for the "
                f"[linear, linear, linear, full] pattern)."
            )
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise ConfigError(f"layer_types contains {bad}; each entry must be {LINEAR!r} or {FULL!r}.")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads}): each GDN key head serves a whole group of "
                f"value heads. Change one of the two."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention. Change one of the two."
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) cannot exceed num_experts ({self.num_experts}); "
                f"lower top-k or add experts."
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}.")
        rd = self.head_dim * self.partial_rotary_factor
        if rd != int(rd) or int(rd) % 2:
            raise ConfigError(
                f"head_dim * partial_rotary_factor = {rd} must be an even integer (rotate-half RoPE pairs "
                f"dims i and i + rd/2); change head_dim or partial_rotary_factor."
            )
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}.")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}.")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported; Qwen3.5 uses 'silu'.")
        if self.attention_bias:
            raise ConfigError("attention_bias=True is not supported: Qwen3.5 has no projection biases.")
        rs = self.rope_scaling_dict
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type", "default"))
            if kind not in ("default", "yarn"):
                raise ConfigError(f"rope_scaling type {kind!r} is not supported; use 'yarn' or none.")
            if kind == "yarn" and float(rs.get("factor", 0.0)) <= 0.0:
                raise ConfigError("rope_scaling of type 'yarn' needs a positive 'factor' (e.g. 4.0).")
        return self

    # ------------------------------------------------------------------------------------------------------
    def param_counts(self) -> dict[str, Any]:
        """Parameters by component, in total and active per token.

        "Active" counts what one token touches: everything except the routed experts it is not sent to (its
        k of E). Embedding and lm_head are both counted (they are read for every token). Returns a dict with
        `total`, `active`, and `components`: {name: {"total": n, "active": n}}, and `mtp`: {"total", "active"} of
        the multi-token-prediction head (`mtp_num_hidden_layers` full-attention + MoE layers, `fc` [H, 2H] and
        three norms; it shares the embedding and lm_head), which the checkpoint carries beside the decoder and
        `total` does not count.
        """
        H, V = self.hidden_size, self.vocab_size
        E, k, I, Is = self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size, self.shared_expert_intermediate_size
        L, n_lin, n_full = self.num_hidden_layers, self.num_linear_layers, self.num_full_layers
        Hq, Hkv, Dh = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        Hv, Dv, Kc = self.linear_num_value_heads, self.linear_value_head_dim, self.linear_conv_kernel_dim
        gdn_layer = (
            self.linear_conv_dim * H  # in_proj_qkv
            + self.linear_value_dim * H  # in_proj_z
            + 2 * Hv * H  # in_proj_b, in_proj_a
            + self.linear_conv_dim * Kc  # conv1d
            + 2 * Hv  # dt_bias, A_log
            + Dv  # gated norm
            + H * self.linear_value_dim  # out_proj
        )
        attn_layer = 2 * Hq * Dh * H + 2 * Hkv * Dh * H + H * Hq * Dh + 2 * Dh
        routed_layer = E * 3 * I * H
        shared_layer = 3 * Is * H + (H if Is else 0)  # shared SwiGLU + its scalar gate
        router_layer = E * H
        comps = {
            "embed_tokens": (V * H, V * H),
            "lm_head": (0, 0) if self.tie_word_embeddings else (V * H, V * H),
            "gdn": (n_lin * gdn_layer, n_lin * gdn_layer),
            "attention": (n_full * attn_layer, n_full * attn_layer),
            "router": (L * router_layer, L * router_layer),
            "shared_experts": (L * shared_layer, L * shared_layer),
            "routed_experts": (L * routed_layer, L * k * 3 * I * H),
            "norms": (L * 2 * H + H, L * 2 * H + H),
        }
        out = {name: {"total": t, "active": a} for name, (t, a) in comps.items()}
        mtp_layer = attn_layer + router_layer + shared_layer + 2 * H
        n_mtp = self.mtp_num_hidden_layers
        mtp_rest = 2 * H * H + 3 * H if n_mtp else 0  # fc, pre_fc_norm_embedding/hidden, norm
        return {
            "total": sum(t for t, _ in comps.values()),
            "active": sum(a for _, a in comps.values()),
            "components": out,
            "mtp": {"total": n_mtp * (mtp_layer + routed_layer) + mtp_rest,
                    "active": n_mtp * (mtp_layer + k * 3 * I * H) + mtp_rest},
        }

    def cache_bytes_per_sequence(self, context_len: int, kv_dtype_bytes: int = 2, state_dtype_bytes: int = 4) -> dict:
        """Bytes of decode state one sequence holds: KV cache of the full-attention layers at `context_len`
        tokens, and the fixed-size GDN conv + recurrent state (which does not grow with context)."""
        kv_per_token = self.num_full_layers * 2 * self.num_key_value_heads * self.head_dim * kv_dtype_bytes
        rec = self.num_linear_layers * self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * state_dtype_bytes
        conv = self.num_linear_layers * self.linear_conv_dim * self.linear_conv_kernel_dim * kv_dtype_bytes
        return {
            "kv_bytes_per_token": kv_per_token,
            "kv_bytes": kv_per_token * context_len,
            "gdn_recurrent_bytes": rec,
            "gdn_conv_bytes": conv,
            "total": kv_per_token * context_len + rec + conv,
        }

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides) -> Qwen35Config:
        """Build from a Hugging Face `config.json` (a path to the file or its folder, or the parsed dict).

        Accepts the text-only form (`Qwen3_5MoeTextConfig`) and the released multimodal form (text fields under
        `text_config`); rope fields may sit at the top level (`rope_theta`, `partial_rotary_factor`,
        `rope_scaling`) or under `rope_parameters`. Unknown fields are ignored; missing required ones raise
        `ConfigError`. `overrides` replace fields after reading (e.g. `max_position_embeddings=4096`).
        """
        if isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
            where = "the given dict"
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.exists(p):
                raise ConfigError(f"No config.json at {p!r}; pass a checkpoint folder or its config.json.")
            with open(p) as f:
                raw = json.load(f)
            where = p
        d = dict(raw)
        if isinstance(d.get("text_config"), Mapping):  # multimodal release: text fields nested
            top = d
            d = dict(d["text_config"])
            if "tie_word_embeddings" not in d and "tie_word_embeddings" in top:
                d["tie_word_embeddings"] = top["tie_word_embeddings"]
        required = (
            "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        )
        missing = [f for f in required if f not in d]
        if missing:
            raise ConfigError(
                f"config in {where} is missing required field(s) {missing}; is this a Qwen3.5-MoE config.json "
                f"(model_type 'qwen3_5_moe' or 'qwen3_5_moe_text')?"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields and k not in ("rope_scaling", "name")}
        rope = dict(d.get("rope_parameters") or {})
        if d.get("rope_scaling"):
            rope.update(d["rope_scaling"])
        if "rope_theta" in rope:
            kw["rope_theta"] = float(rope.pop("rope_theta"))
        if "partial_rotary_factor" in rope:
            kw["partial_rotary_factor"] = float(rope.pop("partial_rotary_factor"))
        for k in ("mrope_section", "mrope_interleaved"):  # text positions make M-RoPE ordinary 1-D RoPE
            rope.pop(k, None)
        kind = rope.get("rope_type", rope.get("type", "default"))
        kw["rope_scaling"] = None if kind == "default" else rope
        if d.get("layer_types") is None and "full_attention_interval" in d:
            n = int(d["full_attention_interval"])
            kw["layer_types"] = tuple(
                FULL if (i + 1) % n == 0 else LINEAR for i in range(int(d["num_hidden_layers"]))
            )
        if "mtp_num_hidden_layers" in d:
            kw["mtp_num_hidden_layers"] = int(d["mtp_num_hidden_layers"] or 0)
        kw["name"] = str(raw.get("_name_or_path") or d.get("model_type") or "hf")
        kw.update(overrides)
        return cls(**kw).validate()

    def to_hf_dict(self) -> dict[str, Any]:
        """The text-only `config.json` dict transformers' `Qwen3_5MoeTextConfig` reads."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling_dict)
        d = {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
        }
        if self.mtp_num_hidden_layers:
            d["mtp_num_hidden_layers"] = self.mtp_num_hidden_layers
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            d["eos_token_id"] = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return d


def _freeze(m: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in m.items()))


def _thaw(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


# ----------------------------------------------------------------------------------------------------------
# Presets
def qwen35_397b_a17b(**overrides) -> Qwen35Config:
    """Qwen3.5-397B-A17B text decoder (the released checkpoint's `text_config`)."""
    kw = dict(
        name="qwen35-397b-a17b",
        hidden_size=4096,
        num_hidden_layers=60,
        vocab_size=248_320,
        linear_num_key_heads=16,
        linear_num_value_heads=64,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=256,
        partial_rotary_factor=0.25,
        rope_theta=10_000_000.0,
        max_position_embeddings=262_144,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1,
    )
    kw.update(overrides)
    return Qwen35Config(**kw).validate()


def qwen35_35b_a3b(**overrides) -> Qwen35Config:
    """Qwen3.5-35B-A3B text decoder."""
    kw = dict(
        name="qwen35-35b-a3b",
        hidden_size=2048,
        num_hidden_layers=40,
        vocab_size=248_320,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        partial_rotary_factor=0.25,
        rope_theta=10_000_000.0,
        max_position_embeddings=262_144,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1,
    )
    kw.update(overrides)
    return Qwen35Config(**kw).validate()


def tiny(**overrides) -> Qwen35Config:
    """A few-hundred-thousand-parameter model that runs in seconds on a CPU.

    Keeps what makes layouts go wrong visible: both layer types ([L, L, L, F] x 2), Hv = 2 Hk (grouped value
    heads), Dk != Dv, Hq = 2 Hkv (GQA), I != Is, top-2 of 8 experts, partial RoPE.
    """
    kw = dict(
        name="tiny",
        hidden_size=64,
        num_hidden_layers=8,
        vocab_size=512,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        partial_rotary_factor=0.25,
        rope_theta=10_000.0,
        max_position_embeddings=4096,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen35Config(**kw).validate()


def small(**overrides) -> Qwen35Config:
    """A ~120M-parameter model (hidden 512, 8 layers, 32 experts top-4, expert width 256, vocab 8192) for CPU
    benchmarks against transformers: ~56 MFLOP per token, ~230 MB of fp32 weights touched per decode step at
    batch 4."""
    kw = dict(
        name="small",
        hidden_size=512,
        num_hidden_layers=8,
        vocab_size=8192,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        partial_rotary_factor=0.25,
        rope_theta=10_000_000.0,
        max_position_embeddings=32_768,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return Qwen35Config(**kw).validate()


PRESETS = {
    "qwen35-397b-a17b": qwen35_397b_a17b,
    "qwen35-35b-a3b": qwen35_35b_a3b,
    "small": small,
    "tiny": tiny,
}


def get_preset(name: str, **overrides) -> Qwen35Config:
    try:
        return PRESETS[name](**overrides)
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}.") from None
