"""Sharding for Qwen3.5: meshes, the logical-axis rules table, packed routing metadata, expert-parallel MoE with
two token-exchange schemes, a hierarchical reduce-scatter, and the communication bytes each scheme costs.

Mesh axes used here (any subset, in any order):
  data    data parallelism: whole sequences per device, attention (GQA and GDN weights) replicated
  expert  expert parallelism: E / n experts per device
  chip, core   a two-level device mesh (4 Ironwood chips x 2 TensorCores); tokens and experts split over both
  model   tensor parallelism (attention heads, vocab, shared-expert width), the alternative the workload rejects

Sharding is data: `LOGICAL_RULES` maps every logical axis (batch, experts, heads, kv_heads, vocab, ...) to the mesh
axes that split it, `param_logical_axes` names the logical axes of each parameter by its checkpoint name, and
`logical_to_spec` turns both into a `PartitionSpec` for a given mesh (mesh axes the mesh lacks are dropped, so one
table serves every mesh). `check_mesh` says up front when a mesh cannot hold a config (the error names the fix).

Expert-parallel MoE (`moe_ep`, a `jax.shard_map`; n = devices on the expert axes, t tokens per device, N_g = n·t):

  "allgather" (the workload's choice; deterministic: no capacity, nothing dropped, fixed message sizes)
      x [t, H], routing packed into one int32 [t, 2k]  --all_gather(expert)-->  [N_g, H], [N_g, 2k]
      local experts only (slots routed elsewhere get weight 0)                   y_partial [N_g, H]
      --psum_scatter(expert)-->  y [t, H]   (hierarchical: inside a chip first, then across chips)
      each device sends (n-1)·t·(2·H·b + 2k·4) bytes.

  "alltoall" (capacity-based dispatch, as in GShard/Switch)
      x [t, H] -> buffers [n, E/n, C, H], C = ceil(cf·t·k/E)  --all_to_all-->  [n (source), E/n, C, H]
      local experts  --all_to_all back-->  [E, C, H]  -> weighted combine; slots past C are dropped (counted)
      each device sends 2·(n-1)·(E/n)·C·H·b bytes.

`moe_comm_bytes` gives those figures from shapes; `hlo_collective_bytes` reads them off a compiled program.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

from qwen35.config import ConfigError, Qwen35Config
from qwen35.moe import capacity as moe_capacity
from qwen35.moe import experts_dense, experts_sorted, sort_by_expert

__all__ = [
    "ShardingError",
    "make_mesh",
    "LOGICAL_RULES",
    "PARAM_LOGICAL_AXES",
    "mesh_axes_for",
    "logical_to_spec",
    "param_logical_axes",
    "param_specs",
    "checkpoint_shardings",
    "load_sharded",
    "check_mesh",
    "pack_routing",
    "unpack_routing",
    "EPStats",
    "moe_ep",
    "moe_ep_local",
    "rules_with",
    "tp_interleave_gate_up",
    "tp_deinterleave_gate_up",
    "hierarchical_psum_scatter",
    "hierarchical_all_gather",
    "balanced_expert_placement",
    "moe_comm_bytes",
    "hlo_collective_bytes",
    "SCHEMES",
]

SCHEMES = ("allgather", "alltoall")
LOCAL_IMPLS = ("sorted", "dense")


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


def _path_name(path) -> str:
    parts = []
    for k in path:
        k = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        if k == "value":  # nnx.Variable's payload
            continue
        parts.append(str(k))
    return ".".join(parts)


def param_specs(params, mesh: Mesh, rules=LOGICAL_RULES, config: Qwen35Config | None = None):
    """A PartitionSpec for every array leaf of `params` (e.g. `nnx.state(model, nnx.Param)`), named by its path,
    same tree structure. Raises `ShardingError` naming the parameter when a split does not divide its dim.

    Shapes alone cannot see a split through the middle of a head (k_proj's Hkv·Dh rows divide by 4 even with 2
    KV heads): pass `config` to run `check_mesh` first."""
    if config is not None:
        check_mesh(config, mesh, rules)

    return jax.tree_util.tree_map_with_path(lambda path, leaf: _param_spec(_path_name(path), leaf.shape, mesh, rules),
                                            params)


def _param_spec(name: str, shape, mesh: Mesh, rules) -> P:
    """The PartitionSpec of parameter `name` of this shape; `ShardingError` when a split does not divide."""
    axes = param_logical_axes(name, shape)
    s = logical_to_spec(axes, rules, mesh)
    for dim, (size, entry) in enumerate(zip(shape, s)):
        if entry is None:
            continue
        names = (entry,) if isinstance(entry, str) else entry
        n = _axes_size(mesh, names)
        if size % n:
            raise ShardingError(f"{name} {tuple(shape)}: dim {dim} ({axes[dim]}, size {size}) cannot be "
                                f"split over {_axes_desc(mesh, names)}; change the mesh or the rule for "
                                f"{axes[dim]!r}")
    return s


def checkpoint_shardings(mesh: Mesh, rules=LOGICAL_RULES, config: Qwen35Config | None = None):
    """The `shardings=` callable for `load_hf_checkpoint`: each tensor goes straight to its place on `mesh` under
    `rules` as it is read (the layout `shard_model` gives), so no device — and no host buffer — ever holds the
    whole checkpoint. Pass `config` to run `check_mesh` first. TP-MoE layouts (a mesh axis for "expert_mlp")
    regroup gate_up rows before placing them, which a per-tensor placement cannot do: load those unsharded and
    call `shard_model`."""
    if config is not None:
        check_mesh(config, mesh, rules)
    if mesh_axes_for("expert_mlp", mesh, rules):
        raise ShardingError("checkpoint_shardings cannot place a TP-MoE layout (the expert_mlp rule splits gate_up "
                            "rows after regrouping them); load the checkpoint unsharded and call shard_model")

    def shardings(name: str, shape) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(mesh, _param_spec(name, shape, mesh, rules))

    return shardings


def load_sharded(path, mesh: Mesh, *, rules=LOGICAL_RULES, moe_exchange: str = "allgather", **load_kwargs):
    """`load_hf_checkpoint` straight onto `mesh` (`checkpoint_shardings`), then `shard_model`: the serving model
    for a checkpoint bigger than one device, e.g. `load_sharded(path, make_mesh(expert=8), dtype=jnp.bfloat16)`
    for the Ironwood post's DP attention + EP layout. The mesh is checked against the checkpoint's config before any
    tensor is read; `load_kwargs` go to `load_hf_checkpoint`."""
    from qwen35.weights import load_hf_checkpoint

    config = Qwen35Config.from_hf(path)  # ConfigError / ShardingError here, before any tensor is read
    model = load_hf_checkpoint(path, shardings=checkpoint_shardings(mesh, rules, config), **load_kwargs)
    return shard_model(model, mesh, moe_exchange=moe_exchange, rules=rules)


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


# ------------------------------------------------------------------------------------------------------------
# Packed routing metadata: expert ids and weights in one int32 array, so one all-gather moves both
def pack_routing(experts: jax.Array, weights: jax.Array) -> jax.Array:
    """experts [N, k] int32, weights [N, k] float32 -> [N, 2k] int32: ids, then the weights' bits
    (`lax.bitcast_convert_type`, no rounding)."""
    experts, weights = jnp.asarray(experts), jnp.asarray(weights)
    if experts.ndim != 2 or experts.shape != weights.shape:
        raise ValueError(f"experts and weights must both be [N, k], got {experts.shape} and {weights.shape}")
    if weights.dtype != jnp.float32:
        raise ValueError(f"weights must be float32 (bit-cast into int32), got {weights.dtype}")
    bits = jax.lax.bitcast_convert_type(weights, jnp.int32)
    return jnp.concatenate([experts.astype(jnp.int32), bits], axis=-1)


def unpack_routing(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[N, 2k] int32 -> (experts [N, k] int32, weights [N, k] float32), bit-exact inverse of `pack_routing`."""
    packed = jnp.asarray(packed)
    if packed.ndim != 2 or packed.shape[1] % 2 or packed.dtype != jnp.int32:
        raise ValueError(f"packed routing must be int32 [N, 2k], got {packed.dtype} {packed.shape}")
    k = packed.shape[1] // 2
    return packed[:, :k], jax.lax.bitcast_convert_type(packed[:, k:], jnp.float32)


