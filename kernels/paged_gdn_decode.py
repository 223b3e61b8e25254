"""Paged GDN decode: the gated delta-rule step for a batch of single tokens, each row's recurrent state read and
written in place where it lives in the serving engine's block pool (found by the row's state block ids), in one
Pallas TPU kernel, beside its pure-JAX reference.

Why by index: the engine keeps every sequence's GDN states in its pool of blocks (`state_pool`), a
state spread over whole blocks that need not be adjacent. The dense decode kernel (`fused_gdn_decode`) takes
states [B, Hv, Dk, Dv]; feeding it from the pool means a gather before and a scatter after, which move the state
twice more than the kernel's own read and write (3× the bytes of the step that decode is bound by). Here the
kernel DMAs each row's state units from the pool into VMEM by block id (scalar-prefetched, as tpu-inference's
kernels address their state pools), runs the step, and DMAs them back: the state crosses HBM once each way.

Inputs (B rows, one token each):
  q, k     [B, Hv, Dk]      L2-normalised (float32), repeated to the value heads (as `GatedDeltaNet.heads` gives)
  v        [B, Hv, Dv]
  g, beta  [B, Hv]          log-decay and write strength
  pool     [2A, NB, unit]   the engine's pool (uint32 for a float32 cache, uint16 for bf16: see `state_pool`)
  blocks   [B, state_blocks] int32   each row's state blocks; a padding row at NO_BLOCK is neither read nor written
  fresh    [B] bool          rows whose state starts from zero (a sequence's first step): not read
  layer    int32 scalar      which GDN layer's units (traced: one program serves every layer)
Returns (o [B, Hv, Dv] float32, the pool with the rows' layer states replaced).

Where a state lives: GDN layer j's recurrent state is units u = j·(rec + conv units) + 0 .. rec_units − 1 of
the row's state, unit u at pool[u mod 2A, blocks[u div 2A]]; its float32 values [Hv, Dk, Dv] are stored as one
plane of bits in a 32-bit pool and as two planes (high 16 bits, then low 16 bits) in a 16-bit pool, so VMEM
rebuilds each float32 with a shift and an or on same-shaped tiles (`state_pool.join_halves`). The kernel views a unit
as rows of 128 lanes [unit/128, 128]: with Dv = 128 (Qwen3.5) a state row is one VMEM row and the planes are plain
row ranges.

The step (everything float32), reordered as in `fused_gdn_decode` so the state is read once and written once:
  α = exp(g);  δ = β (v − α Sᵀk);  o = (α Sᵀq + δ (kᵀq)) · scale;  S_new = α S + k δᵀ

Grid (B,): one row per step, in order, its whole layer state in VMEM (4 MiB float32 for Qwen3.5-397B, Hv = 64,
Dk = Dv = 128), then a loop over its value heads (a head's state is rows [(p·Hv + h)·Dk·Dv/128, +Dk·Dv/128) of
plane p). Two VMEM buffers: while row i computes in one, row i + 1's state arrives in the other and row i − 1's
write-back leaves it (waited for before the prefetch reuses the buffer), so the DMAs overlap the compute
(8 MiB of VMEM for Qwen3.5's bf16 pool).

The conv (2% of the state bytes for Qwen3.5: conv_dim·Kc per layer against Hv·Dk·Dv·4) stays outside, in XLA:
this kernel is the part that decode is bound by.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from qwen35.kernels.delta_rule import gated_delta_rule_step
from qwen35.kernels.fused_gdn_decode import check_decode_inputs, fused_gdn_decode_reference
from qwen35.kernels.interpret import default_interpret
from qwen35.kernels.state_pool import (LANES, PoolLayout, conv_stride, join_halves, read_conv_state, read_recurrent,
                                       split_halves, value_dtype, write_conv_state, write_recurrent)

__all__ = ["paged_gdn_decode", "paged_gdn_decode_reference", "paged_conv_gdn_decode",
           "paged_conv_gdn_decode_reference", "supports_paged_decode"]


def supports_paged_decode(lay: PoolLayout) -> bool:
    """Whether the kernel's row view fits this pool: a unit and one plane of a layer's recurrent state (Hv·Dk·Dv
    values) are whole rows of 128 lanes (true for Qwen3.5's shapes and the presets; otherwise the engine gathers
    the states for the dense kernel)."""
    return lay.unit % LANES == 0 and (lay.rec_elems // lay.planes) % LANES == 0


def _check(q, k, v, g, beta):
    B, Hv, Dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} (repeated to the value heads), got {tuple(k.shape)}")
    if v.ndim != 3 or v.shape[:2] != (B, Hv):
        raise ValueError(f"v must be [B, Hv, Dv] with B, Hv = {B}, {Hv}, got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, Hv):
            raise ValueError(f"{name} must be [B, Hv] = {(B, Hv)}, got {tuple(x.shape)}")


def _check_pool(pool, blocks, fresh, lay: PoolLayout, B: int, Hv: int, Dk: int, Dv: int):
    """The pool, the rows' state blocks and fresh flags, and the layout agree with B rows of Hv·Dk·Dv states, and
    the kernel's 128-lane row view fits the layout. Errors name the argument and the fix."""
    if pool.ndim != 3 or pool.dtype not in (jnp.uint16, jnp.uint32):
        raise ValueError(f"pool must be the engine's [2A, num_blocks, unit] pool of uint16/uint32 bits, got "
                         f"{tuple(pool.shape)} {pool.dtype}")
    if tuple(blocks.shape) != (B, lay.state_blocks):
        raise ValueError(f"blocks must be [B, state_blocks] = {(B, lay.state_blocks)}, got {tuple(blocks.shape)}")
    if tuple(fresh.shape) != (B,):
        raise ValueError(f"fresh must be [B] = ({B},), got {tuple(fresh.shape)}")
    if lay.planes != 4 // pool.dtype.itemsize:
        raise ValueError(f"the layout has {lay.planes} plane(s) of 16 bits per float32 but the pool holds "
                         f"{pool.dtype}: take the layout of this pool")
    if lay.rec_elems != Hv * Dk * Dv * lay.planes:
        raise ValueError(f"the layout's recurrent state ({lay.rec_elems} pool elements) does not match Hv·Dk·Dv = "
                         f"{Hv}·{Dk}·{Dv} float32")
    if not supports_paged_decode(lay):
        raise ValueError(f"the pool's unit ({lay.unit} elements) and a layer's state (Hv·Dk·Dv) must be whole rows of "
                         f"{LANES} lanes for the paged kernel; use the gather + `fused_gdn_decode` path instead")


