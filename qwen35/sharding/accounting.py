"""Bytes on paper and in compiled programs: what each exchange sends (`moe_comm_bytes`; for a given routing,
`ragged_bytes`), what a compiled HLO
module sends (`hlo_collective_bytes`), the per-device memory of DP vs TP attention (`memory_plan`), and one
decode step lowered from shapes (`decode_step_lowering`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qwen35.config import Qwen35Config
from qwen35.moe import capacity as moe_capacity
from qwen35.execution import EXCHANGES, Execution
from qwen35.sharding.mesh import LOGICAL_RULES, ShardingError, check_mesh, mesh_axes_for
from qwen35.sharding.placement import _batch_spec, placed_abstract, _check_batch, cache_specs, param_specs


# ------------------------------------------------------------------------------------------------------------
# Communication accounting
def moe_comm_bytes(config: Qwen35Config, tokens_per_device: int, n_devices: int, exchange: str,
                   dtype_bytes: int = 2, capacity_factor: float = 1.25, tp_size: int = 1) -> dict[str, int]:
    """Bytes each device sends per MoE layer (ring collectives: an all-gather or reduce-scatter over n devices
    moves (n-1)/n of the full buffer out of each device; an all-to-all sends all but the own 1/n; an all-reduce
    is a reduce-scatter plus an all-gather, 2·(n-1)/n of the buffer).

    n = `n_devices` on the expert axes, m = `tp_size` devices per tensor-parallel expert group, t tokens per
    device (the devices of one TP group hold the same t tokens).
    "allgather": tokens (n-1)·t·H·b + packed routing (n-1)·t·2k·4 + reduce-scatter of outputs (n-1)·t·H·b.
    "alltoall":  two all-to-alls of [n, E/n, C, H] at b bytes: 2·(n-1)·(E/n)·C·H·b, C = capacity(t, E, k, cf).
    "ragged":    the slots routed to other devices, there and back: 2·(n-1)/n·t·k·H·b expected under uniform
                 routing (the real bytes follow the routing: `ragged_bytes`), + the all-gather of the [E] slot
                 counts (n-1)·E·4 + two all-to-alls of the [E] offsets 2·(n-1)/n·E·4. Against "allgather" the
                 token bytes are k/n as many: fewer for k < n, more for the released model's k = 10 on 8 devices.
    TP-MoE (m > 1) adds the all-reduce of the partial outputs [t, H]: 2·(m-1)/m·t·H·b.
    Splitting the exchange into chunks, or making it hierarchical, moves the same total.
    Returns a dict of the parts and "total"."""
    c, t, n, b, m = config, int(tokens_per_device), int(n_devices), int(dtype_bytes), int(tp_size)
    H, E, k = c.hidden_size, c.num_experts, c.num_experts_per_tok
    if exchange == "allgather":
        parts = {
            "all_gather_tokens": (n - 1) * t * H * b,
            "all_gather_routing": (n - 1) * t * 2 * k * 4,
            "reduce_scatter": (n - 1) * t * H * b,
        }
    elif exchange == "alltoall":  # the only formula that needs whole experts per device (E/n capacity buffers)
        if E % n:
            raise ShardingError(f"{E} experts cannot be split over {n} devices")
        C = moe_capacity(t, E, k, capacity_factor)
        one = (n - 1) * (E // n) * C * H * b
        parts = {"all_to_all_dispatch": one, "all_to_all_combine": one}
    elif exchange == "ragged":
        one = (n - 1) * t * k * H * b // n
        parts = {"ragged_dispatch": one, "ragged_combine": one, "all_gather_counts": (n - 1) * E * 4,
                 "all_to_all_offsets": 2 * (n - 1) * E * 4 // n}
    else:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if m > 1:
        parts["all_reduce_tp"] = 2 * (m - 1) * t * H * b // m
    parts["total"] = sum(parts.values())
    return parts


def ragged_bytes(experts, n_devices: int, num_experts: int, hidden: int, dtype_bytes: int = 2) -> np.ndarray:
    """Token bytes each device sends in `moe_ep` with exchange "ragged" for this routing (dispatch + combine, counts and
    offsets aside): experts [N, k] over N = n·t tokens, device i holding tokens [i·t, (i+1)·t) and experts
    [i·E/n, (i+1)·E/n). A slot to another device's expert is one row out and its output one row back (the combine
    is sent by the expert's device: the same count summed over devices). Returns [n] bytes, by device."""
    e = np.asarray(experts).reshape(n_devices, -1)  # [source, t·k]
    dest = e // (num_experts // n_devices)
    src = np.arange(n_devices)[:, None]
    out = ((dest != src).sum(1)).astype(np.int64)  # rows each device sends out
    back = np.bincount(dest[dest != src], minlength=n_devices)  # rows each device sends back
    return (out + back) * hidden * dtype_bytes


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


def decode_step_lowering(config: Qwen35Config, mesh, batch: int, max_len: int, *,
                         execution: Execution = Execution(), param_dtype=jnp.bfloat16,
                         platforms: Sequence[str] | None = ("tpu",), rules=LOGICAL_RULES):
    """Lower (not run) one decode step (T = 1, cache of `max_len`) of `config`'s model placed as `shard_model`
    would place it with `execution` (plus the mesh), from shapes alone: the model from `nnx.eval_shape`,
    parameters and cache as `jax.ShapeDtypeStruct`s with their shardings on `mesh` (a `Mesh` or an
    `AbstractMesh`). Nothing is allocated, so the 397B model works on a laptop. `platforms` ("tpu",) exports with `jax.export` (the TPU lowering rules apply); None lowers with
    `jax.jit(...).lower` for the local backend. Returns the `jax.export.Exported` or `jax.stages.Lowered`."""
    from flax import nnx

    check_mesh(config, mesh, rules)
    _check_batch(batch, mesh, rules)
    abstract = placed_abstract(config, execution, mesh, rules, param_dtype=param_dtype)
    graphdef, params = nnx.split(abstract)
    specs = param_specs(nnx.state(abstract, nnx.Param), mesh, rules)

    def sds(a, spec):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    params = jax.tree.map(sds, params, specs)
    cache = jax.eval_shape(lambda: abstract.zeros_cache(batch, max_len))
    cache = jax.tree.map(sds, cache, cache_specs(cache, mesh, rules))
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32,
                               sharding=jax.sharding.NamedSharding(mesh, _batch_spec(mesh, 2, rules)))

    def step(params, ids, cache):
        out = nnx.merge(graphdef, params).forward(ids, cache)
        return out.logits, out.cache

    if platforms is None:
        return jax.jit(step).lower(params, ids, cache)
    return jax.export.export(jax.jit(step), platforms=tuple(platforms))(params, ids, cache)