# ------------------------------------------------------------------------------------------------------------
# Hierarchical reduce-scatter
def hierarchical_psum_scatter(x: jax.Array, inner_axis: str, outer_axis: str, *, scatter_dimension: int = 0):
    """Reduce-scatter over two mesh axes in two steps: inside the inner group first (the cores of one chip, fast
    links), then across the outer one (chips) with 1/a of the data. Call inside `shard_map`.

    Equal to the flat `lax.psum_scatter(x, (outer_axis, inner_axis), scatter_dimension=..., tiled=True)`:
    the device at (outer o, inner i) gets block o·a + i of the sum (a = inner size; outer-major, the order of
    the flat version and of `all_gather(..., (outer_axis, inner_axis), tiled=True)`). A plain inner-then-outer
    pair of psum_scatters would give it block i·b + o; the blocks are permuted first so the orders agree.

    Bytes each device sends (ring model, x of X bytes, b = outer size): (a-1)/a·X on-chip + (b-1)/(a·b)·X across
    chips, against (ab-1)/(ab)·X for the flat version, most of which would cross chips."""
    a, b = jax.lax.axis_size(inner_axis), jax.lax.axis_size(outer_axis)
    x = jnp.moveaxis(x, scatter_dimension, 0)
    M = x.shape[0]
    if M % (a * b):
        raise ValueError(f"dimension {scatter_dimension} of size {M} must be a multiple of {outer_axis}×{inner_axis}"
                         f" = {a * b} to be scattered")
    rest = x.shape[1:]
    x = x.reshape(b, a, M // (a * b), *rest).swapaxes(0, 1).reshape(M, *rest)  # block o·a+i -> position i·b+o
    y = jax.lax.psum_scatter(x, inner_axis, scatter_dimension=0, tiled=True)  # [M/a]: blocks (o, i) for all o
    y = jax.lax.psum_scatter(y, outer_axis, scatter_dimension=0, tiled=True)  # [M/(ab)]: block (o, i)
    return jnp.moveaxis(y, 0, scatter_dimension)


# ------------------------------------------------------------------------------------------------------------
# Hierarchical all-gather (the mirror image of the reduce-scatter)
def hierarchical_all_gather(x: jax.Array, inner_axis: str, outer_axis: str, *, axis: int = 0):
    """All-gather over two mesh axes in two steps: across the outer group (chips) first, while the data is still
    small, then inside the inner group (the cores of a chip, fast links). Call inside `shard_map`.

    Equal to the flat `lax.all_gather(x, (outer_axis, inner_axis), axis=axis, tiled=True)` (block o·a + i comes
    from the device at (outer o, inner i)); the gathered blocks are reordered at the end so the orders agree.

    Bytes each device sends (ring model, x of X bytes, a = inner size, b = outer size): (b-1)·X across chips +
    (a-1)·b·X on-chip, against (ab-1)·X for the flat version, most of which would cross chips."""
    a, b = jax.lax.axis_size(inner_axis), jax.lax.axis_size(outer_axis)
    x = jnp.moveaxis(x, axis, 0)
    t, rest = x.shape[0], x.shape[1:]
    y = jax.lax.all_gather(x, outer_axis, axis=0, tiled=True)  # [b·t]: blocks (o', i) for all o'
    y = jax.lax.all_gather(y, inner_axis, axis=0, tiled=True)  # [a·b·t]: position i'·b + o' holds block (o', i')
    y = y.reshape(a, b, t, *rest).swapaxes(0, 1).reshape(a * b * t, *rest)  # -> position o'·a + i'
    return jnp.moveaxis(y, 0, axis)


# ------------------------------------------------------------------------------------------------------------
# Tensor-parallel experts: gate_up rows regrouped so a contiguous split gives each device [gate_j; up_j]
def tp_interleave_gate_up(gate_up: jax.Array, m: int) -> jax.Array:
    """[E, 2I, H] in the checkpoint's layout (all gate rows, then all up rows) -> the same rows regrouped as
    [gate_0; up_0; gate_1; up_1; ...], each piece I/m rows. Split contiguously over m devices, device j then
    holds [gate_j; up_j]: the column split of both projections, and `experts_*`'s split of the 2I rows into
    halves gives (gate_j, up_j) locally. Inverse: `tp_deinterleave_gate_up`."""
    E, I2, H = gate_up.shape
    if I2 % (2 * m):
        raise ShardingError(f"expert width I = {I2 // 2} cannot be split over a tensor-parallel group of {m}; "
                            f"use a group size that divides {I2 // 2}")
    return gate_up.reshape(E, 2, m, I2 // (2 * m), H).swapaxes(1, 2).reshape(E, I2, H)


def tp_deinterleave_gate_up(gate_up: jax.Array, m: int) -> jax.Array:
    """Inverse of `tp_interleave_gate_up`."""
    E, I2, H = gate_up.shape
    return gate_up.reshape(E, m, 2, I2 // (2 * m), H).swapaxes(1, 2).reshape(E, I2, H)


# ------------------------------------------------------------------------------------------------------------
# Expert-parallel (and tensor-parallel) MoE
class EPStats(NamedTuple):
    """dropped: slots past capacity over all devices (int32; 0 for "allgather"); drop_rate: dropped / (N·k);
    capacity: C, rows per (source device, expert) buffer (None for "allgather")."""

    dropped: jax.Array
    drop_rate: jax.Array
    capacity: int | None


def _rank_in_expert(experts: jax.Array, num_experts: int) -> jax.Array:
    """[t, k] position of each slot among this device's slots to the same expert, in token order."""
    order, group_sizes = sort_by_expert(experts, num_experts)
    starts = jnp.cumsum(group_sizes) - group_sizes
    flat = experts.reshape(-1)
    rank_sorted = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[flat[order]]
    return jnp.zeros(flat.shape, jnp.int32).at[order].set(rank_sorted).reshape(experts.shape)


def _local_experts(x, weights, experts, gate_up, down, impl):
    El, k = gate_up.shape[0], experts.shape[1]
    if k > El:  # fewer local experts than slots (e.g. 8 experts on 8 devices, top-2): one column per local expert
        # (top-k ids are distinct, so each column holds at most one slot's weight: the sum is exact)
        weights = jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, El, dtype=weights.dtype))
        experts = jnp.broadcast_to(jnp.arange(El, dtype=jnp.int32), weights.shape)
    if impl == "dense":
        return experts_dense(x, weights, experts, gate_up, down)
    return experts_sorted(x, weights, experts, gate_up, down)


def _allgather_body(x, packed, gate_up, down, *, ex_axes, tp_axes, impl, hierarchical, chunks):
    """Per device: x [t, H], packed [t, 2k]; gate_up/down hold this device's E/n experts (and, with tensor-
    parallel experts, its I/m slice of each: gate_up [E/n, 2I/m, H] as [gate_j; up_j], down [E/n, H, I/m]).

    With `chunks` K > 1 the t tokens go through in K independent pieces (gather, experts, scatter per piece): no
    piece waits on another's compute, so a scheduler with asynchronous collectives (TPU, GPU) overlaps piece
    j+1's all-gather and piece j-1's reduce-scatter with piece j's expert matmuls."""
    El = gate_up.shape[0]
    lo = jax.lax.axis_index(ex_axes) * El if ex_axes else 0
    gather = (functools.partial(hierarchical_all_gather, inner_axis=ex_axes[1], outer_axis=ex_axes[0])
              if hierarchical else functools.partial(jax.lax.all_gather, axis_name=ex_axes, axis=0, tiled=True))
    scatter = (functools.partial(hierarchical_psum_scatter, inner_axis=ex_axes[1], outer_axis=ex_axes[0])
               if hierarchical else functools.partial(jax.lax.psum_scatter, axis_name=ex_axes, scatter_dimension=0,
                                                      tiled=True))
    outs = []
    for x_c, p_c in zip(jnp.split(x, chunks), jnp.split(packed, chunks)):
        if ex_axes:
            x_c, p_c = gather(x_c), gather(p_c)  # [N_g, H], [N_g, 2k]: one all-gather moves ids and weights
        e, w = unpack_routing(p_c)
        local = (e >= lo) & (e < lo + El)
        # Slots routed to another device's experts: weight 0 (and a valid local id) so they add nothing here.
        y = _local_experts(x_c, jnp.where(local, w, 0.0).astype(x.dtype), jnp.where(local, e - lo, 0), gate_up,
                           down, impl)
        if ex_axes:
            y = scatter(y)
        if tp_axes:  # each device of a TP group summed over its I/m channels: add the partial sums
            y = jax.lax.psum(y, tp_axes)
        outs.append(y)
    return jnp.concatenate(outs) if chunks > 1 else outs[0], jnp.zeros((), jnp.int32)


def _alltoall_body(x, weights, experts, gate_up, down, *, ex_axes, tp_axes, all_axes, C, chunks):
    t, H = x.shape
    k = experts.shape[1]
    El = gate_up.shape[0]
    n = jax.lax.axis_size(ex_axes)
    E = n * El
    dtype = x.dtype
    rank = _rank_in_expert(experts, E)
    keep = rank < C
    row = jnp.where(keep, rank, C)  # out of bounds: dropped on the way in, 0 on the way out
    token = jnp.broadcast_to(jnp.arange(t)[:, None], (t, k))
    buf = jnp.zeros((E, C, H), dtype).at[experts, row].set(x[token], mode="drop")  # expert e = d·El + l
    buf = buf.reshape(n, El, C, H)
    backs = []
    # K chunks over the local experts: piece j carries experts [j·El/K, (j+1)·El/K) of every device, independent
    # of the other pieces, so its all-to-alls can overlap their expert matmuls.
    for j, (b_c, gu_c, dn_c) in enumerate(zip(jnp.split(buf, chunks, axis=1), jnp.split(gate_up, chunks),
                                               jnp.split(down, chunks))):
        recv = jax.lax.all_to_all(b_c, ex_axes, 0, 0, tiled=True)  # [n source, El/K, C, H]
        h = jnp.einsum("slch,lih->slci", recv, gu_c.astype(dtype))
        g, u = jnp.split(h, 2, axis=-1)
        out = jnp.einsum("slci,lhi->slch", jax.nn.silu(g) * u, dn_c.astype(dtype))
        backs.append(jax.lax.all_to_all(out, ex_axes, 0, 0, tiled=True))  # [n target, El/K, C, H]
    back = (jnp.concatenate(backs, axis=1) if chunks > 1 else backs[0]).reshape(E, C, H)
    y_slots = back.at[experts, row].get(mode="fill", fill_value=0)  # [t, k, H]
    y = jnp.einsum("nk,nkh->nh", (weights * keep).astype(dtype), y_slots)
    if tp_axes:
        y = jax.lax.psum(y, tp_axes)
    dropped = jax.lax.psum(jnp.sum(~keep, dtype=jnp.int32), all_axes)
    if tp_axes:  # every device of a TP group saw the same tokens: count them once
        dropped = dropped // _axes_size_traced(tp_axes)
    return y.astype(dtype), dropped


def _axes_size_traced(axes) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes)