def paged_gdn_decode_reference(q, k, v, g, beta, pool, blocks, fresh, layer, lay: PoolLayout, *, scale=None):
    """The same step in pure JAX: `state_pool.read_recurrent` (a gather), `delta_rule.gated_delta_rule_step`,
    `state_pool.write_recurrent` (a scatter)."""
    S = read_recurrent(lay, pool, layer, blocks).reshape(*q.shape, v.shape[-1])
    S = jnp.where(fresh[:, None, None, None], 0.0, S)
    o, S = gated_delta_rule_step(q, k, v, g, beta, S, scale=scale)
    return o.astype(jnp.float32), write_recurrent(lay, pool, layer, blocks, S)


def _each(copies, method: str) -> None:
    for c in copies:
        getattr(c, method)()


def _unit_copies(blocks_ref, pool_ref, pool_out, sems_in, sems_out, first, lay: PoolLayout, vmem_of):
    """`copies(row, s, to_pool)`: the DMAs of row `row`'s units first .. first + n − 1 (n = len of what `vmem_of`
    addresses) between the pool and VMEM buffer set s; `vmem_of(u, s)` is unit u's VMEM rows in set s, or None
    past the last unit to move."""
    U, SB = lay.units_per_block, lay.state_blocks

    def copies(row, s, to_pool: bool):
        out, u = [], 0
        while (vmem := vmem_of(u, s)) is not None:
            # lax.rem / lax.div: the units are non-negative, and jnp's floor semantics lower through `sign`
            w, blk = jax.lax.rem(first + u, U), blocks_ref[row * SB + jax.lax.div(first + u, U)]
            out.append(pltpu.make_async_copy(vmem, pool_out.at[w, blk], sems_out.at[s, u]) if to_pool
                       else pltpu.make_async_copy(pool_ref.at[w, blk], vmem, sems_in.at[s, u]))
            u += 1
        return out
    return copies


