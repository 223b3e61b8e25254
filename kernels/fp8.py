"""FP8 block quantisation in pure JAX: the official release's block-scaled e4m3 weights (one float32 scale per
128x128 block) dequantised, and W8A8's activation quantisation (one scale per row and 512 columns). The grouped
matmul kernels read the same formats tile by tile; these functions are their reference and the XLA paths' math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["FP8_BLOCK", "ACT_BLOCK", "E4M3_MAX", "fp8_dequantize", "quantize_fp8_activations",
           "dequantize_fp8_activations", "fp8_round_activations"]

# The official FP8 release stores one float32 scale per 128x128 block of a quantised weight (weight_block_size);
# `qwen35.config` holds the same two numbers for the jax-free config (a test checks they agree).
FP8_BLOCK = 128
# W8A8 quantises activations with one float32 scale per row and 512 columns ("512 sub-channel" quantisation).
ACT_BLOCK = 512

def fp8_dequantize(w: jax.Array, scale_inv: jax.Array, dtype, block: int = FP8_BLOCK) -> jax.Array:
    """Block-scaled FP8 -> `dtype`: w [..., R, C] float8, scale_inv [..., ceil(R/b), ceil(C/b)] float32;
    result[..., r, c] = float(w[..., r, c]) · scale_inv[..., r // b, c // b] (the jnp twin of
    `qwen35.weights.fp8_block_dequantize`, numpy). Elementwise, so on sharded experts it runs on each device's own."""
    R, C = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale_inv.astype(jnp.float32), block, axis=-2)[..., :R, :], block, axis=-1)[..., :C]
    return (w.astype(jnp.float32) * s).astype(dtype)


E4M3_MAX = 448.0  # the largest float8_e4m3fn


def quantize_fp8_activations(x, block: int = ACT_BLOCK):
    """x [..., K] -> (q float8_e4m3fn [..., K], scale [..., K/block] float32): per row and `block`-wide group of
    columns, scale = amax / 448 (1 for an all-zero group) and q = x / scale, so q·scale is x to e4m3's 3 mantissa
    bits. W8A8's activation quantisation (`SparseMoeBlock` with `Execution(w8a8=True)`; the Pallas kernels)."""
    *lead, K = x.shape
    if K % block:
        raise ValueError(f"activation quantisation needs K a multiple of {block}, got K={K}")
    xb = x.astype(jnp.float32).reshape(*lead, K // block, block)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = jnp.clip(xb / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(*lead, K), scale


def dequantize_fp8_activations(q, scale, block: int = ACT_BLOCK):
    """The inverse of `quantize_fp8_activations`, in float32."""
    *lead, K = q.shape
    return (q.astype(jnp.float32).reshape(*lead, K // block, block) * scale[..., None]).reshape(*lead, K)


def fp8_round_activations(x, block: int = ACT_BLOCK):
    """x quantised to FP8 and back (in x's dtype): the value an FP8 x FP8 matmul multiplies. With the FP8 weights
    dequantised, a float32 matmul of it is the W8A8 product up to the order of the sums (the product of two e4m3
    values is exact in float32): W8A8's XLA path (in bfloat16 each operand also rounds to bf16's 8 bits)."""
    return dequantize_fp8_activations(*quantize_fp8_activations(x, block), block).astype(x.dtype)