@functools.lru_cache(maxsize=64)
def _ep_fn(mesh: Mesh, scheme: str, tok_axes, ex_axes, tp_axes, C, impl, hierarchical, chunks, interleave):
    tok = P(tok_axes or None, None)
    tp = tp_axes or None
    gu_spec, dn_spec = P(ex_axes or None, tp, None), P(ex_axes or None, None, tp)
    all_axes = tuple(mesh.axis_names)
    m = _axes_size(mesh, tp_axes)

    def prep(gate_up):
        return tp_interleave_gate_up(gate_up, m) if interleave and m > 1 else gate_up

    if scheme == "allgather":
        body = functools.partial(_allgather_body, ex_axes=ex_axes, tp_axes=tp_axes, impl=impl,
                                 hierarchical=hierarchical, chunks=chunks)
        f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, gu_spec, dn_spec), out_specs=(tok, P()),
                          check_vma=False)

        def run(x, weights, experts, gate_up, down):
            return f(x, pack_routing(experts, weights.astype(jnp.float32)), prep(gate_up), down)
    else:
        body = functools.partial(_alltoall_body, ex_axes=ex_axes, tp_axes=tp_axes, all_axes=all_axes, C=C,
                                 chunks=chunks)
        f = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, gu_spec, dn_spec), out_specs=(tok, P()),
                          check_vma=False)

        def run(x, weights, experts, gate_up, down):
            return f(x, weights, experts, prep(gate_up), down)
    return jax.jit(run)


