"""Gated DeltaNet: the `GatedDeltaNet` layer with the checkpoint's parameter names, its state, and its FLOP count.

The rule itself (recurrent, chunked, single step) and the causal conv1d are the kernels floor's pure-JAX functions
(`qwen35.kernels.delta_rule`, re-exported here); with `kernels="pallas"` the layer runs the Pallas GDN kernels
beside them instead (`qwen35.kernels.chunked_gdn`, `qwen35.kernels.fused_gdn_decode`).

The rule, for each token t (S is the state, g_t ≤ 0 the log-decay, beta_t ∈ (0, 1) the write strength):
  S ← exp(g_t) S;   u = Sᵀ k_t;   S ← S + k_t (beta_t (v_t − u))ᵀ;   o_t = Sᵀ q_t
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35.config import Qwen35Config
from qwen35.execution import KERNELS, Execution
from qwen35.kernels import delta_rule as _rule
from qwen35.kernels.chunked_gdn import chunked_gdn_conv_packed
from qwen35.kernels.delta_rule import (causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule,  # noqa: F401
                                       gated_delta_rule_step, l2norm, recurrent_gated_delta_rule)
from qwen35.kernels.fused_gdn_decode import fused_gdn_decode
from qwen35.layers import DEFAULT_INIT_STD, Linear, RMSNormGated, init_uniform

__all__ = [  # the rule's functions (`qwen35.kernels.delta_rule`) and the layer's
    *_rule.__all__,
    "GDNState",
    "GatedDeltaNet",
    "gdn_flops",
    "default_chunk_size",
]


def default_chunk_size(kernels: str = "xla") -> int:
    """The chunk size C that `GatedDeltaNet` uses when given none: 16 for the XLA path on CPU, else 64.

    64 is transformers' choice and the Pallas kernels' (an MXU-sized tile). On CPU the XLA path is faster with
    C = 16: per token, the chunked rule does C-long elementwise work on the C×C decay and score matrices and a
    share of the explicit inverse that grows with C, while its GEMMs are already as efficient at 16 rows as at 64
    (`python benchmarks/gdn.py --chunk-sweep` shows it). The result is the same up to rounding."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    return 16 if kernels == "xla" and jax.default_backend() == "cpu" else 64


