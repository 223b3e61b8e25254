"""The engine's memory on a real host, from shapes alone: its own decode step compiled for a mesh, per-device bytes
read from the compiled programs' memory analysis.

    plan = step_memory(qwen35.qwen35_397b_a17b(), mesh, concurrency=512, context=8192 + 1024)          # DP x EP
    plan = step_memory(qwen35.qwen35_397b_a17b(), mesh, concurrency=512, context=9216, layout="replicated")

Nothing is allocated: the model comes from `Qwen35ForCausalLM.abstract`, its parameters and the engine's paged
cache are `jax.ShapeDtypeStruct`s placed on the mesh, and each program is lowered and compiled (XLA works out
every buffer's size per device) but never run. The programs are the engine's own `LayerwiseStep` (one per layer,
as it runs on CPU): each layer's program holds that layer's weights and cache, so the step's per-device bytes are
the sum over layers of their arguments plus the largest scratch (temp) space any one of them needs.

`export_step(engine, shape)` exports the engine's whole step (one program, its parameters, cache and a padding
batch of that shape as abstract arrays) with `jax.export`; for `platforms=("tpu",)` every Pallas kernel of
`kernels="pallas"` is lowered with Mosaic (`qwen35.kernels.interpret.lower_for_tpu`), so a CPU machine checks
that the serving step it tests in interpret mode also lowers for a TPU.

Two layouts of the same `concurrency` sequences on the same devices:
  "dp"          the engine on the mesh: each device one data-parallel rank with concurrency / n sequences (its own
                pool of pages and GDN states), experts split by expert parallelism;
  "replicated"  attention not data-parallel: one engine whose cache holds every sequence, placed on every device
                (what the engine did before it ran on a mesh), experts split the same way.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from qwen35.execution import Execution
from qwen35.pool import pool_layout
from qwen35.serving.cache import init_paged_cache, pool_blocks
from qwen35.serving.engine import _page_width, _pow2
from qwen35.serving.runner import DataParallel, LayerwiseStep, _build_step, _leaf_spec, layer_indices, padding_batch

__all__ = ["step_memory", "export_step", "LAYOUTS"]

LAYOUTS = ("dp", "replicated")


def _sds(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def step_memory(config, mesh, *, concurrency: int, context: int, block_size: int = 256, layout: str = "dp",
                param_dtype=jnp.bfloat16, fp8_experts: bool = True, execution: Execution = Execution()) -> dict:
    """Per-device bytes of the engine's decode step for `config` on `mesh` at `concurrency` sequences of `context`
    tokens (the cache pool sized as the engine sizes it: per sequence ceil(context / block_size) pages plus its
    GDN state blocks, plus the scratch block), compiled from shapes alone.

    Returns {"layout", "devices", "seqs_per_cache", "num_blocks", "weights", "cache", "temp", "total"} in bytes
    per device (weights and cache: the compiled programs' argument bytes; temp: the largest scratch of any one
    program) and the per-program figures under "programs". The model runs as `execution` says, on `mesh`."""
    from flax import nnx

    from qwen35 import sharding as S

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    rules = S.LOGICAL_RULES
    S.check_mesh(config, mesh, rules)
    dp_axes, ex_axes = S.mesh_axes_for("batch", mesh, rules), S.mesh_axes_for("experts", mesh, rules)
    n_dp = math.prod(mesh.shape[a] for a in dp_axes)
    ranks = n_dp if layout == "dp" else 1
    if concurrency % ranks:
        raise S.ShardingError(f"concurrency {concurrency} cannot be split over {ranks} data-parallel ranks; use a "
                              f"multiple of {ranks}")
    seqs = concurrency // ranks
    pages_per_seq = -(-context // block_size)
    pool = pool_layout(config, block_size, param_dtype)
    num_blocks = pool_blocks(pool, seqs, context)

    model = S.placed_abstract(config, execution, mesh, rules, param_dtype=param_dtype, fp8_experts=fp8_experts)
    graphdef, state = nnx.split(model)
    specs = S.param_specs(nnx.state(model, nnx.Param), mesh, rules)
    placed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                            sharding=jax.sharding.NamedSharding(mesh, s)), state, specs)
    model = nnx.merge(graphdef, placed)
    if layout == "dp":
        dp = DataParallel(mesh, tuple(dp_axes), tuple(ex_axes))
        where = dp.sharding()
    else:
        dp = None  # replicated attention: the placed model's MoE by moe_ep over the mesh
        where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    dtype = jnp.dtype(param_dtype)
    cache = jax.eval_shape(lambda: init_paged_cache(config, num_blocks, block_size, dtype,
                                                    ranks=None if dp is None else ranks))
    cache = _sds(cache, where)
    Sb, P = _pow2(seqs, 1), _page_width(pages_per_seq)
    batch = padding_batch(Sb, P, Sb, state_blocks=pool.state_blocks, page_size=block_size)  # decode: Tb = Sb
    lead = () if dp is None else (ranks,)
    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(lead + a.shape, a.dtype, sharding=where), batch)
    h = jax.ShapeDtypeStruct(lead + (Sb, config.hidden_size), dtype, sharding=where)

    run = LayerwiseStep(model, dp)
    progs = {}

    def analyse(name, program, *args, **kw):
        if name not in progs:
            m = program.lower(*args, **kw).compile().memory_analysis()
            progs[name] = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
                           "temp": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}
        return progs[name]

    seen: set[int] = set()

    def nbytes_per_device(tree):  # each array once (tied embeddings: the embed and head programs share one)
        total = 0
        for a in jax.tree.leaves(tree):
            if id(a) not in seen:
                seen.add(id(a))
                total += int(np.prod(a.sharding.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize
        return total

    weights = 0
    embed, leaves = run.embed
    analyse("embed", embed, leaves, batch.tokens, dtype=dtype)
    weights += nbytes_per_device(leaves)
    for i, ((prog, leaves), idx) in enumerate(zip(run.layers, layer_indices(model.model.layers))):
        kind = config.layer_types[i]
        analyse(f"layer ({kind})", prog, leaves, np.int32(idx), h, cache.pool, batch)
        weights += nbytes_per_device(leaves)
    cache_bytes = nbytes_per_device(cache.pool)  # one pool, read and written by every layer's program
    head, leaves = run.head
    analyse("head", head, leaves, h, batch, return_logits=False)
    weights += nbytes_per_device(leaves)
    temp = max(p["temp"] for p in progs.values())
    return {"layout": layout, "devices": mesh.size, "ranks": ranks, "seqs_per_cache": seqs,
            "num_blocks": num_blocks, "weights": weights, "cache": cache_bytes, "temp": temp,
            "total": weights + cache_bytes + temp, "programs": progs}


def export_step(engine, shape, *, platforms=("tpu",), return_logits: bool = False):
    """`jax.export` of `engine`'s step (the fused program: embedding, every layer, head and sampling; on a mesh
    the `shard_map` over its data-parallel ranks with the MoE's exchange) for a step of `shape` (an `Engine.step_shape`
    or the tuple (Sb, P, Tb, Sp, Lb, Pc)), from abstract arrays: nothing runs. For a TPU, the Pallas kernels lower
    with Mosaic (checking the TPU lowering rules interpret mode skips); the program is built afresh, so a step
    traced earlier in interpret mode is not reused. Returns the `jax.export.Exported`."""
    from flax import nnx

    from qwen35.kernels.interpret import lower_for_tpu

    dp, model = engine.dp, engine.model
    graphdef, state = nnx.split(model)
    treedef, leaves = jax.tree.structure(state), jax.tree.leaves(state)
    specs = None if dp is None else tuple(_leaf_spec(a, dp) for a in leaves)
    run = _build_step(lambda ls: nnx.merge(graphdef, jax.tree.unflatten(treedef, ls)), dp, specs, None)
    Sb, P, Tb, Sp, Lb, Pc = tuple(shape)[:6]
    batch = padding_batch(Sb, P, Tb, Sp, Lb, Pc, state_blocks=engine.layout.state_blocks, page_size=engine.block_size)

    def abstract(a, lead=(), sharding=None):
        return jax.ShapeDtypeStruct(lead + tuple(np.shape(a)), a.dtype,
                                    sharding=sharding or getattr(a, "sharding", None))

    lead, where = ((), None) if dp is None else ((dp.size,), dp.sharding())
    args = (jax.tree.map(abstract, leaves), jax.tree.map(abstract, engine.cache),
            jax.tree.map(lambda a: abstract(a, lead, where), batch))
    ctx = lower_for_tpu() if "tpu" in platforms else contextlib.nullcontext()
    with ctx:
        return jax.export.export(run, platforms=list(platforms))(*args, return_logits=return_logits)