def moe_ep(x, weights, experts, gate_up, down, *, mesh: Mesh, scheme: str = "allgather",
           capacity_factor: float | None = None, rules=LOGICAL_RULES, local_impl: str = "sorted",
           hierarchical: bool | None = None, chunks: int = 1, gate_up_layout: str = "checkpoint",
           return_stats: bool = False):
    """Expert-parallel (and/or tensor-parallel) routed-expert sum: the same `(x [N, H], weights [N, k],
    experts [N, k], gate_up [E, 2I, H], down [E, H, I]) -> y [N, H]` as `qwen35.moe.experts_*`, as a `shard_map`
    over `mesh`.

    Experts split over the mesh axes of the "experts" rule (`expert`, or `chip`×`core`): EP, E/n whole experts
    per device. Each expert's width I split over the axes of the "expert_mlp" rule (empty by default; map it to
    "model" for TP-MoE, e.g. `rules_with(expert_mlp=("model",))`): gate/up column-split, down row-split, partial
    outputs summed by an all-reduce over the TP group. Both at once is the EP × TP hybrid. Tokens split over the
    "batch" axes (which must include the expert axes; devices of one TP group hold the same tokens). `scheme`:
      "allgather"  all-gather tokens + packed routing over the expert axes, local experts, reduce-scatter back.
                   Exact (no capacity). `local_impl` "sorted" (grouped path; it computes all N_g·k gathered slots,
                   the non-local ones with weight 0 — a grouped-matmul kernel with a group offset would skip
                   them) or "dense" (every local expert on every gathered token). With two expert axes the
                   all-gather and the reduce-scatter are hierarchical (`hierarchical=None` = auto).
      "alltoall"   capacity buffers [n, E/n, C, H], C = ceil(capacity_factor·t·k/E) (default 1.25, capped at t),
                   all_to_all, local experts, all_to_all back. Equal to "allgather" when nothing is dropped
                   (capacity_factor >= E/k guarantees it); otherwise each device drops its own slots past C per
                   expert, in token order, like `experts_capacity` on its shard.
    `chunks` K: exchange and compute in K independent pieces (tokens for "allgather", local experts for
    "alltoall") so asynchronous collectives can overlap the expert matmuls; same result.
    `gate_up_layout` "checkpoint" (gate rows then up rows) or "tp_interleaved" (already regrouped by
    `tp_interleave_gate_up`, as `shard_model` stores it for TP-MoE).
    With `return_stats`, returns (y, EPStats)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if local_impl not in LOCAL_IMPLS:
        raise ValueError(f"local_impl must be one of {LOCAL_IMPLS}, got {local_impl!r}")
    if gate_up_layout not in ("checkpoint", "tp_interleaved"):
        raise ValueError(f"gate_up_layout must be 'checkpoint' or 'tp_interleaved', got {gate_up_layout!r}")
    if not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    x, weights, experts, gate_up, down = (jnp.asarray(a) for a in (x, weights, experts, gate_up, down))
    if x.ndim != 2 or weights.shape != experts.shape or weights.ndim != 2 or weights.shape[0] != x.shape[0]:
        raise ValueError(f"expected x [N, H], weights and experts [N, k]; got {x.shape}, {weights.shape}, "
                         f"{experts.shape}")
    N, _ = x.shape
    k = experts.shape[1]
    E, I = gate_up.shape[0], down.shape[2]
    ex_axes = mesh_axes_for("experts", mesh, rules)
    tp_axes = mesh_axes_for("expert_mlp", mesh, rules)
    tok_axes = mesh_axes_for("batch", mesh, rules)
    if not ex_axes and not tp_axes:
        raise ShardingError(f"mesh {dict(mesh.shape)} has no axis the 'experts' rule maps to "
                            f"({mesh_axes_for('experts', None, rules)}) nor one the 'expert_mlp' rule maps to; "
                            f"e.g. make_mesh(expert=8), or TP-MoE with rules_with(expert_mlp=('model',))")
    overlap = set(ex_axes) & set(tp_axes) | set(tok_axes) & set(tp_axes)
    if overlap:
        raise ShardingError(f"mesh axes {sorted(overlap)} cannot split both experts/tokens and the expert width; "
                            f"give tensor-parallel experts their own axis (e.g. 'model')")
    missing = [a for a in ex_axes if a not in tok_axes]
    if missing:
        raise ShardingError(f"tokens must be split over the expert axes too, but the 'batch' rule lacks {missing}")
    n = _axes_size(mesh, ex_axes)
    if E % n:
        raise ShardingError(f"{E} experts cannot be split over {_axes_desc(mesh, ex_axes)}; use an expert-axis "
                            f"size that divides {E}")
    m = _axes_size(mesh, tp_axes)
    if I % m:
        raise ShardingError(f"expert width I = {I} cannot be split over {_axes_desc(mesh, tp_axes)} (expert_mlp); "
                            f"use a tensor-parallel size that divides {I}")
    n_tok = _axes_size(mesh, tok_axes)
    if N % n_tok:
        raise ShardingError(f"{N} tokens cannot be split over {_axes_desc(mesh, tok_axes)} = {n_tok} devices; pad "
                            f"the batch to a multiple of {n_tok}")
    t = N // n_tok
    if hierarchical is None:
        hierarchical = len(ex_axes) == 2
    if hierarchical and len(ex_axes) != 2:
        raise ShardingError(f"hierarchical collectives need exactly two expert axes (outer, inner), got {ex_axes}")
    if scheme == "alltoall":
        if not ex_axes:
            raise ShardingError("scheme 'alltoall' exchanges tokens between expert-parallel devices; with tensor-"
                                "parallel experts only (no expert axis) use scheme 'allgather'")
        C = moe_capacity(t, E, k, 1.25 if capacity_factor is None else capacity_factor)
        if (E // n) % chunks:
            raise ShardingError(f"chunks={chunks} must divide the {E // n} local experts per device for 'alltoall'")
    else:
        if capacity_factor is not None:
            raise ValueError("capacity_factor applies to scheme='alltoall' only; 'allgather' drops nothing")
        C = None
        if t % chunks:
            raise ShardingError(f"chunks={chunks} must divide the {t} tokens per device for 'allgather'")
    f = _ep_fn(mesh, scheme, tok_axes, ex_axes, tp_axes, C, local_impl, bool(hierarchical), int(chunks),
               gate_up_layout == "checkpoint")
    y, dropped = f(x, weights, experts.astype(jnp.int32), gate_up, down)
    if not return_stats:
        return y
    return y, EPStats(dropped, dropped / (N * k), C)


def moe_ep_local(block, x, weights, experts, *, expert_axes: tuple[str, ...], hierarchical: bool | None = None):
    """The all-gather exchange as code that runs *inside* a `shard_map` over the mesh: what the serving engine's
    data-parallel step (`qwen35.serving.runner`, every device running its own rank's sequences) hands
    `SparseMoeBlock.__call__` as `routed_fn`. Same math as `moe_ep(scheme="allgather")`, whose `shard_map` cannot
    nest inside the step's own.

    x [t, H], weights, experts [t, k]: this device's tokens; `block.experts` holds this device's E/n experts. The
    tokens and packed routing metadata are all-gathered over `expert_axes` (hierarchically for two axes, by
    default), each device sums its own experts' share (the layer's local path: dense or sorted), and a
    reduce-scatter returns each device its own tokens' sums. With no expert axis the experts are whole on every
    device and this is the block's own `routed`."""
    if not expert_axes:
        return block.routed(x, weights, experts)
    if hierarchical is None:
        hierarchical = len(expert_axes) == 2
    gate_up, down = block.experts.dequantized(x.dtype)
    impl = "dense" if getattr(block, "local_impl", block.impl) == "dense" else "sorted"
    y, _ = _allgather_body(x, pack_routing(experts, weights.astype(jnp.float32)), gate_up, down,
                           ex_axes=tuple(expert_axes), tp_axes=(), impl=impl, hierarchical=bool(hierarchical),
                           chunks=1)
    return y


