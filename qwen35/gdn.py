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
from qwen35.kernels.paged_gdn_decode import paged_conv_gdn_decode, supports_paged_decode
from qwen35.layers import DEFAULT_INIT_STD, Linear, RMSNormGated, init_uniform
from qwen35.pool import NO_BLOCK, layout_of, read_conv, read_rec, write_state

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
    `execution.kernels` picks the rule's implementation (`token_step` for one token, `__call__` for more): "xla"
    runs the pure-JAX conv and rules, "pallas" the Pallas kernels of `qwen35.kernels` (`fused_gdn_decode`,
    `_pallas_chunked`). `paged(x, pool, j, b)` is the same layer in the serving step, the rows' states read and
    written in the pool by block id.
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
        if state is not None and T == 1:  # one decode token: the single-token step
            o, conv_state, rec = self.token_step(mixed[:, 0], a[:, 0], b[:, 0], state.conv, state.recurrent)
            o = o[:, None]
        elif self.execution.kernels == "pallas":
            o, conv_state, rec = self._pallas_chunked(mixed, a, b, w, state)
        else:
            mixed, conv_state = causal_conv1d(mixed, w, None if state is None else state.conv)
            q, k, v = self.heads(mixed)
            g, beta = self.gates(a, b)
            o, rec = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_for(),
                                            initial_state=None if state is None else state.recurrent)
        o = o.astype(mixed.dtype)  # the rules return float32 (q is normalised in it); back to the activations'
        return self.output(o, z), GDNState(conv=conv_state, recurrent=rec)

    def token_step(self, mixed, a, b, conv, rec):
        """One token per row: mixed [R, conv_dim], a, b [R, Hv] (`project`'s) from states conv [R, conv_dim, Kc]
        and rec [R, Hv, Dk, Dv] -> (o [R, Hv, Dv] float32, new conv, new rec). The conv update, gates and the
        recurrent step, with `kernels="pallas"` in one kernel (`fused_gdn_decode`: the state read once and written
        once). `__call__`'s decode and the serving step's single-token rows both run it."""
        w = self.conv1d.weight[...]
        if self.execution.kernels == "pallas":
            return fused_gdn_decode(mixed, a, b, conv, rec, w, self.A_log[...], self.dt_bias[...],
                                    num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
                                    head_v_dim=self.head_v_dim)
        y, conv = causal_conv1d_update(mixed, w, conv)
        q, k, v = self.heads(y)
        g, beta = self.gates(a, b)
        o, rec = gated_delta_rule_step(q, k, v, g, beta, rec)
        return o, conv, rec

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

    def _pallas_chunked(self, mixed, a, b, w, state):
        """kernels="pallas", more than one token: `chunked_gdn_conv_packed` (the causal conv fused into the chunked
        rule: the conv's output never goes to memory; grouped heads read in place, no repeat). Returns
        (o [B, T, Hv, Dv], conv_state, recurrent)."""
        B, T, _ = mixed.shape
        g, beta = self.gates(a, b)
        flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731  (B sequences of T, back to back)
        o, rec, conv_state = chunked_gdn_conv_packed(
            flat(mixed), w, flat(g), flat(beta), jnp.arange(B + 1, dtype=jnp.int32) * T,
            num_k_heads=self.num_k_heads, head_k_dim=self.head_k_dim,
            conv_state=None if state is None else state.conv, initial_state=None if state is None else state.recurrent,
            use_qk_l2norm=True, chunk_size=max(self.chunk_for(), w.shape[-1]))
        return o.reshape(B, T, self.num_v_heads, self.head_v_dim), conv_state, rec

    def paged(self, x, pool, j, b):
        """This layer as GDN layer j (of the model's GDN layers) of a serving step, on its packed tokens x [Tb, H] over
        the cache pool: (y [Tb, H], pool). `b` is the step's packed batch (a `qwen35.serving.runner.StepBatch`: the
        rows' state blocks, fresh flags, prefill and verify rows). The layer's own
        projections, gates, heads and output (`GatedDeltaNet.project / gates / heads / output`); what is the step's own
        is reading and writing the rows' states in the pool and running the rules by rows (see
        `qwen35.serving.runner`'s module docstring)."""
        Sb = b.state_blocks.shape[0]
        Sp, Lb = b.gather_idx.shape
        Sv, K1 = b.spec_idx.shape
        mixed, z, a, bb = self.project(x)  # [Tb, conv_dim], [Tb, Hv, Dv], [Tb, Hv] x 2
        g, beta = self.gates(a, bb)
        fresh = b.fresh
        paged = _paged(self, pool)

        def fresh_of(rows):  # [n] whether each of `rows` starts from zero (Sb: padding)
            return fresh[jnp.minimum(rows, Sb - 1)]

        def rec_of(rows):  # the recurrent states [n, Hv, Dk, Dv] float32 of `rows` [n] (Sb: padding, reads zeros)
            rec = read_rec(self.config, pool, j, _blocks_of(b, rows))
            return jnp.where(fresh_of(rows)[:, None, None, None], 0.0, rec)

        def conv_of(rows):  # the conv states [n, C, Kc] of `rows` [n] in the activations' dtype
            conv = read_conv(self.config, pool, j, _blocks_of(b, rows), x.dtype)
            return jnp.where(fresh_of(rows)[:, None, None], 0, conv)

        if paged:  # the kernel reads the decode rows' states itself; the dense rules only the prefill and verify rows'
            rec0, conv0 = None, None
            s0, c_pf = (rec_of(b.pf_rows), conv_of(b.pf_rows)) if Sp else (None, None)
            sv0, c_sv = (rec_of(b.spec_rows), conv_of(b.spec_rows)) if Sv else (None, None)
            # every read of the pool before the kernel that updates it in place (else XLA would copy the pool)
            c_pf, c_sv, s0, sv0, pool = jax.lax.optimization_barrier((c_pf, c_sv, s0, sv0, pool))
        else:
            conv0 = jnp.where(fresh[:, None, None], 0, read_conv(self.config, pool, j, b.state_blocks, x.dtype))
            rec0 = jnp.where(fresh[:, None, None, None], 0.0, read_rec(self.config, pool, j, b.state_blocks))
            pf, sv = jnp.minimum(b.pf_rows, Sb - 1), jnp.minimum(b.spec_rows, Sb - 1)
            s0, c_pf = (rec0[pf], conv0[pf]) if Sp else (None, None)
            sv0, c_sv = (rec0[sv], conv0[sv]) if Sv else (None, None)

        if b.verify_only.shape[0]:  # every row verifies drafts: the single-token pass would be discarded
            o = jnp.zeros((x.shape[0], self.num_v_heads, self.head_v_dim), x.dtype)
        else:
            o, pool = _gdn_rows(self, b, pool, j, x.dtype, mixed, a, bb, g, beta, conv0, rec0, c_pf, s0, paged)
        if Sv:  # verify rows: the single-token rule token by token, the state after each kept in its own group
            conv, rec = c_sv, sv0
            outs, convs, recs = [], [], []
            for i in range(K1):
                idx = b.spec_idx[:, i]
                o_i, conv, rec = self.token_step(mixed[idx], a[idx], bb[idx], conv, rec)
                outs.append(o_i.astype(x.dtype))
                convs.append(conv)
                recs.append(rec)
            o = o.at[b.spec_idx.reshape(-1)].set(jnp.stack(outs, 1).reshape(Sv * K1, *o.shape[1:]), mode="drop")
            flat = lambda t: jnp.stack(t, 1).reshape(Sv * K1, *t[0].shape[1:])  # noqa: E731
            # one write for every group (after the rows' own write: group 0 is the row's state blocks)
            pool = write_state(self.config, pool, j, b.spec_states.reshape(Sv * K1, -1), flat(convs), flat(recs))
        return self.output(o, z), pool


