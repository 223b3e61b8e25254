"""The hybrid Qwen3.5-MoE decoder: embeddings, decoder layers by `layer_types` (Gated DeltaNet or gated attention,
each followed by the sparse MoE), final norm, lm_head.

The module tree mirrors the Hugging Face names, so `model.layers.3.self_attn.q_proj.weight` is
`model.model.layers[3].self_attn.q_proj.weight` here and the checkpoint mapping is the identity on names.

    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))      # or qwen35.load_hf_checkpoint(path)
    cache = model.init_cache(batch_size, max_len)
    logits, cache = model(input_ids, cache=cache)             # prefill; positions continue from the cache
    logits, cache = model(next_ids, cache=cache)              # decode (T = 1) or a multi-token continuation
    logits, _ = model(input_ids)                              # no cache: a plain forward

Calls are jitted: the module is split into (graph, params) once, a `jax.jit` of the pure forward is built once per
graph, and each call reads the current parameter arrays from the module's Variables (see `bound_call`). One cache
serves all three phases: per GDN layer the conv and recurrent state, per attention layer K/V, and the number of
tokens already seen.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35.attention import KVCache
from qwen35.config import LINEAR, Qwen35Config
from qwen35.decoder import DecoderLayer
from qwen35.execution import Execution
from qwen35.gdn import GDNState
from qwen35.layers import DEFAULT_INIT_STD, Linear, RMSNorm, abstract_init, init_normal
from qwen35.mtp import MultiTokenPredictor

__all__ = ["HybridCache", "ModelOutput", "DecoderLayer", "Qwen35ForCausalLM", "forward_fn", "output_logits"]


class HybridCache(NamedTuple):
    """Decode state of the whole model: `layers[i]` is a `GDNState` (linear layers) or a `KVCache` (attention
    layers); `index` (int32 scalar) is the number of tokens already processed, i.e. the next token's position."""

    layers: tuple
    index: jax.Array

    @property
    def max_len(self) -> int:
        for s in self.layers:
            if isinstance(s, KVCache):
                return int(s.k.shape[1])
        return np.iinfo(np.int32).max  # no attention layer: GDN state has no length limit

    @property
    def batch_size(self) -> int:
        s = self.layers[0]
        return int((s.conv if isinstance(s, GDNState) else s.k).shape[0])

    def nbytes(self) -> int:
        return int(sum(x.nbytes for x in jax.tree.leaves(self.layers)))


class ModelOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] float32
    cache: HybridCache | None
    hidden_states: tuple  # L + 1 entries: the embeddings, then each layer's output (before the final norm)
    router_logits: tuple  # L entries of [B·T, E] float32


class Embed(nnx.Module):
    """`embed_tokens.weight` [V, H]."""

    def __init__(self, vocab: int, hidden: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(init_normal(rngs, (vocab, hidden), DEFAULT_INIT_STD, param_dtype))

    def __call__(self, ids: jax.Array, dtype) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0).astype(dtype)


def output_logits(norm, lm_head, embed_tokens, h: jax.Array) -> jax.Array:
    """The model's head on hidden states h [..., H]: the final norm, then lm_head, or with tied embeddings
    (lm_head None) the embedding matrix; float32 logits [..., V]."""
    x = norm(h)
    if lm_head is not None:
        logits = lm_head(x)
    else:
        logits = jnp.einsum("...d,vd->...v", x, embed_tokens.weight[...].astype(x.dtype))
    return logits.astype(jnp.float32)


class TextModel(nnx.Module):
    """`model.*`: embed_tokens, layers, norm."""

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32, fp8_experts: bool = False,
                 execution: Execution = Execution()):
        c = config
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, rngs=rngs, param_dtype=param_dtype)
        self.layers = nnx.List([
            DecoderLayer(c, i, rngs=rngs, param_dtype=param_dtype, fp8_experts=fp8_experts, execution=execution)
            for i in range(c.num_hidden_layers)
        ])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)