# ------------------------------------------------------------------------------------------------------------
# Communication accounting
def moe_comm_bytes(config: Qwen35Config, tokens_per_device: int, n_devices: int, scheme: str,
                   dtype_bytes: int = 2, capacity_factor: float = 1.25, tp_size: int = 1) -> dict[str, int]:
    """Bytes each device sends per MoE layer (ring collectives: an all-gather or reduce-scatter over n devices
    moves (n-1)/n of the full buffer out of each device; an all-to-all sends all but the own 1/n; an all-reduce
    is a reduce-scatter plus an all-gather, 2·(n-1)/n of the buffer).

    n = `n_devices` on the expert axes, m = `tp_size` devices per tensor-parallel expert group, t tokens per
    device (the devices of one TP group hold the same t tokens).
    "allgather": tokens (n-1)·t·H·b + packed routing (n-1)·t·2k·4 + reduce-scatter of outputs (n-1)·t·H·b.
    "alltoall":  two all-to-alls of [n, E/n, C, H] at b bytes: 2·(n-1)·(E/n)·C·H·b, C = capacity(t, E, k, cf).
    TP-MoE (m > 1) adds the all-reduce of the partial outputs [t, H]: 2·(m-1)/m·t·H·b.
    Splitting the exchange into chunks, or making it hierarchical, moves the same total.
    Returns a dict of the parts and "total"."""
    c, t, n, b, m = config, int(tokens_per_device), int(n_devices), int(dtype_bytes), int(tp_size)
    H, E, k = c.hidden_size, c.num_experts, c.num_experts_per_tok
    if E % n:
        raise ShardingError(f"{E} experts cannot be split over {n} devices")
    if scheme == "allgather":
        parts = {
            "all_gather_tokens": (n - 1) * t * H * b,
            "all_gather_routing": (n - 1) * t * 2 * k * 4,
            "reduce_scatter": (n - 1) * t * H * b,
        }
    elif scheme == "alltoall":
        C = moe_capacity(t, E, k, capacity_factor)
        one = (n - 1) * (E // n) * C * H * b
        parts = {"all_to_all_dispatch": one, "all_to_all_combine": one}
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if m > 1:
        parts["all_reduce_tp"] = 2 * (m - 1) * t * H * b // m
    parts["total"] = sum(parts.values())
    return parts


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_OPS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce")
_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                         r"(all-gather|reduce-scatter|all-to-all|all-reduce)(-start)?\(")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[\d+,(\d+)\]", line)  # iota form [groups, size]<=[...]
    if m:
        return int(m.group(1))
    raise ValueError(f"cannot read the replica groups of: {line.strip()[:200]}")