def _fetch_row(i, B, slot, blocks_ref, fresh_ref, lay: PoolLayout, num_blocks: int, copies, clear):
    """The DMA pipeline over the grid's rows (in order, on one core), up to row i's compute: row i's states land in
    buffer set `slot` (prefetched by row i − 1, or started here for row 0), row i − 1's write-back from the other
    set is waited for before row i + 1's states are prefetched into it. A padding row (NO_BLOCK) is neither read
    nor written; a fresh row reads nothing and starts from zeros (`clear()`). Returns valid(row)."""
    SB = lay.state_blocks

    def valid(row):
        return blocks_ref[row * SB] < num_blocks

    def load(row):
        return jnp.logical_and(valid(row), fresh_ref[row] == 0)

    @pl.when(jnp.logical_and(i == 0, load(0)))
    def _():  # the first row's states: nobody prefetched them
        _each(copies(0, 0, False), "start")

    @pl.when(jnp.logical_and(i > 0, valid(jnp.maximum(i - 1, 0))))
    def _():  # row i - 1's write-back leaves the other set before row i + 1's states land in it
        _each(copies(i - 1, 1 - slot, True), "wait")

    nxt = jnp.minimum(i + 1, B - 1)

    @pl.when(jnp.logical_and(i + 1 < B, load(nxt)))
    def _():  # prefetch row i + 1 while row i computes
        _each(copies(nxt, 1 - slot, False), "start")

    @pl.when(load(i))
    def _():
        _each(copies(i, slot, False), "wait")

    pl.when(jnp.logical_not(load(i)))(clear)
    return valid


def _write_row(i, B, slot, valid, copies) -> None:
    """Row i's states back to the pool, overlapping the next row's compute (waited for there, or here at the last)."""
    @pl.when(valid(i))
    def _():
        _each(copies(i, slot, True), "start")

    @pl.when(jnp.logical_and(i == B - 1, valid(i)))
    def _():
        _each(copies(i, slot, True), "wait")


def _rule_heads(buf, planes: int, Hv: int, Dk: int, Dv: int, head_inputs, o_ref) -> None:
    """The rule for every value head of one row, its state in VMEM `buf` (head h's plane p is rows
    [(p·Hv + h)·Dk·Dv/128, +Dk·Dv/128)), read once and written once: `head_inputs(h)` gives q (scaled), k [1, Dk],
    v [1, Dv] and α, β [1, 1]; o_ref[0, h] = α Sᵀq + (kᵀq) δ, S ← α S + k δᵀ, δ = β (v − α Sᵀk)."""
    rph = Dk * Dv // LANES  # rows of one head's state (one plane)
    f32 = jnp.float32

    def head(h, carry):  # one value head at a time: VMEM holds one head's temporaries, not the layer's
        rows = [pl.ds((p * Hv + h) * rph, rph) for p in range(planes)]
        bits = [buf[r, :].reshape(Dk, Dv) for r in rows]
        S = jax.lax.bitcast_convert_type(bits[0], f32) if planes == 1 else join_halves(*bits)  # [Dk, Dv]
        q, k, v, alpha, beta = head_inputs(h)
        qc, kc = q.reshape(Dk, 1), k.reshape(Dk, 1)
        kS = jnp.sum(S * kc, axis=0, keepdims=True)  # Sᵀk [1, Dv]
        qS = jnp.sum(S * qc, axis=0, keepdims=True)  # Sᵀq, from the same loaded S
        kq = jnp.sum(k * q, axis=-1, keepdims=True)  # [1, 1]
        delta = beta * (v - alpha * kS)
        o_ref[0, pl.ds(h, 1), :] = (alpha * qS + kq * delta).astype(o_ref.dtype)
        S = alpha * S + kc * delta  # written once
        new = [jax.lax.bitcast_convert_type(S, buf.dtype)] if planes == 1 else split_halves(S)
        for r, x in zip(rows, new):
            buf[r, :] = x.reshape(rph, LANES)
        return carry

    jax.lax.fori_loop(0, Hv, head, 0)


