"""Sampling parameters and the batched sampler that runs inside the jitted step.

Each row of a step has its own temperature, top-k, top-p and seed. The random key of a row is
`fold_in(key(seed), n)` with n the number of tokens the request has generated so far, so a request's samples
depend only on its seed and its own logits, never on what else shares the batch (same seed → same tokens).

`verify_drafts` is speculative decoding's acceptance rule: it keeps the drafted tokens the target model agrees
with and replaces the first one it does not, so the tokens it emits follow the target's distribution exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SamplingParams", "sampling_probs", "sample", "verify_drafts"]


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


def verify_drafts(logits: jax.Array, drafts: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  seeds: jax.Array, counters: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative decoding's verification of k drafted tokens per row: (tokens [S, k + 1] int32, counts [S]): each
    row emits tokens[:count], 1 <= count <= k + 1.

    logits [S, k + 1, V]: the target model's logits at the row's last committed token and at each draft (position
    i predicts the token after draft i); drafts [S, k]. The drafter is deterministic (the MTP head's argmax), so
    its distribution q is one-hot on each draft and the standard rejection rule (Leviathan et al. 2023, "Fast
    Inference from Transformers via Speculative Decoding", https://arxiv.org/abs/2211.17192) becomes: accept draft
    i + 1 with probability p_i(draft) (min(1, p/q) with q = 1); at the first rejection emit a token from the
    residual max(0, p_i - q_i) renormalised, which is p_i with the draft removed; if every draft is accepted, emit
    a bonus token from p_k. Every emitted token then follows the target's distribution `sampling_probs` (its
    temperature, top-k, top-p) exactly. Greedy rows (temperature 0) accept while the draft is the argmax and emit
    the argmax where they stop: the same tokens as decoding one at a time. Position i of a row draws with
    fold_in(key(seed), counter + i), split in two (the acceptance test and the replacement token)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S, K1]
    g_count = (1 + jnp.sum(jnp.cumprod(greedy[:, :-1] == drafts, axis=1), axis=1)).astype(jnp.int32)
    hot = temperature > 0
    return jax.lax.cond(  # an all-greedy batch skips the sampling work (sorting every position's logits)
        jnp.any(hot),
        lambda: _rejection(logits, drafts, temperature, top_k, top_p, seeds, counters, greedy, g_count),
        lambda: (greedy, g_count))


def _rejection(logits, drafts, temperature, top_k, top_p, seeds, counters, greedy, g_count):
    S, K1, V = logits.shape
    k = K1 - 1
    rep = lambda x: jnp.repeat(x, K1)  # noqa: E731
    probs = sampling_probs(logits.reshape(S * K1, V), rep(temperature), rep(top_k), rep(top_p)).reshape(S, K1, V)
    keys = jax.vmap(lambda s, n: jax.vmap(lambda i: jax.random.split(jax.random.fold_in(jax.random.key(s), n + i)))(
        jnp.arange(K1)))(seeds, counters)  # [S, K1, 2]
    u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(kk[0])))(keys)  # [S, K1]
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]  # [S, k]
    accepted = jnp.sum(jnp.cumprod(u[:, :k] < p_draft, axis=1), axis=1)  # [S] drafts kept
    rows = jnp.arange(S)
    p_stop = probs[rows, accepted]  # [S, V]: where the row stops
    rejected = drafts[rows, jnp.minimum(accepted, k - 1)]
    resid = jnp.where((accepted < k)[:, None] & (jnp.arange(V)[None, :] == rejected[:, None]), 0.0, p_stop)
    total = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(total > 0, resid / jnp.where(total > 0, total, 1.0), p_stop)
    logp = jnp.where(resid > 0, jnp.log(jnp.where(resid > 0, resid, 1.0)), -jnp.inf)
    last = jax.vmap(lambda kk, lp: jax.random.categorical(kk[1], lp))(keys[rows, accepted], logp).astype(jnp.int32)
    padded = jnp.concatenate([drafts, jnp.zeros((S, 1), drafts.dtype)], axis=1).astype(jnp.int32)
    s_tokens = jnp.where(jnp.arange(K1)[None, :] == accepted[:, None], last[:, None], padded)
    hot = temperature > 0
    return (jnp.where(hot[:, None], s_tokens, greedy), jnp.where(hot, accepted + 1, g_count).astype(jnp.int32))