def gdn_flops(T: int, H: int, Dk: int, Dv: int, chunk_size: int = 64, *, B: int = 1) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of the two forms of the rule, for B sequences of T tokens and H heads.

    "recurrent": per token the state read Sᵀk, the rank-1 write and the output read Sᵀq (3·Dk·Dv multiply-adds)
    plus the decay of S (Dk·Dv multiplies).
    "chunked": the useful work of the chunked algorithm at `chunk_size` C, per chunk (N = ceil(T / C) chunks):
    the triangular products at their triangular size — A = (βK)Kᵀ strictly lower C(C−1)/2·Dk, QKᵀ lower
    C(C+1)/2·Dk, the unit-triangular solve for U and W C(C−1)/2·(Dv+Dk), the intra-chunk output C(C+1)/2·Dv —
    and the state products W·S, Q·S and Kᵀ·V' (C·Dk·Dv each). It leaves out what an implementation adds on
    top: the masked-out halves of the dense C×C products, forming M⁻¹ explicitly, exps and elementwise work.
    "chunked_executed": what `chunk_gated_delta_rule` here actually multiplies: dense C×C products, the
    explicit inverse (Neumann blocks of 16 and halving merges, approximately) and M⁻¹ applied as a dense GEMM.
    Speeds quoted as "% of peak" use "chunked"."""
    rec = 2 * T * H * B * (3 * Dk * Dv) + T * H * B * Dk * Dv
    C = chunk_size
    N = math.ceil(T / C)
    tri_strict, tri = C * (C - 1) / 2, C * (C + 1) / 2
    state = 3 * C * Dk * Dv
    useful = tri_strict * Dk + tri * Dk + tri_strict * (Dv + Dk) + tri * Dv + state
    b = min(C, 16)  # explicit inverse: log2(b) - 1 squarings + products per base block, 2 products per merge
    inv = (C / b) * 2 * max(0, math.ceil(math.log2(b)) - 1) * b**3
    s = b
    while s < C:
        inv += (C / (2 * s)) * 2 * s**3
        s *= 2
    executed = 2 * C * C * Dk + C * C * (Dv + Dk) + C * C * Dv + state + inv
    return {"recurrent": float(rec), "chunked": float(2 * useful * N * H * B),
            "chunked_executed": float(2 * executed * N * H * B)}


# ------------------------------------------------------------------------------------------------------------
class GDNState(NamedTuple):
    """Per-layer GDN cache: conv [B, conv_dim, Kc] (activation dtype) and recurrent [B, Hv, Dk, Dv] (float32)."""

    conv: jax.Array
    recurrent: jax.Array


class DepthwiseConv1dWeight(nnx.Module):
    """Holds `conv1d.weight` [conv_dim, 1, Kc] exactly as the checkpoint stores it (no bias)."""

    def __init__(self, channels: int, kernel: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        bound = 1.0 / math.sqrt(kernel)  # PyTorch's Conv1d default (fan_in = kernel for depthwise)
        self.weight = nnx.Param(init_uniform(rngs, (channels, 1, kernel), -bound, bound, param_dtype))


class GatedDeltaNet(nnx.Module):
    """The linear-attention mixer of Qwen3.5 (`model.layers.{i}.linear_attn.*`).

    `__call__(x [B, T, H], state=None) -> (y [B, T, H], GDNState)`. With no state the layer starts from zeros;
    with a state, a single token takes the recurrent step (conv update + one delta-rule step) and anything longer
    takes the chunked rule from the cached state. The returned state continues the sequence.
    `execution.kernels` picks the rule's implementation (the one dispatch, in `__call__`): "xla" runs the pure-JAX
    conv and rules, "pallas" the Pallas kernels of `qwen35.kernels` (see `_pallas_mixer`).
    """

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 chunk_size: int | None = None, execution: Execution = Execution()):
        c = config
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None for the kernels' default), got {chunk_size}")
        self.config, self.execution = c, execution
        self.chunk_size = chunk_size  # None: default_chunk_size() of the kernels that run (see `chunk_for`)
        H = c.hidden_size
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = c.linear_key_dim, c.linear_value_dim, c.linear_conv_dim
        self.in_proj_qkv = Linear(H, self.conv_dim, rngs=rngs, param_dtype=param_dtype)
        self.in_proj_z = Linear(H, self.value_dim, rngs=rngs, param_dtype=param_dtype)
        self.in_proj_b = Linear(H, self.num_v_heads, rngs=rngs, param_dtype=param_dtype)
        self.in_proj_a = Linear(H, self.num_v_heads, rngs=rngs, param_dtype=param_dtype)
        self.conv1d = DepthwiseConv1dWeight(self.conv_dim, c.linear_conv_kernel_dim, rngs=rngs, param_dtype=param_dtype)
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), param_dtype))
        A = init_uniform(rngs, (self.num_v_heads,), 0.01, 16.0, jnp.float32)
        self.A_log = nnx.Param(jnp.log(A).astype(param_dtype))
        self.norm = RMSNormGated(self.head_v_dim, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.out_proj = Linear(self.value_dim, H, rngs=rngs, param_dtype=param_dtype, std=DEFAULT_INIT_STD)

    def chunk_for(self) -> int:
        """The chunk size the chunked rule runs with: the one given at construction, else
        `default_chunk_size(execution.kernels)`."""
        return self.chunk_size or default_chunk_size(self.execution.kernels)

    def init_state(self, batch_size: int, dtype=jnp.float32) -> GDNState:
        return GDNState(
            conv=jnp.zeros((batch_size, self.conv_dim, self.config.linear_conv_kernel_dim), dtype),
            recurrent=jnp.zeros((batch_size, self.num_v_heads, self.head_k_dim, self.head_v_dim), jnp.float32),
        )

    def __call__(self, x: jax.Array, state: GDNState | None = None) -> tuple[jax.Array, GDNState]:
        if x.ndim != 3 or x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"GatedDeltaNet expects x [B, T, {self.config.hidden_size}], got {tuple(x.shape)}")
        B, T, _ = x.shape
        mixed, z, a, b = self.project(x)

        w = self.conv1d.weight[...]
        if self.execution.kernels == "pallas":
            o, conv_state, rec = self._pallas_mixer(mixed, a, b, w, state)
            return self.output(o, z), GDNState(conv=conv_state, recurrent=rec)
        if state is not None and T == 1:
            y, conv_state = causal_conv1d_update(mixed[:, 0], w, state.conv)
            mixed = y[:, None]
        else:
            mixed, conv_state = causal_conv1d(mixed, w, None if state is None else state.conv)

        q, k, v = self.heads(mixed)
        g, beta = self.gates(a, b)

        init = None if state is None else state.recurrent
        if state is not None and T == 1:
            o, rec = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], init)
            o = o[:, None]
        else:
            o, rec = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_for(), initial_state=init)
        o = o.astype(v.dtype)  # the rules return q's dtype (float32: normalised in it); back to the activations'
        return self.output(o, z), GDNState(conv=conv_state, recurrent=rec)

    def project(self, x: jax.Array):
        """The layer's input projections for x [..., H]: (mixed [..., conv_dim], the pre-conv q | k | v columns;
        z [..., Hv, Dv], the output gate; a, b [..., Hv], the raw decay and write-strength inputs of `gates`).
        `__call__` and the serving engine's paged step (`qwen35.serving.runner`) both start here."""
        lead = x.shape[:-1]
        z = self.in_proj_z(x).reshape(*lead, self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_a(x), self.in_proj_b(x)

    def heads(self, y: jax.Array, *, normalize: bool = True):
        """The conv's output y [..., conv_dim] as heads: q, k [..., Hk, Dk], v [..., Hv, Dv]; with `normalize`,
        q and k L2-normalised in float32 and repeated to the value heads (`_norm_repeat`), as the XLA rules take
        them."""
        lead = y.shape[:-1]
        q, k, v = jnp.split(y, [self.key_dim, 2 * self.key_dim], axis=-1)
        q, k = (t.reshape(*lead, self.num_k_heads, self.head_k_dim) for t in (q, k))
        if normalize:
            q, k = self._norm_repeat(q, k, axis=-2)
        return q, k, v.reshape(*lead, self.num_v_heads, self.head_v_dim)

    def output(self, o: jax.Array, z: jax.Array) -> jax.Array:
        """The rule's output o [..., Hv, Dv] through the gated norm (gate z) and out_proj -> [..., H]."""
        return self.out_proj(self.norm(o, z).reshape(*o.shape[:-2], self.value_dim))

    def _norm_repeat(self, q, k, axis: int):
        """L2-normalise q, k [..., Hk, Dk] in float32 (the rule's use_qk_l2norm), then repeat each key head for the
        Hv / Hk value heads that read it (value head j reads key head j // rep). Normalising before the repeat is
        the same result for rep-fold less work (rep = 4 in the released model). The rules return q's dtype, so
        callers cast their output back to the activations' (v's) dtype."""
        q, k = l2norm(q.astype(jnp.float32)), l2norm(k.astype(jnp.float32))
        rep = self.num_v_heads // self.num_k_heads
        if rep > 1:
            q, k = jnp.repeat(q, rep, axis=axis), jnp.repeat(k, rep, axis=axis)
        return q, k

    def gates(self, a, b):
        """fp32 log-decay g = -exp(A_log)·softplus(a + dt_bias) and write strength beta = sigmoid(b), [..., Hv]."""
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        return g, beta

    def _pallas_mixer(self, mixed, a, b, w, state):
        """kernels="pallas": a single decode token goes through `fused_gdn_decode` (conv update, gates and the
        recurrent step in one kernel); anything longer through `chunked_gdn_conv_packed` (the causal conv fused
        into the chunked rule: the conv's output never goes to memory; grouped heads read in place, no repeat).
        Returns (o [B, T, Hv, Dv], conv_state, recurrent)."""
        B, T, _ = mixed.shape
        if state is not None and T == 1:
            o, conv_state, rec = fused_gdn_decode(
                mixed[:, 0], a[:, 0], b[:, 0], state.conv, state.recurrent, w, self.A_log[...], self.dt_bias[...],
                num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim, head_v_dim=self.head_v_dim)
            return o[:, None], conv_state, rec
        g, beta = self.gates(a, b)
        flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731  (B sequences of T, back to back)
        o, rec, conv_state = chunked_gdn_conv_packed(
            flat(mixed), w, flat(g), flat(beta), jnp.arange(B + 1, dtype=jnp.int32) * T,
            num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
            conv_state=None if state is None else state.conv, initial_state=None if state is None else state.recurrent,
            use_qk_l2norm=True, chunk_size=max(self.chunk_for(), w.shape[-1]))
        return o.reshape(B, T, self.num_v_heads, self.head_v_dim), conv_state, rec
