"""Simple generation: prefill the prompt, then decode token by token inside one jitted `lax.scan` (no Python
loop over tokens, one dispatch for the whole generation). For serving many requests, see `qwen35.serving`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["generate", "sample_next"]


def sample_next(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None = None) -> jax.Array:
    """Next token from logits [B, V]: argmax when temperature == 0, else softmax(logits / temperature) sampling,
    optionally restricted to the top_k logits."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7))
def _generate(graphdef, state, prompt, cache, max_new_tokens, temperature, top_k, eos_token_id, key):
    model = nnx.merge(graphdef, state)
    out = model.forward(prompt, cache)
    keys = jax.random.split(key, max_new_tokens)
    tok = sample_next(out.logits[:, -1], keys[0], temperature, top_k)
    done = jnp.zeros(tok.shape, bool) if eos_token_id is None else tok == eos_token_id

    def step(carry, k):
        tok, cache, done = carry
        o = model.forward(tok[:, None], cache)
        nxt = sample_next(o.logits[:, -1], k, temperature, top_k)
        if eos_token_id is not None:  # a finished sequence keeps emitting eos
            nxt = jnp.where(done, eos_token_id, nxt)
            done = done | (nxt == eos_token_id)
        return (nxt, o.cache, done), nxt

    (_, cache, _), rest = jax.lax.scan(step, (tok, out.cache, done), keys[1:])
    return jnp.concatenate([tok[:, None], rest.T], axis=1), cache


def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, seed: int = 0, *,
             top_k: int | None = None, eos_token_id: int | None = None, return_cache: bool = False):
    """Generate `max_new_tokens` tokens after `prompt_ids` ([T] or [B, T] ints; equal-length prompts).

    Greedy when `temperature == 0` (the default), sampled otherwise (reproducible with `seed`). Sequences that
    emit `eos_token_id` keep emitting it. Returns the new tokens as a numpy array [B, max_new_tokens] (or [N]
    for a 1-D prompt), and the final cache too if `return_cache`.
    """
    ids = np.asarray(prompt_ids)
    squeeze = ids.ndim == 1
    if squeeze:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty [T] or [B, T] array of token ids, got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be integers, got dtype {ids.dtype}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    B, T = ids.shape
    total = T + max_new_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {total} tokens exceeds the model's context of "
            f"{model.config.max_position_embeddings}; shorten the prompt or generate fewer tokens"
        )
    model._check_call(jnp.asarray(ids, jnp.int32), None)  # vocab range etc.
    cache = model.init_cache(B, total)
    graphdef, state = nnx.split(model)
    toks, cache = _generate(graphdef, state, jnp.asarray(ids, jnp.int32), cache, int(max_new_tokens),
                            float(temperature), top_k, eos_token_id, jax.random.key(seed))
    toks = np.asarray(toks)
    if squeeze:
        toks = toks[0]
    return (toks, cache) if return_cache else toks