def hlo_collective_bytes(hlo_text: str, *, min_bytes: int = 16) -> dict[str, int]:
    """Bytes each device sends in the all-gathers, reduce-scatters, all-to-alls and all-reduces of a compiled
    HLO module (`jax.jit(f).lower(...).compile().as_text()`), by the ring model of `moe_comm_bytes`, read off
    each op's result shape and replica-group size n: all-gather (n-1)/n·result, reduce-scatter (n-1)·result,
    all-to-all (n-1)/n·result, all-reduce 2·(n-1)/n·result.

    Synchronous ops (as CPU emits) and the asynchronous forms TPU and GPU schedules use: `all-gather-start`
    (result tuple (operand, output): the output counts), `all-reduce-start`; reduce-scatter and all-to-all run
    asynchronously as `async-start` wrapping a computation that holds the plain op, which is counted once.
    Ops whose result is under `min_bytes` (scalar counters such as the dropped-slot count) are skipped.
    Keys: one per op kind, "total", "ops" (ops counted) and "async" (how many were `-start` forms)."""
    out = {op: 0 for op in _OPS} | {"ops": 0, "async": 0}
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        result, op, start = m.groups()
        arrays = _ARRAY.findall(result)
        if start and result.startswith("("):  # (operand(s), output): the output is the last array
            arrays = arrays[-1:]
        nbytes = sum(_DTYPE_BYTES[d] * math.prod(int(s) for s in dims.split(",") if s) for d, dims in arrays)
        if nbytes < min_bytes:
            continue
        n = _group_size(line)
        out[op] += {"reduce-scatter": (n - 1) * nbytes, "all-reduce": 2 * (n - 1) * nbytes // n}.get(
            op, (n - 1) * nbytes // n)
        out["ops"] += 1
        out["async"] += bool(start)
    out["total"] = sum(out[op] for op in _OPS)
    return out


# ------------------------------------------------------------------------------------------------------------
# Expert placement by load
def balanced_expert_placement(load, n_devices: int) -> np.ndarray:
    """A permutation of the E experts that spreads load over `n_devices` expert-parallel devices holding E/n
    contiguous experts each: experts sorted by load (heaviest first), each placed on the least-loaded device
    that still has room (greedy longest-processing-time). Returns `perm` [E] int: new slot i holds old expert
    perm[i], so device d gets experts perm[d·E/n:(d+1)·E/n]. Apply it to a checkpoint by permuting the router
    rows (`gate.weight[perm]`) and the expert weights (`gate_up_proj[perm]`, `down_proj[perm]`): the model's
    output is unchanged (routing picks the same experts under new ids) and the busiest device's load drops.

    `load`: tokens per expert [E] (e.g. `qwen35.moe.expert_load(...).tokens_per_expert` measured on traffic)."""
    load = np.asarray(load, dtype=np.float64)
    E = load.shape[0]
    if load.ndim != 1 or E % n_devices:
        raise ShardingError(f"need a load vector [E] with E a multiple of n_devices={n_devices}, got {load.shape}")
    per = E // n_devices
    bins: list[list[int]] = [[] for _ in range(n_devices)]
    totals = np.zeros(n_devices)
    for e in np.argsort(-load, kind="stable"):
        open_ = [d for d in range(n_devices) if len(bins[d]) < per]
        d = min(open_, key=lambda d: (totals[d], d))
        bins[d].append(int(e))
        totals[d] += load[e]
    return np.array([e for b in bins for e in sorted(b)], dtype=np.int64)


# ------------------------------------------------------------------------------------------------------------
# A sharded model: attention data-parallel, experts expert-parallel
def _batch_axes(mesh, rules=LOGICAL_RULES) -> tuple[str, ...]:
    return mesh_axes_for("batch", mesh, rules)


def _batch_spec(mesh, ndim: int, rules=LOGICAL_RULES) -> P:
    ax = _batch_axes(mesh, rules)
    return P(ax if ax else None, *([None] * (ndim - 1)))


def cache_specs(cache, mesh, rules=LOGICAL_RULES):
    """PartitionSpecs of a `HybridCache` (or its `jax.eval_shape`): every per-layer leaf (K, V [B, S, Hkv, Dh];
    GDN conv [B, C, Kc] and recurrent [B, Hv, Dk, Dv]) split over the "batch" axes (whole sequences per device),
    `index` replicated."""
    from qwen35.attention import KVCache
    from qwen35.gdn import GDNState
    from qwen35.model import HybridCache

    batch = _batch_axes(mesh, rules) or None

    def heads(logical):
        ax = mesh_axes_for(logical, mesh, rules)
        return None if not ax else ax[0] if len(ax) == 1 else ax

    def spec(layer):
        if isinstance(layer, KVCache):  # [B, S, Hkv, Dh]: under TP attention the KV heads follow k_proj's split
            s = P(batch, None, heads("kv_heads"), None)
            return KVCache(k=s, v=s)
        if isinstance(layer, GDNState):  # conv [B, C, Kc] (C = q|k|v channels: replicated), rec [B, Hv, Dk, Dv]
            return GDNState(conv=P(batch, None, None), recurrent=P(batch, heads("gdn_heads"), None, None))
        return jax.tree.map(lambda a: _batch_spec(mesh, a.ndim, rules), layer)

    layers = [spec(layer) for layer in cache.layers]
    return HybridCache(layers=tuple(layers), index=P())


def _check_batch(B: int, mesh, rules=LOGICAL_RULES) -> None:
    ax = _batch_axes(mesh, rules)
    n = _axes_size(mesh, ax)
    if B % n:
        raise ShardingError(f"batch {B} cannot be split over {_axes_desc(mesh, ax)} = {n} devices (attention is "
                            f"data-parallel: whole sequences per device); use a batch that is a multiple of {n}, "
                            f"e.g. {n * max(1, -(-B // n))} (pad with dummy sequences)")


def _named(mesh, tree):
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), tree,
                        is_leaf=lambda x: isinstance(x, P))


def _sharded_forward(mesh, rules, with_cache: bool):
    """The builder `qwen35.model.bound_call` takes for a sharded model's forward (built once per graph)."""
    def build(merge):
        def f(leaves, input_ids, cache):
            out = merge(leaves).forward(input_ids, cache)
            return out.logits, out.cache

        if not with_cache:
            return jax.jit(f, out_shardings=(jax.sharding.NamedSharding(mesh, _batch_spec(mesh, 3, rules)), None))
        return jax.jit(f)  # cache shardings: given per call in `ShardedLM.__call__` via lax.with_sharding_constraint
    return build