class Qwen35ForCausalLM(nnx.Module):
    """Qwen3.5-MoE causal LM (text). See the module docstring for the API.

    `dtype` is the activation dtype (default: the parameters' dtype); the GDN core, router, norms and softmax
    run in float32 regardless. `fp8_experts` stores the routed experts as block-scaled FP8 (`qwen35.moe.Experts`;
    what `load_hf_checkpoint(..., fp8="keep")` builds for an FP8 checkpoint).

    `mtp=True` adds the checkpoint's multi-token-prediction head (`self.mtp`, a `qwen35.mtp.MultiTokenPredictor`;
    `config.mtp_num_hidden_layers` layers), run by `mtp_logits`; the decoder never runs it.

    `execution` (a `qwen35.execution.Execution`: kernels, expert path, W8A8) is given once, here, and every layer
    is built with it. On one device its mesh is None; `qwen35.sharding.shard_model` builds a placed model (a
    `qwen35.sharding.PlacedLM`, this class with the mesh's cache placement, jit and MoE exchange) with the same
    value plus the mesh. The layers run the same code either way.
    """

    placed = False  # a model on a mesh is a `qwen35.sharding.PlacedLM`, built by `shard_model` / `load_sharded`

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs | None = None, param_dtype=jnp.float32,
                 dtype=None, fp8_experts: bool = False, mtp: bool = False, execution: Execution = Execution()):
        config.validate()
        if not isinstance(execution, Execution):
            raise TypeError(f"execution must be a qwen35.execution.Execution, got {type(execution).__name__}")
        if execution.mesh is not None and not self.placed:
            raise ValueError("an Execution with a mesh belongs to a placed model: build the model on one device and "
                             "place it with qwen35.sharding.shard_model(model, mesh) (or load_sharded)")
        self.config, self.execution = config, execution
        self.dtype = jnp.dtype(dtype or param_dtype)
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.model = TextModel(config, rngs=rngs, param_dtype=param_dtype, fp8_experts=fp8_experts,
                               execution=execution)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, rngs=rngs, param_dtype=param_dtype)
        else:
            self.lm_head = None
        if mtp:
            self.mtp = MultiTokenPredictor(config, rngs=rngs, param_dtype=param_dtype, fp8_experts=fp8_experts,
                                           execution=execution)
        else:
            self.mtp = None

    @classmethod
    def abstract(cls, config: Qwen35Config, **kwargs) -> "Qwen35ForCausalLM":
        """The model with `jax.ShapeDtypeStruct` leaves instead of arrays: shapes only, nothing allocated (the
        397B preset takes a second or two). `kwargs` go to the constructor."""
        kwargs.setdefault("rngs", nnx.Rngs(0))
        with abstract_init():
            return nnx.eval_shape(lambda: cls(config, **kwargs))

    # -- cache ---------------------------------------------------------------------------------------------
    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> HybridCache:
        """Zeros for every layer: K/V for `max_len` tokens (attention), conv + recurrent state (GDN); on a placed
        model, placed on its mesh."""
        if batch_size < 1 or max_len < 1:
            raise ValueError(f"init_cache needs batch_size >= 1 and max_len >= 1, got {batch_size}, {max_len}")
        if max_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_len {max_len} exceeds the model's max_position_embeddings "
                f"({self.config.max_position_embeddings}); use a shorter cache or a config with RoPE scaling (YaRN)"
            )
        return self._new_cache(batch_size, max_len, dtype)

    def _new_cache(self, batch_size: int, max_len: int, dtype) -> HybridCache:
        """`init_cache` after its checks (a placed model places it)."""
        return self.zeros_cache(batch_size, max_len, dtype)

    def zeros_cache(self, batch_size: int, max_len: int, dtype=None) -> HybridCache:
        """`init_cache`'s arrays, unchecked and unplaced."""
        dtype = jnp.dtype(dtype or self.dtype)
        layers = []
        for layer in self.model.layers:
            if layer.layer_type == LINEAR:
                layers.append(layer.linear_attn.init_state(batch_size, dtype))
            else:
                layers.append(layer.self_attn.init_cache(batch_size, max_len, dtype))
        return HybridCache(layers=tuple(layers), index=jnp.zeros((), jnp.int32))

    @property
    def mesh(self):
        """The mesh a sharded model (`qwen35.sharding.shard_model`) lives on; None for a model on one device."""
        return self.execution.mesh

    def routed_fn(self):
        """What the MoE blocks sum their routed experts with besides their own `SparseMoeBlock.routed`: None on one
        device; a placed model's expert-parallel exchange (`qwen35.sharding.PlacedLM`)."""
        return None

    # -- forward -------------------------------------------------------------------------------------------
    def forward(self, input_ids: jax.Array, cache: HybridCache | None = None) -> ModelOutput:
        """The forward pass as traced code (call it under jit, or use `__call__`, which does)."""
        B, T = input_ids.shape
        h = self.model.embed_tokens(input_ids, self.dtype)
        index = jnp.zeros((), jnp.int32) if cache is None else cache.index
        routed_fn = self.routed_fn()
        hidden, routers, new_states = [h], [], []
        for i, layer in enumerate(self.model.layers):
            state = None if cache is None else cache.layers[i]
            h, new_state, router_logits = layer(h, state, index, routed_fn=routed_fn)
            hidden.append(h)
            routers.append(router_logits)
            new_states.append(new_state)
        logits = output_logits(self.model.norm, self.lm_head, self.model.embed_tokens, h)
        new_cache = None if cache is None else HybridCache(tuple(new_states), index + T)
        return ModelOutput(logits, new_cache, tuple(hidden), tuple(routers))

    def final_hidden(self, out: ModelOutput) -> jax.Array:
        """The last layer's hidden states after the final norm [B, T, H]: what lm_head reads, and what the MTP head
        takes."""
        return self.model.norm(out.hidden_states[-1])

    def mtp_logits(self, hidden: jax.Array, next_ids: jax.Array, cache=None, cache_index=0, step: int = 0):
        """The MTP head's guesses (traced code): hidden [B, T, H] from `final_hidden` at positions t, next_ids
        [B, T] the tokens at t + 1 -> (float32 logits [B, T, V] for the tokens at t + 2, the MTP layers' new K/V
        cache or None). `cache` (from `self.mtp.init_cache`) holds the MTP attention's keys by position t;
        `cache_index` is the first position of this call."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head: build it with mtp=True, or load with "
                             "load_hf_checkpoint(..., mtp=True)")
        routed_fn = self.routed_fn()
        v, new_cache, _ = self.mtp(hidden.astype(self.dtype), self.model.embed_tokens(next_ids, self.dtype),
                                   cache=cache, cache_index=cache_index, step=step, routed_fn=routed_fn)
        return output_logits(self.mtp.norm, self.lm_head, self.model.embed_tokens, v), new_cache

    def _check_call(self, input_ids, cache):
        if not hasattr(input_ids, "shape") or len(input_ids.shape) != 2:
            raise ValueError(f"input_ids must be [B, T] integers, got {getattr(input_ids, 'shape', type(input_ids))}")
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids is empty (T = 0): give at least one token")
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be integers, got dtype {input_ids.dtype}")
        if not isinstance(input_ids, jax.core.Tracer):
            xp = np if isinstance(input_ids, np.ndarray) else jnp
            lo, hi = int(xp.min(input_ids)), int(xp.max(input_ids))
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got values in [{lo}, {hi}]")
        if cache is not None:
            if not isinstance(cache, HybridCache) or len(cache.layers) != self.config.num_hidden_layers:
                raise ValueError("cache must be the HybridCache returned by model.init_cache(batch, max_len)")
            if cache.batch_size != B:
                raise ValueError(f"input_ids has batch {B} but the cache was made for batch {cache.batch_size}")
            if not isinstance(cache.index, jax.core.Tracer):
                used, cap = int(cache.index), cache.max_len
                if used + T > cap:
                    what = "prompt" if used == 0 else "continuation"
                    raise ValueError(
                        f"{what} of {T} tokens at position {used} does not fit the cache of {cap} tokens; "
                        f"make a larger one with model.init_cache({B}, max_len={used + T}) or shorten the input"
                    )
        elif T > self.config.max_position_embeddings:
            raise ValueError(f"input of {T} tokens is longer than max_position_embeddings "
                             f"({self.config.max_position_embeddings})")

    def __call__(self, input_ids, cache: HybridCache | None = None):
        """`logits [B, T, V] float32, new cache (None without a cache)`, jitted."""
        if isinstance(input_ids, (list, tuple, np.ndarray)):
            input_ids = np.asarray(input_ids)
        self._check_call(input_ids, cache)
        if isinstance(input_ids, jax.core.Tracer):  # already inside someone's jit: just trace
            out = self.forward(input_ids, cache)
            return out.logits, out.cache
        return self._call(input_ids, cache)

    def _call(self, input_ids, cache):
        """`__call__` after its checks, outside any jit: one jit of `forward` (a placed model jits over its mesh)."""
        run, leaves = bound_call(self, "forward", _build_forward)
        return run(leaves, jnp.asarray(input_ids, jnp.int32), cache)

    def forward_with_details(self, input_ids, cache: HybridCache | None = None) -> ModelOutput:
        """Like `__call__` but also returns every layer's hidden state and router logits (jitted)."""
        input_ids = np.asarray(input_ids) if isinstance(input_ids, (list, tuple)) else input_ids
        self._check_call(input_ids, cache)
        run, leaves = bound_call(self, "details", _build_details)
        return run(leaves, jnp.asarray(input_ids, jnp.int32), cache)

    def num_params(self) -> int:
        return int(sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param))))


