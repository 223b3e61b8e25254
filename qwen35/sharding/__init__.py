"""Sharding for Qwen3.5: meshes, the logical-axis rules table, packed routing metadata, expert-parallel MoE with
three token-exchange schemes, a hierarchical reduce-scatter, and the communication bytes each scheme costs.

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
      local experts only (slots routed elsewhere: weight 0, sorted past them)    y_partial [N_g, H]
      --psum_scatter(expert)-->  y [t, H]   (hierarchical: inside a chip first, then across chips)
      each device sends (n-1)·t·(2·H·b + 2k·4) bytes.

  "alltoall" (capacity-based dispatch, as in GShard/Switch)
      x [t, H] -> buffers [n, E/n, C, H], C = ceil(cf·t·k/E)  --all_to_all-->  [n (source), E/n, C, H]
      local experts  --all_to_all back-->  [E, C, H]  -> weighted combine; slots past C are dropped (counted)
      each device sends 2·(n-1)·(E/n)·C·H·b bytes.

  "ragged" (dropless all-to-all, as inference servers exchange tokens)
      slots sorted by expert, [E] counts all-gathered  --ragged_all_to_all-->  exactly the routed rows, grouped
      by local expert  -> grouped SwiGLU  --ragged_all_to_all back-->  weighted combine; nothing dropped
      each device sends ~2·(n-1)/n·t·k·H·b bytes (k/n of "allgather"'s token bytes). XLA:CPU has no ragged
      all-to-all: there `ragged_all_to_all_padded` gives the same result through a dense, padded all-to-all.

A mesh with no expert axis (`make_mesh(data=8)`) replicates the experts and exchanges nothing.

`moe_comm_bytes` gives those figures from shapes; `hlo_collective_bytes` reads them off a compiled program.

One topic a module, every public name re-exported here: `mesh` (meshes, the rules table, `check_mesh`),
`exchange` (packed routing, hierarchical collectives, `moe_ep` and `moe_ep_local`, expert placement by load),
`placement` (parameter and cache specs, sharded loading, `shard_model` and the `PlacedLM` it builds), `accounting`
(bytes on paper and in compiled programs, memory plans, a decode step lowered from shapes).
"""

from qwen35.sharding.mesh import (LOGICAL_RULES, PARAM_LOGICAL_AXES, ShardingError, check_mesh, logical_to_spec,
                                  make_mesh, mesh_axes_for, param_logical_axes, rules_with)
from qwen35.sharding.exchange import (EPStats, balanced_expert_placement, hierarchical_all_gather,
                                      hierarchical_psum_scatter, moe_ep, moe_ep_local, moe_on_mesh, pack_routing,
                                      ragged_all_to_all_padded, tp_deinterleave_gate_up, tp_interleave_gate_up,
                                      unpack_routing)
from qwen35.sharding.placement import (PlacedLM, cache_specs, checkpoint_shardings, load_sharded, param_specs,
                                       placed_abstract, shard_model)
from qwen35.sharding.accounting import (decode_step_lowering, hlo_collective_bytes, memory_plan, moe_comm_bytes,
                                        ragged_bytes)

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
    "moe_on_mesh",
    "rules_with",
    "tp_interleave_gate_up",
    "tp_deinterleave_gate_up",
    "hierarchical_psum_scatter",
    "hierarchical_all_gather",
    "balanced_expert_placement",
    "moe_comm_bytes",
    "ragged_bytes",
    "ragged_all_to_all_padded",
    "hlo_collective_bytes",
    "cache_specs",
    "shard_model",
    "PlacedLM",
    "placed_abstract",
    "memory_plan",
    "decode_step_lowering",
]