def _paged_gdn_decode_kernel(blocks_ref, fresh_ref, layer_ref, q_ref, k_ref, v_ref, g_ref, b_ref, pool_ref, o_ref,
                             pool_out, bufs, sems_in, sems_out, *, lay: PoolLayout, num_blocks: int, Hv: int, Dk: int,
                             Dv: int, scale: float):
    i, B = pl.program_id(0), pl.num_programs(0)
    rpu = lay.unit // LANES  # rows of one unit
    slot = jax.lax.rem(i, 2)  # row i's VMEM buffer; row i + 1's state arrives in the other while row i computes
    copies = _unit_copies(blocks_ref, pool_ref, pool_out, sems_in, sems_out, layer_ref[0] * lay.layer_units, lay,
                          lambda u, s: bufs.at[s, pl.ds(u * rpu, rpu)] if u < lay.rec_units else None)

    def clear():
        bufs[slot] = jnp.zeros(bufs.shape[1:], bufs.dtype)

    valid = _fetch_row(i, B, slot, blocks_ref, fresh_ref, lay, num_blocks, copies, clear)
    f32 = jnp.float32

    def head_inputs(h):
        q = q_ref[0, pl.ds(h, 1), :].astype(f32) * scale
        return (q, k_ref[0, pl.ds(h, 1), :].astype(f32), v_ref[0, pl.ds(h, 1), :].astype(f32),
                jnp.exp(g_ref[0, pl.ds(h, 1), :]), b_ref[0, pl.ds(h, 1), :])

    _rule_heads(bufs.at[slot], lay.planes, Hv, Dk, Dv, head_inputs, o_ref)
    _write_row(i, B, slot, valid, copies)


@functools.partial(jax.jit, static_argnames=("lay", "scale", "interpret"), donate_argnames=("pool",))
def _paged_gdn_decode(q, k, v, g, beta, pool, blocks, fresh, layer, *, lay, scale, interpret):
    B, Hv, Dk = q.shape
    Dv = v.shape[-1]
    U, NB, unit = pool.shape
    rpu = unit // LANES
    pool4 = pool.reshape(U, NB, rpu, LANES)  # a free view: each unit as rows of 128 lanes
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    kernel = functools.partial(_paged_gdn_decode_kernel, lay=lay, num_blocks=NB, Hv=Hv, Dk=Dk, Dv=Dv, scale=scale)
    row = lambda i, *_: (i, 0, 0)  # noqa: E731
    o, pool4 = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B,),
            in_specs=[pl.BlockSpec((1, Hv, Dk), row), pl.BlockSpec((1, Hv, Dk), row),
                      pl.BlockSpec((1, Hv, Dv), row), pl.BlockSpec((1, Hv, 1), row),
                      pl.BlockSpec((1, Hv, 1), row), any_spec],  # g, beta as [B, Hv, 1]: a head's is [1, 1]
            out_specs=[pl.BlockSpec((1, Hv, Dv), row), any_spec],
            scratch_shapes=[pltpu.VMEM((2, lay.rec_units * rpu, LANES), pool.dtype),  # two rows' states
                            pltpu.SemaphoreType.DMA((2, lay.rec_units)), pltpu.SemaphoreType.DMA((2, lay.rec_units))],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, Hv, Dv), jnp.float32), jax.ShapeDtypeStruct(pool4.shape, pool.dtype)],
        input_output_aliases={8: 1},  # the pool (after 3 scalar-prefetch operands and 5 inputs) is updated in place
        # "arbitrary": the rows run in order on one core, so row i can prefetch row i + 1's state
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(blocks.reshape(-1).astype(jnp.int32), fresh.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      q, k, v, g[..., None].astype(jnp.float32), beta[..., None].astype(jnp.float32), pool4)
    return o, pool4.reshape(U, NB, unit)