# ------------------------------------------------------------------------------------------------------------
# The serving step's GDN by rows, its states in the pool by block id (`GatedDeltaNet.paged`)
def _paged(gdn, pool) -> bool:
    """Whether this GDN layer's decode rows run the paged kernel (states read and written in the pool by index):
    the Pallas kernels on a pool whose units the kernel's 128-lane row view fits (`supports_paged_decode`)."""
    if gdn.execution.kernels != "pallas":
        return False
    return supports_paged_decode(layout_of(gdn.config, pool))


def _blocks_of(b, rows):
    """The state blocks [n, NS] of `rows` [n] (a padding entry, row Sb, at NO_BLOCK: reads zeros, writes dropped)."""
    Sb = b.state_blocks.shape[0]
    return jnp.where((rows < Sb)[:, None], b.state_blocks[jnp.minimum(rows, Sb - 1)], NO_BLOCK)


def _gdn_rows(gdn, b, pool, j, dtype, mixed, a, bb, g, beta, conv0, rec0, c_pf, s0, paged: bool):
    """Every row's single-token rule on its last token (exact for decode rows), replaced for the prefill rows by
    the chunked rule over their padded block; the states written to the rows' state blocks: (o [Tb, Hv, Dv],
    pool). conv0, rec0: every row's states; c_pf, s0: the prefill rows'. `paged`: the single-token step (conv
    and rule) is the paged kernel, which reads and writes the rows' conv and recurrent states in the pool itself
    (conv0 and rec0 are None; prefill rows excluded: their states come from the chunked rule)."""
    Sb = b.state_blocks.shape[0]
    Sp, Lb = b.gather_idx.shape
    w = gdn.conv1d.weight[...]
    Kc = w.shape[-1]
    pallas = gdn.execution.kernels == "pallas"
    if paged:
        idx = b.last_idx
        is_pf = jnp.zeros((Sb,), bool).at[b.pf_rows].set(True, mode="drop")
        blocks = jnp.where(is_pf[:, None], NO_BLOCK, b.state_blocks)  # prefill rows: written after, from their chunk
        o_dec, pool = paged_conv_gdn_decode(
            mixed[idx], a[idx], bb[idx], w, gdn.A_log[...], gdn.dt_bias[...], pool, blocks, b.fresh, j,
            layout_of(gdn.config, pool), num_k_heads=gdn.num_k_heads, head_k_dim=gdn.head_k_dim,
            head_v_dim=gdn.head_v_dim)
        conv_new = rec_new = None
    else:
        idx = b.last_idx
        o_dec, conv_new, rec_new = gdn.token_step(mixed[idx], a[idx], bb[idx], conv0, rec0)
    o = o_dec.astype(dtype)[b.tok_row]  # [Tb, Hv, Dv] (the rules return float32: q is normalised in it)
    if Sp:  # rows with several tokens (prefill chunks): a padded [Sp, Lb] block, padded steps made no-ops
        c0 = c_pf  # padding entries (pf_rows = Sb) read zeros or any row; their writes are dropped
        valid = b.gather_valid
        xb = jnp.where(valid[..., None], mixed[b.gather_idx], 0)  # [Sp, Lb, C]
        hist = jnp.concatenate([jnp.swapaxes(c0, 1, 2), xb], axis=1)  # [Sp, Kc + Lb, C]
        take = jnp.sum(valid, axis=1)[:, None] + jnp.arange(Kc)[None, :]  # the last Kc real inputs
        conv_pf = jnp.swapaxes(jnp.take_along_axis(hist, take[..., None], axis=1), 1, 2)
        gb = jnp.where(valid[..., None], g[b.gather_idx], 0.0)
        betab = jnp.where(valid[..., None], beta[b.gather_idx], 0.0)
        if pallas:  # the conv fused into the chunked kernel (its output never in memory): the Sp rows back to back,
            # Lb tokens each (padding steps are no-ops for the rule; the conv state comes from `take` above)
            flat = lambda t: t.reshape(Sp * Lb, *t.shape[2:])  # noqa: E731
            o_pf, rec_pf, _ = chunked_gdn_conv_packed(
                flat(xb), w, flat(gb), flat(betab), jnp.arange(Sp + 1, dtype=jnp.int32) * Lb,
                num_k_heads=gdn.num_k_heads, head_k_dim=gdn.head_k_dim, conv_state=c0, initial_state=s0,
                use_qk_l2norm=True, chunk_size=max(gdn.chunk_for(), Kc))
            o_pf = o_pf.reshape(Sp, Lb, gdn.num_v_heads, gdn.head_v_dim)
        else:
            yb, _ = causal_conv1d(xb, w, c0)
            qb, kb, vb = gdn.heads(yb)
            o_pf, rec_pf = chunk_gated_delta_rule(qb, kb, vb, gb, betab, chunk_size=gdn.chunk_for(),
                                                  initial_state=s0)
        if paged:  # the prefill rows' states, to their own blocks (padding entries at NO_BLOCK: dropped)
            pool = write_state(gdn.config, pool, j, _blocks_of(b, b.pf_rows), conv_pf, rec_pf)
        else:
            conv_new = conv_new.at[b.pf_rows].set(conv_pf.astype(conv_new.dtype), mode="drop")
            rec_new = rec_new.at[b.pf_rows].set(rec_pf, mode="drop")
        o = jnp.where(b.tok_pf[:, None, None], o_pf.astype(dtype)[b.tok_prow, b.tok_col], o)
    if paged:
        return o, pool
    return o, write_state(gdn.config, pool, j, b.state_blocks, conv_new, rec_new)
