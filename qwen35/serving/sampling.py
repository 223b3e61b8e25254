"""Sampling parameters and the batched sampler that runs inside the jitted step.

Each row of a step has its own temperature, top-k, top-p and seed. The random key of a row is
`fold_in(key(seed), n)` with n the number of tokens the request has generated so far, so a request's samples
depend only on its seed and its own logits, never on what else shares the batch (same seed → same tokens).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SamplingParams", "sampling_probs", "sample"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids {self.stop_token_ids} must lie in [0, {vocab_size})")
        return self


def sampling_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """The distribution a row samples from: softmax(logits / T) restricted to the top_k most likely tokens and to
    the smallest set whose probability reaches top_p (the nucleus), renormalised. logits [S, V] float32,
    temperature / top_p [S] float32, top_k [S] int32 (0 = all). Rows with temperature 0 get a one-hot argmax."""
    S, V = logits.shape
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    z = logits.astype(jnp.float32) / t
    order = jnp.argsort(-z, axis=-1)  # descending; ties broken by index
    z_sorted = jnp.take_along_axis(z, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    k = jnp.where(top_k > 0, top_k, V)[:, None]
    keep = rank < k
    p_sorted = jax.nn.softmax(jnp.where(keep, z_sorted, -jnp.inf), axis=-1)
    before = jnp.cumsum(p_sorted, axis=-1) - p_sorted  # mass of the strictly more likely tokens
    keep = keep & (before < top_p[:, None])
    p_sorted = jnp.where(keep, p_sorted, 0.0)
    p_sorted = p_sorted / jnp.sum(p_sorted, axis=-1, keepdims=True)
    probs = jnp.zeros((S, V), jnp.float32).at[jnp.arange(S)[:, None], order].set(p_sorted)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], probs, greedy)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seeds: jax.Array,
           counters: jax.Array) -> jax.Array:
    """One token per row [S] int32: argmax where temperature == 0, else a draw from `sampling_probs` with the
    row's key fold_in(key(seed), counter)."""
    probs = sampling_probs(logits, temperature, top_k, top_p)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, counters)
    logp = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)), -jnp.inf)
    drawn = jax.vmap(lambda k, lp: jax.random.categorical(k, lp))(keys, logp)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
