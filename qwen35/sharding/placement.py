"""Placing a model on a mesh: parameter PartitionSpecs by checkpoint name, sharded loading (each tensor straight
to its devices), cache specs, and `shard_model`, which builds the placed model (`PlacedLM`) with its execution."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from qwen35.config import Qwen35Config
from qwen35.execution import Execution
from qwen35.model import HybridCache, Qwen35ForCausalLM, bound_call
from qwen35.sharding.exchange import moe_on_mesh, tp_interleave_gate_up
from qwen35.sharding.mesh import (LOGICAL_RULES, ShardingError, _axes_desc, _axes_size, _rules_dict, check_mesh,
                                  logical_to_spec, mesh_axes_for, param_logical_axes)


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


def load_sharded(path, mesh: Mesh, *, rules=LOGICAL_RULES, **load_kwargs):
    """`load_hf_checkpoint` straight onto `mesh` (`checkpoint_shardings`), then `shard_model`: the serving model
    for a checkpoint bigger than one device, e.g. `load_sharded(path, make_mesh(expert=8), dtype=jnp.bfloat16)`
    for the Ironwood post's DP attention + EP layout. The mesh is checked against the checkpoint's config before any
    tensor is read; `load_kwargs` go to `load_hf_checkpoint` (its `execution` is the placed model's, plus the
    mesh)."""
    from qwen35.weights import load_hf_checkpoint

    config = Qwen35Config.from_hf(path)  # ConfigError / ShardingError here, before any tensor is read
    model = load_hf_checkpoint(path, shardings=checkpoint_shardings(mesh, rules, config), **load_kwargs)
    return shard_model(model, mesh, rules=rules)




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
        return jax.jit(f)  # the cache keeps the shardings `PlacedLM.init_cache` gave it
    return build


class PlacedLM(Qwen35ForCausalLM):
    """A `Qwen35ForCausalLM` placed on a mesh, built by `shard_model` (or `load_sharded`) with its execution's mesh
    and rules. The layers are the model's own and run the same code; what differs on a mesh:

      `routed_fn()`   the MoE's routed-expert sum through the exchange (`qwen35.sharding.moe_on_mesh`);
      `init_cache`    the dense cache placed batch-split over the mesh's batch axes;
      `__call__`      one jit of the forward with the input ids and logits batch-split."""

    placed = True

    def routed_fn(self):
        return moe_on_mesh

    @property
    def rules(self) -> tuple:
        return self.execution.rules

    def _new_cache(self, batch_size: int, max_len: int, dtype) -> HybridCache:
        mesh, rules = self.execution.mesh, self.rules
        _check_batch(batch_size, mesh, rules)
        zeros = functools.partial(self.zeros_cache, batch_size, max_len, dtype)
        sh = _named(mesh, cache_specs(jax.eval_shape(zeros), mesh, rules))
        return jax.jit(zeros, out_shardings=sh)()

    def _call(self, input_ids, cache):
        mesh, rules = self.execution.mesh, self.rules
        _check_batch(input_ids.shape[0], mesh, rules)
        ids = jax.device_put(jnp.asarray(input_ids, jnp.int32),
                             jax.sharding.NamedSharding(mesh, _batch_spec(mesh, 2, rules)))
        f, leaves = bound_call(self, ("sharded", cache is not None), _sharded_forward(mesh, rules, cache is not None))
        logits, new_cache = f(leaves, ids, cache)
        if new_cache is not None:  # keep the cache where init_cache put it (a no-op when already there)
            new_cache = jax.device_put(new_cache, _named(mesh, cache_specs(new_cache, mesh, rules)))
        return logits, new_cache


def placed_abstract(config: Qwen35Config, execution: Execution, mesh, rules=LOGICAL_RULES, **kwargs) -> PlacedLM:
    """A `PlacedLM`'s structure with shapes only (nothing allocated), run by `execution` on `mesh` with `rules`:
    what `shard_model` merges the placed arrays into, and what the memory plans lower. `kwargs` go to the
    constructor (param_dtype, dtype, fp8_experts, mtp)."""
    return PlacedLM.abstract(config, execution=execution.replace(mesh=mesh, rules=_rules_key(rules)), **kwargs)


def _rules_key(rules):
    return tuple(_rules_dict(rules).items())


def shard_model(model, mesh, *, rules=LOGICAL_RULES, execution: Execution | None = None) -> PlacedLM:
    """The placed copy of `model` (a `Qwen35ForCausalLM`) for serving on `mesh`: a `PlacedLM` built with the
    model's execution (or `execution`, when given) plus `mesh` and `rules`. The layout is the rules table (`rules`,
    see `rules_with`) applied to the mesh:

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

      pure DP      `make_mesh(data=8)` (a small model's natural layout): every weight replicated, the batch split;
                   each device runs its own tokens through every expert (no exchange).

    The MoE blocks run through `moe_ep` with the execution's `exchange`: "allgather" (exact), "ragged" (exact, a
    dropless all-to-all) or "alltoall" (capacity `capacity_factor`, default 1.25; `num_experts / top_k`
    guarantees no drops), in `moe_chunks` pieces.
    `smodel.init_cache(B, S)` gives a cache placed to match; `logits, cache = smodel(ids, cache=cache)` runs one
    jit; B must be a multiple of the batch devices (a `ShardingError` says so).

    The original model is untouched (the copy holds new arrays)."""
    from flax import nnx

    ex = model.execution if execution is None else execution
    check_mesh(model.config, mesh, rules)
    if ex.exchange != "allgather" and not mesh_axes_for("experts", mesh, rules):
        raise ShardingError(f"mesh {dict(mesh.shape)} has no axis the 'experts' rule maps to: the experts are "
                            f"replicated and no tokens move, so exchange={ex.exchange!r} does not apply; use "
                            f"Execution(exchange='allgather') (each device runs its own tokens through every "
                            f"expert) or a mesh with an expert axis, e.g. make_mesh(expert=8)")
    m = _axes_size(mesh, mesh_axes_for("expert_mlp", mesh, rules))
    fp8 = any(layer.mlp.experts.fp8 for layer in model.model.layers)
    if m > 1 and fp8:
        raise ShardingError("TP-MoE splits each expert's rows, which FP8 experts' 128-row scale blocks do not "
                            "follow; use expert parallelism, or load the checkpoint with fp8='dequantize'")
    if ex.kernels == "pallas":
        from qwen35.kernels.interpret import check_interpreter_threads

        check_interpreter_threads(mesh.size)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs = param_specs(params, mesh, rules)

    def regroup(path, leaf):  # TP-MoE: gate|up rows regrouped so each device's contiguous slice is [gate_j; up_j]
        return tp_interleave_gate_up(leaf, m) if m > 1 and _path_name(path).endswith("gate_up_proj") else leaf

    params = jax.tree_util.tree_map_with_path(regroup, params)
    placed = jax.device_put(params, _named(mesh, specs))
    rest = jax.device_put(rest, jax.sharding.NamedSharding(mesh, P())) if jax.tree.leaves(rest) else rest
    # The placed model's structure, built with its execution (every layer holds it), filled with the placed arrays
    abstract = placed_abstract(model.config, ex, mesh, rules, dtype=model.dtype, fp8_experts=fp8,
                               mtp=model.mtp is not None)
    placed_def = nnx.split(abstract, nnx.Param, ...)[0]
    return nnx.merge(placed_def, placed, rest)