# Calls without per-call module handling. `nnx.split` walks the whole module graph (about 8 ms for the tiny model,
# more than its forward on CPU) and a graph definition given to jit as a static argument is hashed on every call
# (about 1 ms). So a program is built once per (kind, graph definition, parameter tree structure) with both closed
# over, and called with the flat list of parameter arrays; a module remembers its split, and re-splits only when a
# cheap walk of its attributes (`_structure`) shows that the graph changed — a submodule or Variable replaced, a
# static attribute set. New values of the same Variables (`v.value = ...`)
# are read on every call.
_PROGRAMS: dict = {}
_BOUND: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PRIMITIVES = (int, float, complex, bool, str, bytes, type(None))


def bind_program(kind, module, build):
    """(program, `module`'s nnx State): `build(merge)` makes the jitted program, where `merge(leaves)` rebuilds the
    module from its flat parameter arrays; built once per (kind, graph definition, tree structure) and shared by
    every module of that structure. `kind` is any hashable tag."""
    graphdef, state = nnx.split(module)
    treedef = jax.tree.structure(state)
    key = (kind, graphdef, treedef)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = build(lambda leaves: nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)))
    return _PROGRAMS[key], state


def clear_programs() -> None:
    """Forget every program `bind_program` built and every module's remembered split (the compiled code they hold
    is freed with `jax.clear_caches()`); later calls rebuild them. The test suite does this between files."""
    _PROGRAMS.clear()
    _BOUND.clear()