def paged_gdn_decode(q, k, v, g, beta, pool, blocks, fresh, layer, lay: PoolLayout, *, scale=None, interpret=None):
    """One decode token for each of B rows through a GDN layer's recurrent rule, each row's state read from and
    written to the serving pool by its state block ids (see the module docstring). `lay`: the pool's geometry in
    plain sizes (`qwen35.pool.layout_of(config, pool)` gives it). `interpret`: None picks Mosaic on a TPU
    and TPU interpret mode elsewhere. The pool is donated under jit: use the returned one."""
    _check(q, k, v, g, beta)
    _check_pool(pool, blocks, fresh, lay, *q.shape, v.shape[-1])
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return _paged_gdn_decode(q, k, v, g, beta, pool, blocks, fresh, layer, lay=lay, scale=scale,
                             interpret=default_interpret() if interpret is None else interpret)



# ------------------------------------------------------------------------------------------------------------
# The whole decode mixer step by block id: conv window, conv + SiLU, gates, the rule; both states in the pool.
def paged_conv_gdn_decode_reference(x_qkv, a, b, conv_w, A_log, dt_bias, pool, blocks, fresh, layer, lay: PoolLayout,
                                    *, num_k_heads: int, head_k_dim: int, head_v_dim: int, scale=None):
    """The same step in pure JAX: both states gathered from the pool (`state_pool.read_conv_state`,
    `read_recurrent`), `fused_gdn_decode_reference` (`delta_rule.causal_conv1d_update` and `gated_delta_rule_step`),
    both scattered back. Returns (o [B, Hv, Dv] float32, the pool)."""
    B, C = x_qkv.shape
    Hv = a.shape[1]
    if conv_w.ndim == 3:
        conv_w = conv_w[:, 0, :]
    keep = jnp.logical_not(fresh)
    conv = read_conv_state(lay, pool, layer, blocks, C, conv_w.shape[-1])
    conv = jnp.where(keep[:, None, None], conv, 0).astype(x_qkv.dtype)
    S = read_recurrent(lay, pool, layer, blocks).reshape(B, Hv, head_k_dim, head_v_dim)
    S = jnp.where(keep[:, None, None, None], S, 0.0)
    o, conv, S = fused_gdn_decode_reference(x_qkv, a, b, conv, S, conv_w, A_log, dt_bias, num_k_heads=num_k_heads,
                                            head_k_dim=head_k_dim, head_v_dim=head_v_dim, scale=scale)
    pool = write_recurrent(lay, pool, layer, blocks, S)
    return o.astype(jnp.float32), write_conv_state(lay, pool, layer, blocks, conv)


