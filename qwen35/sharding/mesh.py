"""Meshes, the logical-axis rules table and the checks that a mesh can hold a config (`check_mesh`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from qwen35.config import ConfigError, Qwen35Config


class ShardingError(ConfigError):
    """A mesh, rule or shape that cannot be sharded as asked; the message names the problem and the fix."""


# ------------------------------------------------------------------------------------------------------------
# Meshes
def make_mesh(*, devices: Sequence[Any] | None = None, axis_types: str = "auto", **axes: int) -> Mesh:
    """A device mesh from named axis sizes, in the order given: `make_mesh(data=8)`, `make_mesh(data=2, expert=4)`,
    `make_mesh(chip=4, core=2)` (the last axis varies fastest: devices 2c and 2c+1 share chip c).

    The product of the sizes must equal the number of devices (`devices`, default all of `jax.devices()`).
    `axis_types` "auto" (default: the compiler propagates shardings, as jit has always done) or "explicit"
    (jax 0.10's sharding-in-types; `jax.make_mesh`'s own default)."""
    if not axes:
        raise ShardingError("make_mesh needs at least one axis, e.g. make_mesh(data=8) or make_mesh(data=2, expert=4)")
    for name, size in axes.items():
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise ShardingError(f"mesh axis {name}={size!r} must be a positive integer")
    if axis_types not in ("auto", "explicit"):
        raise ShardingError(f"axis_types must be 'auto' or 'explicit', got {axis_types!r}")
    devs = list(jax.devices() if devices is None else devices)
    want = math.prod(axes.values())
    if want != len(devs):
        desc = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise ShardingError(
            f"make_mesh({desc}) needs {want} devices but there are {len(devs)} ({devs[0].platform}); make the "
            f"axis sizes multiply to {len(devs)}. To try 8 devices on a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=8 (or jax.config.update('jax_num_cpu_devices', 8)) "
            f"before jax starts.")
    kind = AxisType.Auto if axis_types == "auto" else AxisType.Explicit
    return jax.make_mesh(tuple(int(v) for v in axes.values()), tuple(axes), axis_types=(kind,) * len(axes),
                         devices=devs)


def _axes_desc(mesh: Mesh, axes: Sequence[str]) -> str:
    return "×".join(f"{a}={mesh.shape[a]}" for a in axes) or "no axis"


def _axes_size(mesh: Mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


# ------------------------------------------------------------------------------------------------------------
# The rules table: logical axis -> mesh axes that split it (in order; those a mesh lacks are skipped)
LOGICAL_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # activations
    ("batch", ("data", "chip", "core", "expert")),  # tokens / sequences: every non-model axis (attention DP)
    ("length", ()),
    # MoE
    ("experts", ("expert", "chip", "core")),  # EP: whole experts per device
    ("expert_mlp", ()),  # routed width I; TP-MoE maps it to "model" (gate_up rows regrouped: tp_interleave_gate_up)
    ("mlp", ("model",)),  # shared-expert width Is
    # attention
    ("heads", ("model",)),  # query heads (q_proj rows: per head q_h then gate_h, so whole heads stay together)
    ("kv_heads", ("model",)),
    ("head_dim", ()),
    # Gated DeltaNet: replicated (q|k|v are concatenated in in_proj_qkv and conv1d, so a contiguous split would
    # not give whole heads; TP for GDN needs a regrouped layout)
    ("gdn_qkv", ()),
    ("gdn_heads", ()),
    # the rest
    ("vocab", ("model",)),
    ("hidden", ()),
    ("norm", ()),
    ("conv", ()),
)


def _rules_dict(rules) -> dict[str, tuple[str, ...]]:
    items = rules.items() if isinstance(rules, Mapping) else rules
    out = {}
    for logical, mesh_axes in items:
        if mesh_axes is None:
            mesh_axes = ()
        elif isinstance(mesh_axes, str):
            mesh_axes = (mesh_axes,)
        out[logical] = tuple(mesh_axes)
    return out


def rules_with(base=LOGICAL_RULES, **overrides) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A copy of the rules table with some rows replaced, e.g. the layouts `shard_model` understands:

      rules_with(expert_mlp=("model",))   TP-MoE: each expert's width split over "model" (with experts over
                                          "expert" too on an (expert, model) mesh: the EP x TP hybrid)
      rules_with(kv_heads=())             TP attention with the KV heads replicated on every "model" device
                                          (what TP=8 must do with 2 KV heads; see `memory_plan`)
    Unknown logical axes raise (a typo would otherwise silently replicate)."""
    table = _rules_dict(base)
    for logical, axes in overrides.items():
        if logical not in table:
            raise ShardingError(f"no rule for logical axis {logical!r}; known: {sorted(table)}")
        table[logical] = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return tuple(table.items())


def mesh_axes_for(logical: str, mesh: Mesh | None = None, rules=LOGICAL_RULES) -> tuple[str, ...]:
    """The mesh axes that split `logical` on `mesh` (all the rule's axes if mesh is None)."""
    table = _rules_dict(rules)
    if logical not in table:
        raise ShardingError(f"no rule for logical axis {logical!r}; known: {sorted(table)}. Add a row to the rules.")
    axes = table[logical]
    return axes if mesh is None else tuple(a for a in axes if a in mesh.axis_names)


def logical_to_spec(logical_axes: Sequence[str | None], rules=LOGICAL_RULES, mesh: Mesh | None = None) -> P:
    """PartitionSpec for an array whose dimensions have these logical names (None = replicated dimension).

    Each logical axis takes the mesh axes its rule lists that the mesh has and that no earlier dimension of the
    same array took (a mesh axis can split only one dimension)."""
    used: set[str] = set()
    entries = []
    for logical in logical_axes:
        if logical is None:
            entries.append(None)
            continue
        axes = tuple(a for a in mesh_axes_for(logical, mesh, rules) if a not in used)
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


