"""Small building blocks shared by the layers: a Linear that stores its weight the way checkpoints do, and the
two RMSNorms of Qwen3.5.

Weights keep the Hugging Face layout and names (`weight` is `[out, in]`, y = x @ W.T) so the checkpoint mapping
is the identity on names and shapes; einsum strings spell the axes.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

DEFAULT_INIT_STD = 0.02  # transformers' initializer_range


_ABSTRACT = contextvars.ContextVar("qwen35_abstract_init", default=False)


@contextlib.contextmanager
def abstract_init():
    """Inside this context, parameter initialisers return zeros: use it with `nnx.eval_shape` to get a model's
    shapes without tracing a random-number generator per parameter (which takes ~1 s per layer to trace)."""
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def _host_rng(rngs: nnx.Rngs) -> np.random.Generator | None:
    """A numpy generator seeded from the next `rngs.params()` key, or None while tracing (eval_shape, jit).

    Random initialisation on the host avoids compiling one XLA program per parameter shape, which made building
    even the tiny model take tens of seconds on a CPU; the values stay a deterministic function of the Rngs."""
    key = rngs.params()
    if isinstance(key, jax.core.Tracer):
        return None
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist())


def init_normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
    """N(0, std²) parameters of `shape` (host-side when possible; see `_host_rng`)."""
    if _ABSTRACT.get():
        return jnp.zeros(shape, dtype)
    rng = _host_rng(rngs)
    if rng is None:
        return std * jax.random.normal(rngs.params(), shape, dtype)
    return jnp.asarray(std * rng.standard_normal(shape, dtype=np.float32), dtype)


def init_uniform(rngs: nnx.Rngs, shape: tuple[int, ...], low: float, high: float, dtype) -> jax.Array:
    """U(low, high) parameters of `shape` (host-side when possible)."""
    if _ABSTRACT.get():
        return jnp.zeros(shape, dtype)
    rng = _host_rng(rngs)
    if rng is None:
        return jax.random.uniform(rngs.params(), shape, dtype, low, high)
    return jnp.asarray(rng.uniform(low, high, size=shape).astype(np.float32), dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, zero_centred: bool = True) -> jax.Array:
    """RMSNorm in fp32, cast back to x.dtype. Zero-centred (Qwen3.5's default): y = x̂ · (1 + w)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (xf * (1.0 + w if zero_centred else w)).astype(dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """GDN output norm: y = w · rmsnorm(x) · silu(z), with transformers' cast order (norm in fp32, scale in the
    input dtype, gate in fp32)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight.astype(dtype) * xf.astype(dtype)
    y = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    return y.astype(dtype)


class Linear(nnx.Module):
    """y = x @ weight.T, weight `[out, in]` as stored in safetensors checkpoints. No bias (Qwen3.5 has none)."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 std: float = DEFAULT_INIT_STD):
        self.in_features, self.out_features = in_features, out_features
        self.weight = nnx.Param(init_normal(rngs, (out_features, in_features), std, param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...i,oi->...o", x, self.weight[...].astype(x.dtype))


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm (weight initialised to 0, applied as 1 + w)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, zero_centred=True)


class RMSNormGated(nnx.Module):
    """Gated RMSNorm of the GDN output: plain weight [Dv] (initialised to 1), shared by all heads."""

    def __init__(self, dim: int, eps: float = 1e-6, *, param_dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        return gated_rms_norm(x, z, self.weight[...], self.eps)