def _heads(y, start: int, n: int, D: int):
    """Channels [start, start + n·D) of y [rows, LANES] as [n, D]: whole rows when a head is one row (Qwen3.5's
    Dk = Dv = 128, what the TPU lowering needs), else through a flat view (interpret mode, small presets)."""
    if D == LANES and start % LANES == 0:
        return y[start // LANES: start // LANES + n]
    return y.reshape(-1)[start:start + n * D].reshape(n, D)


def _paged_conv_gdn_kernel(blocks_ref, fresh_ref, layer_ref, x_ref, a_ref, b_ref, w_ref, alog_ref, dtb_ref, pool_ref,
                           o_ref, pool_out, rbufs, cbufs, sems_in, sems_out, q_s, k_s, v_s, *, lay: PoolLayout,
                           num_blocks: int, Hk: int, Dk: int, Hv: int, Dv: int, Kc: int, scale: float):
    i, B = pl.program_id(0), pl.num_programs(0)
    rpu = lay.unit // LANES  # rows of one unit
    R = lay.conv_elems // (Kc * LANES)  # rows of one conv tap
    slot = jax.lax.rem(i, 2)  # row i's VMEM buffers; row i + 1's states arrive in the others while row i computes
    f32 = jnp.float32

    def vmem_of(u, s):  # the recurrent units, then the conv units
        if u < lay.rec_units:
            return rbufs.at[s, pl.ds(u * rpu, rpu)]
        return cbufs.at[s, pl.ds((u - lay.rec_units) * rpu, rpu)] if u < lay.layer_units else None

    copies = _unit_copies(blocks_ref, pool_ref, pool_out, sems_in, sems_out, layer_ref[0] * lay.layer_units, lay,
                          vmem_of)

    def clear():
        rbufs[slot] = jnp.zeros(rbufs.shape[1:], rbufs.dtype)
        cbufs[slot] = jnp.zeros(cbufs.shape[1:], cbufs.dtype)

    valid = _fetch_row(i, B, slot, blocks_ref, fresh_ref, lay, num_blocks, copies, clear)

    # The conv: taps are rows [t·R, (t + 1)·R) of the conv buffer; shift in the token, dot with the weights, SiLU.
    cbuf = cbufs.at[slot]
    cdt = value_dtype(cbufs.dtype)
    taps = [jax.lax.bitcast_convert_type(cbuf[pl.ds(t * R, R), :], cdt).astype(f32) for t in range(1, Kc)]
    taps.append(x_ref[0].astype(f32))  # [R, LANES]
    y = sum(taps[t] * w_ref[t].astype(f32) for t in range(Kc))
    y = y * jax.nn.sigmoid(y)
    for t in range(Kc):  # the new window, written over the old in VMEM and DMAed back with the state
        cbuf[pl.ds(t * R, R), :] = jax.lax.bitcast_convert_type(taps[t].astype(cdt), cbufs.dtype)
    kd = Hk * Dk
    q, k = _heads(y, 0, Hk, Dk), _heads(y, kd, Hk, Dk)
    q_s[...] = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + 1e-6) * scale
    k_s[...] = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + 1e-6)
    v_s[...] = _heads(y, 2 * kd, Hv, Dv)
    rep = Hv // Hk

    def head_inputs(h):  # value head h reads key head h // rep; its gates from a, b and the layer's parameters
        kh = jax.lax.div(h, rep)
        g = -jnp.exp(alog_ref[pl.ds(h, 1), :]) * jax.nn.softplus(a_ref[0, pl.ds(h, 1), :] + dtb_ref[pl.ds(h, 1), :])
        return (q_s[pl.ds(kh, 1), :], k_s[pl.ds(kh, 1), :], v_s[pl.ds(h, 1), :], jnp.exp(g),
                jax.nn.sigmoid(b_ref[0, pl.ds(h, 1), :]))

    _rule_heads(rbufs.at[slot], lay.planes, Hv, Dk, Dv, head_inputs, o_ref)
    _write_row(i, B, slot, valid, copies)


@functools.partial(jax.jit, static_argnames=("lay", "Hk", "Dk", "Dv", "scale", "interpret"), donate_argnames=("pool",))
def _paged_conv_gdn_decode(x_qkv, a, b, conv_w, A_log, dt_bias, pool, blocks, fresh, layer, *, lay, Hk, Dk, Dv, scale,
                           interpret):
    B, C = x_qkv.shape
    Hv, Kc = a.shape[1], conv_w.shape[1]
    stride = conv_stride(C)
    R = stride // LANES
    U, NB, unit = pool.shape
    rpu = unit // LANES
    pool4 = pool.reshape(U, NB, rpu, LANES)  # a free view: each unit as rows of 128 lanes
    x = jnp.pad(x_qkv.astype(jnp.float32), ((0, 0), (0, stride - C))).reshape(B, R, LANES)
    w = jnp.pad(conv_w.T.astype(jnp.float32), ((0, 0), (0, stride - C))).reshape(Kc, R, LANES)  # tap-major
    col = lambda v: v.astype(jnp.float32).reshape(-1, 1)  # noqa: E731  [Hv, 1]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    row = lambda i, *_: (i, 0, 0)  # noqa: E731
    whole = lambda *shape: pl.BlockSpec(shape, lambda i, *_: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_paged_conv_gdn_kernel, lay=lay, num_blocks=NB, Hk=Hk, Dk=Dk, Hv=Hv, Dv=Dv, Kc=Kc,
                               scale=scale)
    o, pool4 = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B,),
            in_specs=[pl.BlockSpec((1, R, LANES), row), pl.BlockSpec((1, Hv, 1), row), pl.BlockSpec((1, Hv, 1), row),
                      whole(Kc, R, LANES), whole(Hv, 1), whole(Hv, 1), any_spec],
            out_specs=[pl.BlockSpec((1, Hv, Dv), row), any_spec],
            scratch_shapes=[pltpu.VMEM((2, lay.rec_units * rpu, LANES), pool.dtype),  # two rows' recurrent states
                            pltpu.VMEM((2, lay.conv_units * rpu, LANES), pool.dtype),  # and conv states
                            pltpu.SemaphoreType.DMA((2, lay.layer_units)),  # in
                            pltpu.SemaphoreType.DMA((2, lay.layer_units)),  # out
                            pltpu.VMEM((Hk, Dk), jnp.float32), pltpu.VMEM((Hk, Dk), jnp.float32),
                            pltpu.VMEM((Hv, Dv), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, Hv, Dv), jnp.float32), jax.ShapeDtypeStruct(pool4.shape, pool.dtype)],
        input_output_aliases={9: 1},  # the pool (after 3 scalar-prefetch operands and 6 inputs) is updated in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
    )(blocks.reshape(-1).astype(jnp.int32), fresh.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      x, a[..., None].astype(jnp.float32), b[..., None].astype(jnp.float32), w, col(A_log), col(dt_bias), pool4)
    return o, pool4.reshape(U, NB, unit)


