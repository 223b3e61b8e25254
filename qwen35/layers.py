"""Small building blocks shared by the layers: a Linear that stores its weight the way checkpoints do, and the
two RMSNorms of Qwen3.5.

Weights keep the Hugging Face layout and names (`weight` is `[out, in]`, y = x @ W.T) so the checkpoint mapping
is the identity on names and shapes; einsum strings spell the axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

DEFAULT_INIT_STD = 0.02  # transformers' initializer_range


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
        self.weight = nnx.Param(std * jax.random.normal(rngs.params(), (out_features, in_features), param_dtype))

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