def _make_sharded_class():
    from qwen35.model import HybridCache, Qwen35ForCausalLM

    class ShardedQwen35ForCausalLM(Qwen35ForCausalLM):
        """A `Qwen35ForCausalLM` whose parameters live on `self.mesh` (see `shard_model`): `init_cache` returns a
        batch-sharded cache and calls run one jit with those shardings (batch split over all mesh axes)."""

        def init_cache(self, batch_size: int, max_len: int, dtype=None) -> HybridCache:
            _check_batch(batch_size, self.mesh, self.rules)
            shapes = jax.eval_shape(lambda: Qwen35ForCausalLM.init_cache(self, batch_size, max_len, dtype))
            sh = _named(self.mesh, cache_specs(shapes, self.mesh, self.rules))
            return jax.jit(lambda: Qwen35ForCausalLM.init_cache(self, batch_size, max_len, dtype),
                           out_shardings=sh)()

        def __call__(self, input_ids, cache: HybridCache | None = None):
            if isinstance(input_ids, (list, tuple)):
                input_ids = np.asarray(input_ids)
            self._check_call(input_ids, cache)
            if isinstance(input_ids, jax.core.Tracer):
                out = self.forward(input_ids, cache)
                return out.logits, out.cache
            _check_batch(input_ids.shape[0], self.mesh, self.rules)
            from qwen35.model import bound_call

            ids = jax.device_put(jnp.asarray(input_ids, jnp.int32),
                                 jax.sharding.NamedSharding(self.mesh, _batch_spec(self.mesh, 2, self.rules)))
            kind = ("sharded", self.mesh, self.rules, cache is not None)
            f, leaves = bound_call(self, kind, _sharded_forward(self.mesh, self.rules, cache is not None))
            logits, new_cache = f(leaves, ids, cache)
            if new_cache is not None:  # keep the cache where init_cache put it (a no-op when already there)
                new_cache = jax.device_put(new_cache, _named(self.mesh, cache_specs(new_cache, self.mesh,
                                                                                     self.rules)))
            return logits, new_cache

    return ShardedQwen35ForCausalLM


_SHARDED_CLASS = None


def sharded_model_class():
    """The `Qwen35ForCausalLM` subclass `shard_model` returns (made on first use: model.py imports moe.py)."""
    global _SHARDED_CLASS
    if _SHARDED_CLASS is None:
        _SHARDED_CLASS = _make_sharded_class()
    return _SHARDED_CLASS


def _rules_key(rules):
    return tuple(_rules_dict(rules).items())


def shard_model(model, mesh, *, moe_exchange: str = "allgather", rules=LOGICAL_RULES,
                capacity_factor: float | None = None, moe_chunks: int = 1):
    """A sharded copy of `model` (a `Qwen35ForCausalLM`) for serving on `mesh`. The layout is the rules table
    (`rules`, see `rules_with`) applied to the mesh:

      DP attention + EP (the Ironwood post's; default rules, `make_mesh(expert=8)` or `make_mesh(data=2, expert=4)`):
                   expert weights A[E_X, 2I, H] split over the "experts" axes (E/n per device); attention, GDN,
                   router, shared expert, embeddings replicated; the batch and its cache split over every axis.
      TP attention (a "model" axis, e.g. `make_mesh(expert=4, model=2)`): q/k/v/o heads, the vocabulary and the
                   shared expert split over "model" (Megatron-style; XLA inserts the all-reduces), the KV cache
                   split by KV head; tokens replicated over "model". `check_mesh` refuses head counts that do not
                   divide; `rules_with(kv_heads=())` replicates the KV heads instead (what TP=8 with 2 KV heads
                   would need: every device then holds the whole KV cache, see `memory_plan`).
      TP-MoE       `rules_with(expert_mlp=("model",))`: each expert's width split over "model" (gate/up rows
                   regrouped by `tp_interleave_gate_up` when placed, down split by columns), partial outputs
                   all-reduced; with an "expert" axis too, the EP x TP hybrid.

    MoE blocks switch to `moe_ep` with `moe_exchange` "allgather" (exact) or "alltoall" (capacity
    `capacity_factor`, default 1.25; `num_experts / top_k` guarantees no drops), in `moe_chunks` pieces.
    `smodel.init_cache(B, S)` gives a cache placed to match; `logits, cache = smodel(ids, cache=cache)` runs one
    jit; B must be a multiple of the batch devices (a `ShardingError` says so).

    The original model is untouched (the copy holds new arrays)."""
    from flax import nnx

    if moe_exchange not in SCHEMES:
        raise ValueError(f"moe_exchange must be one of {SCHEMES}, got {moe_exchange!r}")
    cls = sharded_model_class()
    check_mesh(model.config, mesh, rules)
    if not mesh_axes_for("experts", mesh, rules) and not mesh_axes_for("expert_mlp", mesh, rules):
        raise ShardingError(f"mesh {dict(mesh.shape)} has no axis the 'experts' rule maps to; use e.g. "
                            f"make_mesh(expert=8) or make_mesh(data=2, expert=4) (or TP-MoE: a 'model' axis with "
                            f"rules_with(expert_mlp=('model',)))")
    rules_key = _rules_key(rules)
    m = _axes_size(mesh, mesh_axes_for("expert_mlp", mesh, rules))
    if m > 1 and any(layer.mlp.experts.fp8 for layer in model.model.layers):
        raise ShardingError("TP-MoE splits each expert's rows, which FP8 experts' 128-row scale blocks do not "
                            "follow; use expert parallelism, or load the checkpoint with fp8='dequantize'")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs = param_specs(params, mesh, rules)

    def regroup(path, leaf):  # TP-MoE: gate|up rows regrouped so each device's contiguous slice is [gate_j; up_j]
        return tp_interleave_gate_up(leaf, m) if m > 1 and _path_name(path).endswith("gate_up_proj") else leaf

    params = jax.tree_util.tree_map_with_path(regroup, params)
    placed = jax.device_put(params, _named(mesh, specs))
    rest = jax.device_put(rest, jax.sharding.NamedSharding(mesh, P())) if jax.tree.leaves(rest) else rest
    smodel = nnx.merge(graphdef, placed, rest)
    smodel.__class__ = cls  # same attributes, sharded methods
    smodel.mesh, smodel.rules = mesh, rules_key
    for layer in smodel.model.layers:
        layer.mlp.use_expert_parallel(mesh, moe_exchange, capacity_factor, rules=rules_key, chunks=moe_chunks,
                                      gate_up_layout="tp_interleaved" if m > 1 else "checkpoint")
    return smodel


# ------------------------------------------------------------------------------------------------------------
# Full size on paper: bytes per device for DP vs TP attention
def _layout_axes(mesh_shape: Mapping[str, int], logical: str, rules) -> int:
    return math.prod(mesh_shape[a] for a in mesh_axes_for(logical, None, rules) if a in mesh_shape)