# Parameter name (suffix of the checkpoint name) -> logical axes of its dimensions.
PARAM_LOGICAL_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("embed_tokens.weight", ("vocab", "hidden")),
    ("lm_head.weight", ("vocab", "hidden")),
    ("self_attn.q_proj.weight", ("heads", "hidden")),  # [Hq·Dh·2, H]
    ("self_attn.k_proj.weight", ("kv_heads", "hidden")),  # [Hkv·Dh, H]
    ("self_attn.v_proj.weight", ("kv_heads", "hidden")),
    ("self_attn.o_proj.weight", ("hidden", "heads")),  # [H, Hq·Dh]
    ("linear_attn.in_proj_qkv.weight", ("gdn_qkv", "hidden")),
    ("linear_attn.conv1d.weight", ("gdn_qkv", None, "conv")),  # [conv_dim, 1, Kc]
    ("linear_attn.in_proj_z.weight", ("gdn_heads", "hidden")),
    ("linear_attn.in_proj_a.weight", ("gdn_heads", "hidden")),
    ("linear_attn.in_proj_b.weight", ("gdn_heads", "hidden")),
    ("linear_attn.out_proj.weight", ("hidden", "gdn_heads")),
    ("linear_attn.A_log", ("gdn_heads",)),
    ("linear_attn.dt_bias", ("gdn_heads",)),
    ("mlp.gate.weight", (None, "hidden")),  # the router: every device routes its own tokens over all E
    ("mlp.experts.gate_up_proj", ("experts", "expert_mlp", None)),  # [E, 2I, H] (TP: rows regrouped first)
    ("mlp.experts.down_proj", ("experts", None, "expert_mlp")),  # [E, H, I]
    ("mlp.experts.gate_up_proj_scale_inv", ("experts", None, None)),  # FP8 experts' 128x128 block scales
    ("mlp.experts.down_proj_scale_inv", ("experts", None, None)),
    ("mlp.shared_expert.gate_proj.weight", ("mlp", "hidden")),
    ("mlp.shared_expert.up_proj.weight", ("mlp", "hidden")),
    ("mlp.shared_expert.down_proj.weight", ("hidden", "mlp")),
    ("mlp.shared_expert_gate.weight", (None, "hidden")),
    ("input_layernorm.weight", ("norm",)),
    ("post_attention_layernorm.weight", ("norm",)),
    ("q_norm.weight", ("head_dim",)),
    ("k_norm.weight", ("head_dim",)),
    ("norm.weight", ("norm",)),  # the final model.norm and the GDN gated norm (linear_attn.norm)
    ("mtp.fc.weight", (None, "hidden")),  # the MTP head's [H, 2H] projection: replicated, like the router
    ("pre_fc_norm_embedding.weight", ("norm",)),
    ("pre_fc_norm_hidden.weight", ("norm",)),
)


def param_logical_axes(name: str, shape: Sequence[int] | None = None) -> tuple[str | None, ...]:
    """Logical axes of the parameter called `name` (a checkpoint name such as
    "model.layers.0.mlp.experts.gate_up_proj" -> ("experts", None, None)). With `shape`, checks the rank."""
    for suffix, axes in PARAM_LOGICAL_AXES:
        if name == suffix or name.endswith("." + suffix):
            if shape is not None and len(shape) != len(axes):
                raise ShardingError(f"parameter {name} has shape {tuple(shape)} but its rule {suffix!r} names "
                                    f"{len(axes)} axes {axes}")
            return axes
    raise ShardingError(f"no logical axes known for parameter {name!r}; add a row to PARAM_LOGICAL_AXES")




def check_mesh(config: Qwen35Config, mesh: Mesh, rules=LOGICAL_RULES) -> None:
    """Raise `ShardingError` when `mesh` (under `rules`) would split a dimension of `config`'s model unevenly."""
    c = config
    sizes = {
        "experts": (c.num_experts, "experts"),
        "kv_heads": (c.num_key_value_heads, "KV heads"),
        "heads": (c.num_attention_heads, "attention heads"),
        "vocab": (c.vocab_size, "vocabulary entries"),
        "mlp": (c.shared_expert_intermediate_size, "shared-expert channels"),
        "expert_mlp": (c.moe_intermediate_size, "expert channels"),
        "hidden": (c.hidden_size, "hidden channels"),
        "gdn_heads": (c.linear_num_value_heads, "GDN value heads"),
    }
    for logical, (size, what) in sizes.items():
        axes = mesh_axes_for(logical, mesh, rules)
        n = _axes_size(mesh, axes)
        if n == 1 or size % n == 0:
            continue
        where = _axes_desc(mesh, axes)
        if logical == "experts":
            ok = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
            raise ShardingError(f"{size} experts cannot be split over {where}; use an expert-axis size that "
                                f"divides {size} ({', '.join(map(str, ok))}, ...)")
        if logical in ("kv_heads", "heads"):
            raise ShardingError(f"{size} {what} cannot be split over {where}; replicate attention with data "
                                f"parallelism (put those devices on 'data'/'expert' instead of 'model', e.g. "
                                f"make_mesh(data={n}) or make_mesh(expert={n}))")
        raise ShardingError(f"{size} {what} ({logical}) cannot be split over {where}; choose a size that divides "
                            f"{size} or map {logical!r} to no mesh axis in the rules")
