"""Fused GDN decode: conv-state update, depthwise conv + SiLU, the gates and the recurrent delta-rule step for a
batch of single tokens, in one Pallas TPU kernel, beside its pure-JAX reference.

Inputs (B sequences, one token each; the layer's own layouts, as `qwen35.gdn.GatedDeltaNet` holds them):
  x_qkv       [B, conv_dim]          the token's pre-conv q | k | v columns (conv_dim = 2·Hk·Dk + Hv·Dv)
  a, b        [B, Hv]                the gate projections (in_proj_a, in_proj_b outputs)
  conv_state  [B, conv_dim, Kc]      the last Kc pre-conv inputs
  state       [B, Hv, Dk, Dv]        the recurrent state, float32 or bfloat16
  conv_w [conv_dim, Kc], A_log [Hv], dt_bias [Hv]   the layer's parameters
Returns (o [B, Hv, Dv] in x's dtype — the rule's output before the gated norm —, new conv_state, new state in the
state's dtype).

The step for value head h (key head h // (Hv / Hk)), everything in float32 inside the kernel:
  conv: c ← [c₂ … c_Kc, x];  y = SiLU(Σ_j w_j c_j);  q = l2norm(y_q)·Dk^-½,  k = l2norm(y_k),  v = y_v
  gates: α = exp(g),  g = −exp(A_log)·softplus(a + dt_bias);  β = sigmoid(b)
  rule (reference order):  S' = α S;  u = S'ᵀk;  S'' = S' + k (β (v − u))ᵀ;  o = S''ᵀ q

Reordered so that no product with the state follows the rank-1 update. Expanding o with S'':
  o = (α S + k δᵀ)ᵀ q = α (Sᵀ q) + δ (kᵀ q),   δ = β (v − α (Sᵀ k))
so one pass over the *old* state computes both reads Sᵀk and Sᵀq (two reductions of the same loaded S), the
output needs only the scalar kᵀq, and the state is written once, S_new = α S + k δᵀ. The reference reads the state
three times (u, the update, o); this kernel reads it once and writes it once: decode is bound by exactly those
bytes (Hv·Dk·Dv·4 B per sequence and layer in fp32, half that in bf16).

Grid (B / block_b, Hk): one step holds block_b sequences and one key head with its Hv / Hk value heads, so the conv
channels a step updates are its own (no two steps write the same conv-state row). The wrapper rearranges the conv
inputs to head-major [Hk, B, ·] layouts whose last two block dims are whole array dims (TPU's (8, 128) rule); a
serving engine would keep its conv cache in that layout and skip the two small transposes.

Napkin math per sequence and layer (Qwen3.5-397B: Hv = 64, Dk = Dv = 128): state 64·128·128·4 B = 4 MiB read +
4 MiB written in fp32 (2 + 2 MiB in bf16), about 6·Hv·Dk·Dv ≈ 6.3 MFLOP: intensity ≈ 0.75 FLOP/B (1.5 in bf16),
far below any TPU's ridge point, so the step runs at HBM bandwidth and a bf16 state halves its time.
VMEM per grid step (block_b = 8, Hv/Hk = 4, fp32): state in + out 2·8·4·64 KiB = 4 MiB, double-buffered 8 MiB.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35.kernels.delta_rule import causal_conv1d_update, gated_delta_rule_step
from qwen35.kernels.interpret import default_interpret

__all__ = ["fused_gdn_decode_reference", "fused_gdn_decode", "check_decode_inputs"]


def check_decode_inputs(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, *, num_k_heads, head_k_dim,
                        head_v_dim) -> None:
    """Shape checks; errors name the tensor and the expected shape."""
    if x_qkv.ndim != 2:
        raise ValueError(f"x_qkv must be [B, conv_dim] (one token per sequence), got shape {tuple(x_qkv.shape)}")
    B, conv_dim = x_qkv.shape
    if state.ndim != 4 or state.shape[0] != B or tuple(state.shape[2:]) != (head_k_dim, head_v_dim):
        raise ValueError(f"state must be [B, Hv, Dk, Dv] = [{B}, Hv, {head_k_dim}, {head_v_dim}], got "
                         f"{tuple(state.shape)}")
    Hv = state.shape[1]
    if Hv % num_k_heads:
        raise ValueError(f"{Hv} value heads are not a multiple of {num_k_heads} key heads")
    want = 2 * num_k_heads * head_k_dim + Hv * head_v_dim
    if conv_dim != want:
        raise ValueError(f"x_qkv has {conv_dim} columns but 2·Hk·Dk + Hv·Dv = {want}")
    if conv_w.ndim == 3:
        conv_w = conv_w[:, 0, :]
    if conv_w.ndim != 2 or conv_w.shape[0] != conv_dim:
        raise ValueError(f"conv_w must be [conv_dim={conv_dim}, Kc] (or [conv_dim, 1, Kc]), got {tuple(conv_w.shape)}")
    Kc = conv_w.shape[1]
    if tuple(conv_state.shape) != (B, conv_dim, Kc):
        raise ValueError(f"conv_state must be [B, conv_dim, Kc] = {(B, conv_dim, Kc)}, got {tuple(conv_state.shape)}")
    for name, x in (("a", a), ("b", b)):
        if tuple(x.shape) != (B, Hv):
            raise ValueError(f"{name} must be [B, Hv] = {(B, Hv)}, got {tuple(x.shape)}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if tuple(x.shape) != (Hv,):
            raise ValueError(f"{name} must be [Hv] = ({Hv},), got {tuple(x.shape)}")
    if state.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"state must be float32 or bfloat16, got {state.dtype}")


def fused_gdn_decode_reference(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, *, num_k_heads, head_k_dim,
                               head_v_dim, scale=None):
    """What `GatedDeltaNet.__call__` does for one decode token between its projections and its gated norm, built
    from `delta_rule.causal_conv1d_update` and `gated_delta_rule_step`. The new state comes back in the dtype of
    the state given (the step itself runs in float32)."""
    check_decode_inputs(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, num_k_heads=num_k_heads,
                        head_k_dim=head_k_dim, head_v_dim=head_v_dim)
    return _reference(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, num_k_heads=num_k_heads,
                      head_k_dim=head_k_dim, head_v_dim=head_v_dim, scale=scale)


@functools.partial(jax.jit, static_argnames=("num_k_heads", "head_k_dim", "head_v_dim", "scale"))
def _reference(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, *, num_k_heads, head_k_dim, head_v_dim, scale):
    B = x_qkv.shape[0]
    Hv = state.shape[1]
    key_dim = num_k_heads * head_k_dim
    y, conv_new = causal_conv1d_update(x_qkv, conv_w, conv_state)
    q, k, v = jnp.split(y, [key_dim, 2 * key_dim], axis=-1)
    q = q.reshape(B, num_k_heads, head_k_dim)
    k = k.reshape(B, num_k_heads, head_k_dim)
    v = v.reshape(B, Hv, head_v_dim)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    rep = Hv // num_k_heads
    q, k = jnp.repeat(q, rep, axis=1), jnp.repeat(k, rep, axis=1)
    o, S = gated_delta_rule_step(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=True)
    return o, conv_new, S.astype(state.dtype)


def _decode_kernel(xq_ref, xk_ref, xv_ref, cq_ref, ck_ref, cv_ref, wq_ref, wk_ref, wv_ref, a_ref, b_ref, alog_ref,
                   dtb_ref, S_ref,
                   o_ref, cq_out, ck_out, cv_out, S_out, *, Kc: int, rep: int, Dv: int, scale: float):
    f32 = jnp.float32

    def conv(x_ref, c_ref, w_ref, c_out):  # shift in the token, dot with the taps, SiLU; [bB, D]
        taps = [c_ref[0, :, j, :] for j in range(1, Kc)] + [x_ref[0]]
        y = sum(taps[j].astype(f32) * w_ref[0, j:j + 1, :].astype(f32) for j in range(Kc))
        for j in range(Kc):
            c_out[0, :, j, :] = taps[j].astype(c_out.dtype)
        return y * jax.nn.sigmoid(y)

    q, k, v = conv(xq_ref, cq_ref, wq_ref, cq_out), conv(xk_ref, ck_ref, wk_ref, ck_out), conv(xv_ref, cv_ref, wv_ref,
                                                                                                 cv_out)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + 1e-6) * scale  # [bB, Dk]
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
    kq = jnp.sum(k * q, axis=-1, keepdims=True)  # [bB, 1]: the only thing the output needs from the update
    g = -jnp.exp(alog_ref[0].astype(f32)) * jax.nn.softplus(a_ref[0].astype(f32) + dtb_ref[0].astype(f32))  # [bB, rep]
    alpha = jnp.exp(g)
    beta = jax.nn.sigmoid(b_ref[0].astype(f32))
    for r in range(rep):  # the value heads that share this key head
        S = S_ref[:, 0, r].astype(f32)  # [bB, Dk, Dv]: read once
        al, be = alpha[:, r:r + 1], beta[:, r:r + 1]  # [bB, 1]
        kS = jnp.sum(S * k[:, :, None], axis=1)  # Sᵀk [bB, Dv]
        qS = jnp.sum(S * q[:, :, None], axis=1)  # Sᵀq, from the same loaded S
        delta = be * (v[:, r * Dv:(r + 1) * Dv] - al * kS)
        o_ref[:, 0, r] = (al * qS + kq * delta).astype(o_ref.dtype)
        S_out[:, 0, r] = (al[:, :, None] * S + k[:, :, None] * delta[:, None, :]).astype(S_out.dtype)  # written once


@functools.partial(jax.jit, static_argnames=("num_k_heads", "head_k_dim", "head_v_dim", "scale", "block_b",
                                             "interpret"))
def _fused_gdn_decode(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, *, num_k_heads, head_k_dim, head_v_dim,
                      scale, block_b, interpret):
    B, conv_dim = x_qkv.shape
    Hk, Dk, Dv = num_k_heads, head_k_dim, head_v_dim
    Hv = state.shape[1]
    rep = Hv // Hk
    Kc = conv_w.shape[-1]
    kd = Hk * Dk
    # head-major layouts: [Hk, B, width] for the token, [Hk, B, Kc, width] for the conv state, [Hk, Kc, width] taps
    tok = lambda x, w: x.reshape(B, Hk, w).transpose(1, 0, 2)  # noqa: E731
    cst = lambda c, w: c.reshape(B, Hk, w, Kc).transpose(1, 0, 3, 2)  # noqa: E731
    tap = lambda t, w: t.reshape(Hk, w, Kc).transpose(0, 2, 1)  # noqa: E731
    parts = [(slice(0, kd), Dk), (slice(kd, 2 * kd), Dk), (slice(2 * kd, conv_dim), rep * Dv)]
    xs = [tok(x_qkv[:, sl], w) for sl, w in parts]
    cs = [cst(conv_state[:, sl], w) for sl, w in parts]
    ws = [tap(conv_w[sl], w) for sl, w in parts]
    gate = lambda x: x.reshape(B, Hk, rep).transpose(1, 0, 2)  # noqa: E731
    par = lambda x: x.reshape(Hk, 1, rep)  # noqa: E731
    S5 = state.reshape(B, Hk, rep, Dk, Dv)

    bB = block_b
    tok_spec = lambda w: pl.BlockSpec((1, bB, w), lambda i, h: (h, i, 0))  # noqa: E731
    cs_spec = lambda w: pl.BlockSpec((1, bB, Kc, w), lambda i, h: (h, i, 0, 0))  # noqa: E731
    tap_spec = lambda w: pl.BlockSpec((1, Kc, w), lambda i, h: (h, 0, 0))  # noqa: E731
    widths = [w for _, w in parts]
    S_spec = pl.BlockSpec((bB, 1, rep, Dk, Dv), lambda i, h: (i, h, 0, 0, 0))
    in_specs = ([tok_spec(w) for w in widths] + [cs_spec(w) for w in widths] + [tap_spec(w) for w in widths]
                + [pl.BlockSpec((1, bB, rep), lambda i, h: (h, i, 0))] * 2
                + [pl.BlockSpec((1, 1, rep), lambda i, h: (h, 0, 0))] * 2 + [S_spec])
    out_specs = [pl.BlockSpec((bB, 1, rep, Dv), lambda i, h: (i, h, 0, 0))] + [cs_spec(w) for w in widths] + [S_spec]
    out_shape = ([jax.ShapeDtypeStruct((B, Hk, rep, Dv), x_qkv.dtype)]
                 + [jax.ShapeDtypeStruct(c.shape, conv_state.dtype) for c in cs]
                 + [jax.ShapeDtypeStruct(S5.shape, state.dtype)])
    kernel = functools.partial(_decode_kernel, Kc=Kc, rep=rep, Dv=Dv, scale=scale)
    o, cq, ck, cv, S = pl.pallas_call(
        kernel,
        grid=(B // bB, Hk),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={13: 4},  # the recurrent state is updated in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(*xs, *cs, *ws, gate(a), gate(b), par(A_log), par(dt_bias), S5)
    back = lambda c, w: c.transpose(1, 0, 3, 2).reshape(B, Hk * w, Kc)  # noqa: E731
    conv_new = jnp.concatenate([back(c, w) for c, w in zip((cq, ck, cv), widths)], axis=1)
    return o.reshape(B, Hv, Dv), conv_new, S.reshape(B, Hv, Dk, Dv)


def fused_gdn_decode(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, *, num_k_heads, head_k_dim, head_v_dim,
                     scale=None, block_b=None, interpret=None):
    """One decode token for each of B sequences through a GDN layer's conv, gates and recurrent step, in one Pallas
    kernel (see the module docstring for the reordered algebra). The state may be float32 or bfloat16 and comes
    back in its own dtype (compute is float32 either way). `block_b` sequences per grid step (default 8 when B is
    a multiple of 8, else all B: TPU blocks need a multiple of 8 or the whole axis). `interpret`: None picks Mosaic
    on TPU and TPU interpret mode elsewhere."""
    check_decode_inputs(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, num_k_heads=num_k_heads,
                        head_k_dim=head_k_dim, head_v_dim=head_v_dim)
    if conv_w.ndim == 3:
        conv_w = conv_w[:, 0, :]
    B = x_qkv.shape[0]
    if block_b is None:
        block_b = 8 if B % 8 == 0 else B
    if B % block_b:
        raise ValueError(f"block_b={block_b} must divide the batch B={B}")
    scale = float(head_k_dim ** -0.5 if scale is None else scale)
    return _fused_gdn_decode(x_qkv, a, b, conv_state, state, conv_w, A_log, dt_bias, num_k_heads=int(num_k_heads),
                             head_k_dim=int(head_k_dim), head_v_dim=int(head_v_dim), scale=scale, block_b=int(block_b),
                             interpret=default_interpret() if interpret is None else interpret)