def memory_plan(config: Qwen35Config, mesh_shape: Mapping[str, int] | None = None,
                concurrency: Sequence[int] = (64, 256, 512), context: int = 8192, *, expert_dtype_bytes: int = 1,
                dense_dtype_bytes: int = 2, kv_dtype_bytes: int = 2, state_dtype_bytes: int = 4,
                device_hbm_bytes: int = 96 * 2**30, rules=LOGICAL_RULES) -> dict[str, Any]:
    """Per-device HBM bytes of weights and decode state for two layouts of the same n = prod(mesh_shape) devices,
    at each `concurrency` (sequences) of `context` tokens. Weights and caches only (no activations, no
    workspace, no fragmentation): a lower bound on what must fit.

      "dp"  (the workload's): experts split over the "experts" axes of `mesh_shape` (E/8 on {"expert": 8}),
            dense weights (attention, GDN, router, shared expert, embeddings, norms) replicated; sequences split
            over the "batch" axes, so a device holds the KV cache and GDN state of B/n_batch sequences.
      "tp"  (the rejected one, TP = n for attention): experts split n ways as well, dense weights split n ways
            except k_proj/v_proj (KV heads replicated: Hkv < n cannot be split), GDN state split n ways over its
            value heads, and the whole KV cache of every sequence on every device (replicated KV heads).

    Returns {"devices", "per_sequence": cache_bytes_per_sequence, "dp"/"tp": {"weights_expert", "weights_dense",
    "weights", "kv_per_seq", "gdn_per_seq", "seqs_per_device"(B ->), "by_concurrency": {B: {"kv", "gdn",
    "weights", "total", "fits"}}, "max_concurrency"}}. `max_concurrency`: the largest B whose total fits
    `device_hbm_bytes` (for "dp" a multiple of the batch devices)."""
    c = config
    mesh_shape = dict(mesh_shape or {"expert": 8})
    n = math.prod(mesh_shape.values())
    n_ex = _layout_axes(mesh_shape, "experts", rules)
    n_b = _layout_axes(mesh_shape, "batch", rules)
    if c.num_experts % n_ex:
        raise ShardingError(f"{c.num_experts} experts cannot be split over {n_ex} devices")
    pc = c.param_counts()["components"]
    routed = pc["routed_experts"]["total"]
    dense = sum(v["total"] for k, v in pc.items() if k != "routed_experts")
    kv_proj = c.num_full_layers * 2 * c.num_key_value_heads * c.head_dim * c.hidden_size
    per_seq = c.cache_bytes_per_sequence(context, kv_dtype_bytes, state_dtype_bytes)
    kv_seq, gdn_seq = per_seq["kv_bytes"], per_seq["gdn_recurrent_bytes"] + per_seq["gdn_conv_bytes"]
    hv_split = n if c.linear_num_value_heads % n == 0 else 1
    layouts = {
        "dp": dict(weights_expert=routed * expert_dtype_bytes // n_ex, weights_dense=dense * dense_dtype_bytes,
                   kv_per_seq=kv_seq, gdn_per_seq=gdn_seq, batch_split=n_b),
        "tp": dict(weights_expert=routed * expert_dtype_bytes // n,
                   weights_dense=(dense - kv_proj) * dense_dtype_bytes // n + kv_proj * dense_dtype_bytes,
                   kv_per_seq=kv_seq, gdn_per_seq=gdn_seq // hv_split, batch_split=1),
    }
    out: dict[str, Any] = {"devices": n, "context": context, "per_sequence": per_seq,
                           "device_hbm_bytes": device_hbm_bytes}
    for name, d in layouts.items():
        w = d["weights_expert"] + d["weights_dense"]
        s = d["kv_per_seq"] + d["gdn_per_seq"]
        nb = d.pop("batch_split")
        rows = {}
        for B in concurrency:
            seqs = -(-int(B) // nb)
            kv, gdn = seqs * d["kv_per_seq"], seqs * d["gdn_per_seq"]
            rows[int(B)] = {"seqs_per_device": seqs, "weights": w, "kv": kv, "gdn": gdn, "total": w + kv + gdn,
                            "fits": w + kv + gdn <= device_hbm_bytes}
        free = device_hbm_bytes - w
        out[name] = {**d, "weights": w, "state_per_seq": s, "batch_devices": nb, "by_concurrency": rows,
                     "max_concurrency": max(0, free // s) * nb}
    return out


def decode_step_lowering(config: Qwen35Config, mesh, batch: int, max_len: int, *, moe_exchange: str = "allgather",
                         param_dtype=jnp.bfloat16, platforms: Sequence[str] | None = ("tpu",), rules=LOGICAL_RULES):
    """Lower (not run) one decode step (T = 1, cache of `max_len`) of `config`'s model sharded as `shard_model`
    would, from shapes alone: the model from `nnx.eval_shape`, parameters and cache as `jax.ShapeDtypeStruct`s
    with their shardings on `mesh` (a `Mesh` or an `AbstractMesh`). Nothing is allocated, so the 397B model works
    on a laptop. `platforms` ("tpu",) exports with `jax.export` (the TPU lowering rules apply); None lowers with
    `jax.jit(...).lower` for the local backend. Returns the `jax.export.Exported` or `jax.stages.Lowered`."""
    from flax import nnx

    from qwen35.model import Qwen35ForCausalLM

    check_mesh(config, mesh, rules)
    _check_batch(batch, mesh, rules)
    abstract = Qwen35ForCausalLM.abstract(config, param_dtype=param_dtype)
    for layer in abstract.model.layers:
        layer.mlp.use_expert_parallel(mesh, moe_exchange)
    graphdef, params = nnx.split(abstract)
    specs = param_specs(nnx.state(abstract, nnx.Param), mesh, rules)

    def sds(a, spec):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    params = jax.tree.map(sds, params, specs)
    cache = jax.eval_shape(lambda: abstract.init_cache(batch, max_len))
    cache = jax.tree.map(sds, cache, cache_specs(cache, mesh, rules))
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32,
                               sharding=jax.sharding.NamedSharding(mesh, _batch_spec(mesh, 2, rules)))

    def step(params, ids, cache):
        out = nnx.merge(graphdef, params).forward(ids, cache)
        return out.logits, out.cache

    if platforms is None:
        return jax.jit(step).lower(params, ids, cache)
    return jax.export.export(jax.jit(step), platforms=tuple(platforms))(params, ids, cache)