def paged_conv_gdn_decode(x_qkv, a, b, conv_w, A_log, dt_bias, pool, blocks, fresh, layer, lay: PoolLayout, *,
                          num_k_heads: int, head_k_dim: int, head_v_dim: int, scale=None, interpret=None):
    """A GDN layer's whole decode step for B rows, both states read and written in the serving pool by the rows'
    state block ids: the conv window (tap-major rows, see `state_pool`) shifted by the token, the depthwise conv +
    SiLU, q and k L2-normalised, the gates, and the rule of `paged_gdn_decode`. Inputs are the layer's projections
    (as `fused_gdn_decode` takes them): x_qkv [B, conv_dim] the pre-conv q | k | v columns, a, b [B, Hv]; the
    layer's conv_w [conv_dim, Kc] (or [conv_dim, 1, Kc]), A_log and dt_bias [Hv]. Rows at `NO_BLOCK` (padding, or
    prefill rows whose states another path writes) are neither read nor written; `fresh` rows start from zero.
    Returns (o [B, Hv, Dv] float32 — before the gated norm —, the pool); the pool is donated under jit."""
    if conv_w.ndim == 3:
        conv_w = conv_w[:, 0, :]
    B = x_qkv.shape[0]
    Hv, Hk, Dk, Dv = a.shape[-1], num_k_heads, head_k_dim, head_v_dim
    sds = jax.ShapeDtypeStruct  # the dense states' shapes, for the dense kernel's checks
    check_decode_inputs(x_qkv, a, b, sds((B, x_qkv.shape[-1], conv_w.shape[-1]), x_qkv.dtype),
                        sds((B, Hv, Dk, Dv), jnp.float32), conv_w, A_log, dt_bias, num_k_heads=Hk, head_k_dim=Dk,
                        head_v_dim=Dv)
    _check_pool(pool, blocks, fresh, lay, B, Hv, Dk, Dv)
    if lay.conv_elems != conv_w.shape[-1] * conv_stride(x_qkv.shape[1]):
        raise ValueError(f"the layout's conv state ({lay.conv_elems} elements) is not Kc taps of conv_dim = "
                         f"{x_qkv.shape[1]} channels in whole {LANES}-lane rows")
    scale = float(Dk ** -0.5 if scale is None else scale)
    return _paged_conv_gdn_decode(x_qkv, a, b, conv_w, A_log, dt_bias, pool, blocks, fresh, layer, lay=lay, Hk=int(Hk),
                                  Dk=int(Dk), Dv=int(Dv), scale=scale,
                                  interpret=default_interpret() if interpret is None else interpret)