_KINDS: dict = {}  # type -> how `_structure` walks it (isinstance on nnx types is slow: a metaclass check)


def _kind(t: type) -> str:
    k = _KINDS.get(t)
    if k is None:
        k = _KINDS[t] = ("variable" if issubclass(t, nnx.Variable) else "node" if issubclass(t, nnx.Pytree)
                         else "seq" if issubclass(t, (list, tuple)) else "dict" if issubclass(t, dict) else "leaf")
    return k


def _structure(root) -> list:
    """Everything that makes up `root`'s graph, cheaply: node types, attribute names, the Variable objects and
    the static attribute values (compared by identity, or by value for Python scalars and strings)."""
    out, stack = [], [root]
    while stack:
        x = stack.pop()
        k = _kind(type(x))
        if k == "node":
            out.append(type(x))
            for name, v in vars(x).items():
                if not name.startswith("_pytree__"):
                    out.append(name)
                    stack.append(v)
        elif k == "seq":
            out += [type(x), len(x)]
            stack.extend(x)
        elif k == "dict":
            out.append(dict)
            out.extend(x.keys())
            stack.extend(x.values())
        else:  # a Variable or a static value
            out.append(x)
    return out


def _same_structure(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x is y or (type(x) in _PRIMITIVES and type(x) is type(y) and x == y) for x, y in zip(a, b))


def bound_call(module, kind, build):
    """(program, flat parameter arrays) to call `module` with: `bind_program`, remembered per module until its
    graph changes. The arrays are read from the module's Variables at every call."""
    structure = _structure(module)
    entry = _BOUND.get(module)
    if entry is None or not _same_structure(entry["structure"], structure):
        entry = {"structure": structure, "programs": {}}
        _BOUND[module] = entry
    if kind not in entry["programs"]:
        program, state = bind_program(kind, module, build)
        variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        if len(variables) != len(jax.tree.leaves(state)) or not all(isinstance(v, nnx.Variable) for v in variables):
            raise TypeError("bound_call expects every parameter leaf to be one nnx.Variable's array")
        entry["programs"][kind] = (program, variables)
    program, variables = entry["programs"][kind]
    return program, [v.get_raw_value() for v in variables]


def _build_forward(merge):
    @jax.jit
    def run(leaves, input_ids, cache):
        out = merge(leaves).forward(input_ids, cache)
        return out.logits, out.cache
    return run


def _build_details(merge):
    return jax.jit(lambda leaves, input_ids, cache: merge(leaves).forward(input_ids, cache))


def forward_fn(model: Qwen35ForCausalLM) -> tuple[Any, Any]:
    """(pure_fn, params) with `pure_fn(params, input_ids, cache) -> (logits, cache)` jitted: for benchmarks and
    loops that want zero per-call module handling."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, input_ids, cache):
        out = nnx.merge(graphdef, state).forward(input_ids, cache)
        return out.logits, out.cache

    return f, state
