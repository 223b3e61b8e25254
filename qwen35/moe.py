"""The sparse Mixture-of-Experts block of Qwen3.5: router, three interchangeable expert paths, load statistics,
the auxiliary load-balancing loss, and the `SparseMoeBlock` layer with the checkpoint's parameter names.

Notation: N tokens (B·T flattened), H hidden, E experts, k experts per token, I expert width, Is shared width,
M = N·k (token, expert) slots, C per-expert capacity.

    p = softmax(x @ Wrᵀ) (fp32);  (w, e) = top-k(p);  w ← w / Σw;  routed = Σ_j w_j · Expert_{e_j}(x)
    Expert_e(x) = (silu(x G_eᵀ) ⊙ (x U_eᵀ)) D_eᵀ        gate_up [E, 2I, H] = [G_e; U_e]   down [E, H, I]
    y = routed + sigmoid(x @ w_sgᵀ) · SwiGLU_shared(x)

Expert paths (all `(x [N,H], weights [N,k], experts [N,k], gate_up, down) -> y [N,H]`, equal outputs):
  1. `experts_dense`    every expert on every token, masked by a one-hot combine matrix [N, E]:
                        2·N·E·3IH FLOPs, E/k times the useful work. The teaching baseline.
  2. `experts_sorted`   sort the M slots by expert, gather, grouped SwiGLU with `group_sizes` [E], scatter-add the
                        weighted rows back: 2·M·3IH FLOPs, exactly the useful work. The default.
  3. `experts_capacity` fixed buffers [E, C, H] with C = ceil(cf·N·k/E) (capped at N); slots past an expert's
                        capacity are dropped in token order and counted. Static shapes (what expert-parallel
                        all-to-all wants) at the price of dropped tokens or padding: 2·E·C·3IH FLOPs.

`grouped_swiglu(x_sorted [M,H], group_sizes [E], gate_up, down)` is the inner grouped matmul, the piece a Pallas
grouped-matmul kernel replaces. It runs one of two functions, picked by the platform (`_ragged_here` says why):
  * `grouped_ragged`: `jax.lax.ragged_dot_general` straight on the HF [E, 2I, H] layout (no weight transpose). The
    right call on GPU/TPU, where XLA lowers it to a grouped GEMM; on CPU it is lowered to slow loops.
  * `grouped_tiles`: row tiles that each belong to one expert, read in place from the sorted rows: a `lax.scan` over the
    experts (each expert's weights sliced once: on CPU a slice is a copy) runs every group's whole tiles of tm
    rows (`tile_rows`: the average rows per expert as a power of two, 8 to 256), then its remaining rows as one
    more tile, the smallest of tm, tm/2, ... (`remainder_tiles`) that holds them; each tile one dense
    [rows, H] x [H, 2I] SwiGLU with its expert's weights. This is the megablox/gmm schedule written in plain JAX,
    with a few smaller tile sizes for the ragged ends: a group wastes less than half of its last tile instead of
    up to tm - 1 rows, at one matmul more per group than its whole tiles.
`experts_sorted` with the tiles runs the same schedule with the gather and the weighted scatter-add inside each
tile (`_sorted_tiles_fused`), so no [M, H] sorted copy of the tokens or [M, H] expert output is made; the routing
weights scale each tile's SwiGLU activations.
`grouped_ragged` runs on TPU and `grouped_tiles` elsewhere (`experts_sorted(..., grouped=fn)` takes any grouped
matmul of this signature instead: the kernel boundary, in code). On CPU the sorted
path with tiles gets most of its E/k FLOP advantage over the dense baseline (tiles run at the dense path's GFLOP/s;
what is lost is the gather, the scatter-add and the padding of each group's last tile), and `ragged_dot`, which
XLA:CPU lowers to slow loops, is slower than the dense path: `python benchmarks/moe.py` times the three paths and
both grouped matmuls side by side.

Decode (`experts_gather`, N·k <= E): one matrix-vector pair per slot, slicing that slot's expert, written out per
slot up to `GATHER_UNROLL_MAX` slots so XLA runs them concurrently, a `lax.scan` beyond. Reading only the routed
experts' weights in place beats gathering them into fresh [M, 2I, H] / [M, H, I] buffers; each product is written
as vector @ matrix.T, which XLA:CPU fuses with the expert slice into one loop reading the weights in place (as
matrix @ vector it copies the expert's weights out first).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35.config import Qwen35Config
from qwen35.execution import Execution
from qwen35.kernels.fp8 import (ACT_BLOCK, E4M3_MAX, FP8_BLOCK, dequantize_fp8_activations, fp8_dequantize,
                                fp8_round_activations, quantize_fp8_activations)
from qwen35.kernels.grouped_matmul import check_expert_weights, check_routed, experts_sorted_pallas
from qwen35.kernels.permute import rank_in_expert, sort_by_expert
from qwen35.layers import DEFAULT_INIT_STD, Linear, init_normal

__all__ = [
    "route",
    "experts_dense",
    "experts_sorted",
    "experts_gather",
    "GATHER_UNROLL_MAX",
    "experts_capacity",
    "grouped_swiglu",
    "grouped_tiles",
    "grouped_ragged",
    "tile_rows",
    "remainder_tiles",
    "sort_by_expert",
    "capacity",
    "CapacityStats",
    "ExpertLoad",
    "expert_load",
    "load_balancing_loss",
    "moe_flops",
    "SparseMoeBlock",
    "fp8_dequantize",
    "quantize_fp8_activations",
    "dequantize_fp8_activations",
    "fp8_round_activations",
    "ACT_BLOCK",
    "E4M3_MAX",
]

DEFAULT_TILE = 256


# ------------------------------------------------------------------------------------------------------------
# Input checks: bad shapes fail here, naming the tensors, not deep inside an einsum.
def _shape(x) -> tuple:
    return tuple(x.shape)


def _arrays(*xs):
    return tuple(jnp.asarray(x) for x in xs)


# ------------------------------------------------------------------------------------------------------------
# Router
@functools.partial(jax.jit, static_argnames=("k", "normalize"))
def route(x: jax.Array, router_w: jax.Array, k: int, *, normalize: bool = True):
    """Top-k softmax router, in float32.

    x [N, H], router_w [E, H] (`gate.weight`). Returns (weights [N, k] float32, experts [N, k] int32, logits
    [N, E] float32). Softmax over E, top-k of the probabilities (sorted descending, as `torch.topk`), then the k
    weights renormalised to sum to 1 — Qwen3.5's router always renormalises (transformers'
    `Qwen3_5MoeTopKRouter` divides unconditionally; `norm_topk_prob` is not read). Exact ties go to the lower
    expert id (torch.topk leaves tie order unspecified).
    """
    x, router_w = _arrays(x, router_w)
    if x.ndim != 2:
        raise ValueError(f"x must be [N, H], got shape {_shape(x)}")
    if router_w.ndim != 2 or router_w.shape[1] != x.shape[1]:
        raise ValueError(f"router_w must be [E, H] with H = {x.shape[1]}, got shape {_shape(router_w)}")
    E = router_w.shape[0]
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= E:
        raise ValueError(f"top-k must be an integer in [1, E = {E}], got {k!r}")
    logits = jnp.einsum("nh,eh->ne", x.astype(jnp.float32), router_w.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, int(k))
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), logits


# ------------------------------------------------------------------------------------------------------------
# Path 1: dense one-hot
def _swiglu(h: jax.Array, act_block: int | None = None) -> jax.Array:
    """[..., 2I] (gate | up) -> silu(gate) * up  [..., I]; with `act_block` (W8A8) rounded through FP8 per row and
    `act_block` columns, as the down projection's FP8 input (`fp8_round_activations`)."""
    gate, up = jnp.split(h, 2, axis=-1)
    a = jax.nn.silu(gate) * up
    return a if act_block is None else fp8_round_activations(a, act_block)


def _round_input(x: jax.Array, act_block: int | None) -> jax.Array:
    """The routed tokens as the gate/up projection sees them: unchanged, or (W8A8) rounded through FP8."""
    return x if act_block is None else fp8_round_activations(x, act_block)


@functools.partial(jax.jit, static_argnames="act_block")
def experts_dense(x, weights, experts, gate_up, down, *, act_block: int | None = None) -> jax.Array:
    """Every expert on every token, then keep each token's k outputs with a one-hot combine matrix.

    combine [N, E] = Σ_j weights[:, j] · onehot(experts[:, j]); y = Σ_e combine[:, e] · Expert_e(x).
    Costs E/k times the useful FLOPs: the reference, and the fastest thing for a handful of experts.
    `act_block` (W8A8): both matmuls' activations rounded through FP8 per row and `act_block` columns (the expert
    paths all take it; see `fp8_round_activations`).
    """
    x, weights, experts, gate_up, down = _arrays(x, weights, experts, gate_up, down)
    N, H, E, k = check_routed(x, weights, experts, gate_up, down)
    dtype = x.dtype
    combine = jnp.einsum("nk,nke->ne", weights.astype(jnp.float32), jax.nn.one_hot(experts, E, dtype=jnp.float32))
    h = jnp.einsum("nh,eih->nei", _round_input(x, act_block), gate_up.astype(dtype))  # [N, E, 2I]
    a = _swiglu(h, act_block) * combine.astype(dtype)[:, :, None]  # [N, E, I], zero where not routed
    return jnp.einsum("nei,ehi->nh", a, down.astype(dtype)).astype(dtype)


# ------------------------------------------------------------------------------------------------------------
# Path 2: sort + grouped matmul
def _ragged_here() -> bool:
    """Whether the grouped matmul is `grouped_ragged` on this platform: on TPU, where XLA runs ragged_dot as a
    grouped matmul; elsewhere `grouped_tiles`. XLA:CPU lowers ragged_dot to slow loops, and XLA:GPU (jax 0.11,
    H200) to one dense product over every expert's block of H: a [M, E·H] operand (64 GiB for 65,536 routed rows of
    Qwen3.5-35B-A3B)."""
    return jax.default_backend() == "tpu"


def _check_grouped(x_sorted, group_sizes, gate_up, down):
    """The grouped matmul's operands as arrays, shapes checked."""
    x_sorted, group_sizes, gate_up, down = _arrays(x_sorted, group_sizes, gate_up, down)
    if x_sorted.ndim != 2:
        raise ValueError(f"x_sorted must be [M, H], got shape {_shape(x_sorted)}")
    E, _ = check_expert_weights(gate_up, down, x_sorted.shape[1])
    if _shape(group_sizes) != (E,):
        raise ValueError(f"group_sizes must be [E] = [{E}], got shape {_shape(group_sizes)}")
    dtype = x_sorted.dtype
    return x_sorted, group_sizes, gate_up.astype(dtype), down.astype(dtype)


@functools.partial(jax.jit, static_argnames=("act_block",))
def grouped_ragged(x_sorted, group_sizes, gate_up, down, *, act_block: int | None = None):
    """`grouped_swiglu` as two `jax.lax.ragged_dot_general` products straight on the HF [E, 2I, H] layout (x's H
    contracts with gate_up's last axis: no weight transpose). What XLA runs as a grouped matmul on TPU."""
    x_sorted, group_sizes, gate_up, down = _check_grouped(x_sorted, group_sizes, gate_up, down)
    if x_sorted.shape[0] == 0:
        return jnp.zeros_like(x_sorted)
    return _grouped_ragged(x_sorted, group_sizes.astype(jnp.int32), gate_up, down, act_block).astype(x_sorted.dtype)


def _grouped_ragged(x_sorted, group_sizes, gate_up, down, act_block=None):
    dn_gu = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    h = jax.lax.ragged_dot_general(_round_input(x_sorted, act_block), gate_up, group_sizes, dn_gu)  # [M, 2I]
    return jax.lax.ragged_dot_general(_swiglu(h, act_block), down, group_sizes, dn_gu)  # [M, H] (down is [E, H, I])


def tile_rows(M: int, E: int, tile: int = DEFAULT_TILE) -> int:
    """The full row tile `_grouped_tiles` uses for M sorted rows over E experts: the rows an expert gets on
    average, rounded down to a power of two, between 8 and `tile` (and at most M).

    A group's rows past its whole tiles run in one smaller tile (`remainder_tiles`), so a tile much larger than a
    group mostly multiplies rows that are not its own (and still reads the expert's weights once per tile); much
    smaller tiles run more, less efficient matmuls; the average, as a power of two, is the balance
    (`python benchmarks/moe.py` times the grouped matmul at several row counts)."""
    avg = max(1, M // max(E, 1))
    return max(1, min(tile, M, max(8, 1 << (avg.bit_length() - 1))))


def remainder_tiles(tm: int) -> tuple[int, ...]:
    """The row tiles a group's remainder (its last rows, fewer than tm) may take besides a full tm tile: tm/2, tm/4,
    ... down to max(8, tm/16); none below 16. Each group runs its remainder as ONE tile, the smallest of tm and
    these that holds it, so a group costs one matmul more than its whole tiles and wastes less than half of that
    last tile (or, in the smallest tile, fewer than its rows). On CPU a tile costs about as much as a tenth of a
    millisecond of rows, so fewer, larger matmuls beat less padding below a sixteenth of tm."""
    floor = max(8, tm // 16)
    out, t = [], tm // 2
    while t >= floor:
        out.append(t)
        t //= 2
    return tuple(out)


def _tile_loops(carry, group_sizes, M: int, tile: int, weights: tuple, run_tile):
    """The tile schedule of the "tiles" path over M rows sorted by expert, group_sizes [E], expert by expert: a
    `lax.scan` over the experts slices expert e's weights out of `weights` (arrays with a leading [E] axis) once,
    then calls `run_tile(carry, at, t, w_e, own) -> carry` once per tile of its rows, where the tile is sorted
    rows [at, at + t) (t static), w_e the expert's weight slices and own a [t] bool mask of the rows that belong
    to it (None: all do):

      1. its whole tiles of tm rows (`tile_rows`), a `fori_loop` (no iterations for a group smaller than tm);
      2. if r rows are left (0 < r < tm), ONE remainder tile: the smallest of tm and `remainder_tiles(tm)` that
         holds r, picked by a `lax.switch`. It runs past the group's end into the next group's rows (or, at the
         end of the rows, starts earlier so that it ends at row M); only its own rows count.

    An expert with no rows costs one skipped `lax.cond`. A group wastes less than half of its remainder tile, or
    fewer rows than the smallest tile size has (padding every group to whole tm-row tiles wasted up to tm - 1
    rows: a quarter of the expert FLOPs of the `small` preset's 4 x 512 prefill with tm = 128).

    Why expert by expert: on CPU a dynamic slice of the weights is a copy (XLA's dot fusions take whole buffers),
    so slicing once per expert rather than once per tile copies each expert's weights once, and the loops have no
    iterations to skip."""
    E = group_sizes.shape[0]
    tm = tile_rows(M, E, tile)
    sizes = (tm, *remainder_tiles(tm))
    gs = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(gs)
    starts = ends - gs  # [E] first sorted row of each group
    full = gs // tm  # [E] whole tiles in each group
    r = gs - full * tm  # [E] rows left after them
    size_class = jnp.zeros_like(r)  # [E] index into `sizes` of the remainder tile: the smallest that holds r
    for c in range(1, len(sizes)):
        size_class = jnp.where(r <= sizes[c], c, size_class)
    branch = jnp.where(r > 0, size_class + 1, 0)  # lax.switch branch: 0 = no remainder, c + 1 = tile sizes[c]

    def expert(carry, e):
        def run(carry):
            w_e = tuple(w[e] for w in weights)  # the copy, once per expert
            carry = jax.lax.fori_loop(0, full[e], lambda i, c: run_tile(c, starts[e] + i * tm, tm, w_e, None), carry)
            row = starts[e] + full[e] * tm  # the remainder's first row

            def remainder(t, carry):
                at = jnp.minimum(row, M - t)  # a tile that would run past row M starts earlier (t <= tm <= M)
                pos = at + jnp.arange(t, dtype=jnp.int32)
                return run_tile(carry, at, t, w_e, (pos >= row) & (pos < ends[e]))  # this group's rows only

            return jax.lax.switch(branch[e], [lambda c: c] + [functools.partial(remainder, t) for t in sizes], carry)

        return jax.lax.cond(gs[e] > 0, run, lambda c: c, carry), None

    carry, _ = jax.lax.scan(expert, carry, jnp.arange(E, dtype=jnp.int32))
    return carry


def _tile_swiglu(x_t, gate_up_e, down_e, scale=None, act_block=None):
    """One tile's rows x_t [rows, H] through one expert's dense SwiGLU (gate_up_e [2I, H], down_e [H, I]) ->
    [rows, H]; `scale` [rows] (the routing weights) multiplies the [rows, I] activations before the down
    projection, which is the same as scaling the [rows, H] output (the down projection is linear) but fuses into
    the SwiGLU's elementwise work instead of a pass over the output of its own. `act_block`: W8A8 (x_t arrives
    already rounded; the activations are rounded here, before the routing weights scale them)."""
    a = _swiglu(jnp.einsum("th,ih->ti", x_t, gate_up_e), act_block)  # [rows, I]
    if scale is not None:
        a = a * scale[:, None]
    return jnp.einsum("ti,hi->th", a, down_e)


@functools.partial(jax.jit, static_argnames=("tile", "act_block"))
def grouped_tiles(x_sorted, group_sizes, gate_up, down, *, tile: int = DEFAULT_TILE, act_block: int | None = None):
    """`grouped_swiglu` as row tiles of one expert each (`tile`: the largest tile; the one used depends on the rows
    per expert, `tile_rows`). What runs off TPU."""
    x_sorted, group_sizes, gate_up, down = _check_grouped(x_sorted, group_sizes, gate_up, down)
    if x_sorted.shape[0] == 0:
        return jnp.zeros_like(x_sorted)
    return _grouped_tiles(x_sorted, group_sizes, gate_up, down, tile, act_block).astype(x_sorted.dtype)


def _grouped_tiles(x_sorted, group_sizes, gate_up, down, tile: int, act_block=None):
    """`grouped_tiles`' body: every tile (`_tile_loops`) reads its rows of x_sorted in place and
    writes its own rows of the result in place (no padded copy of the rows or the result: padding x and y by a
    tile and slicing y back would copy [M, H] arrays for no gain)."""
    M, H = x_sorted.shape
    x_sorted = _round_input(x_sorted, act_block)

    def run_tile(y, at, t, w_e, own):
        out = _tile_swiglu(jax.lax.dynamic_slice_in_dim(x_sorted, at, t), *w_e, act_block=act_block)
        if own is not None:
            out = jnp.where(own[:, None], out, jax.lax.dynamic_slice_in_dim(y, at, t))
        return jax.lax.dynamic_update_slice_in_dim(y, out, at, 0)

    return _tile_loops(jnp.zeros((M, H), x_sorted.dtype), group_sizes, M, tile, (gate_up, down), run_tile)


def _sorted_tiles_fused(x, token, w_sorted, group_sizes, gate_up, down, tile: int, act_block=None):
    """`experts_sorted` with the tiles, the gather and the weighted scatter-add done per tile: each tile
    gathers its rows' tokens from x, runs its expert (the routing weights folded into the SwiGLU activations), and
    adds its own rows into the [N, H] result. No [M, H] sorted copy of the tokens and no [M, H] expert output
    (each a fresh k-times-the-tokens buffer that is written, then read once). The routing weights scale the
    activations inside the SwiGLU's elementwise fusion rather than the [t, H] output in a pass of its own."""
    N, H = x.shape
    x = _round_input(x, act_block)  # per token row, so rounding before the gather is rounding each sorted row

    def run_tile(out, at, t, w_e, own):
        idx = jax.lax.dynamic_slice_in_dim(token, at, t)
        y = _tile_swiglu(x[idx], *w_e, scale=jax.lax.dynamic_slice_in_dim(w_sorted, at, t), act_block=act_block)
        if own is not None:  # rows of the next group (or the previous one) go nowhere: index N is dropped
            idx = jnp.where(own, idx, N)
        return out.at[idx].add(y, mode="drop")

    return _tile_loops(jnp.zeros((N, H), x.dtype), group_sizes, token.shape[0], tile, (gate_up, down), run_tile)


@functools.partial(jax.jit, static_argnames=("tile", "act_block"))
def grouped_swiglu(x_sorted, group_sizes, gate_up, down, *, tile: int = DEFAULT_TILE, act_block: int | None = None):
    """Grouped SwiGLU expert MLP: rows [starts[e], starts[e] + group_sizes[e]) of x_sorted go through expert e.

    x_sorted [M, H], group_sizes [E] int (Σ = M), gate_up [E, 2I, H], down [E, H, I] -> [M, H] in x's dtype:
    `grouped_ragged` on TPU, `grouped_tiles` (largest row tile `tile`) elsewhere (see the module docstring);
    `act_block`: W8A8, as in `experts_dense`. This is the kernel boundary: a Pallas grouped matmul can replace it
    without touching the routing.
    """
    if _ragged_here():
        return grouped_ragged(x_sorted, group_sizes, gate_up, down, act_block=act_block)
    return grouped_tiles(x_sorted, group_sizes, gate_up, down, tile=tile, act_block=act_block)


@functools.partial(jax.jit, static_argnames=("grouped", "tile", "act_block"))
def experts_sorted(x, weights, experts, gate_up, down, *, grouped=None, tile: int = DEFAULT_TILE,
                   act_block: int | None = None):
    """Sort the N·k slots by expert, gather their tokens, grouped SwiGLU, weighted scatter-add back to tokens.

    Exactly the useful FLOPs (2·N·k·3IH); the data movement is a gather and a scatter-add of M = N·k rows. With
    the tiles (off TPU) each tile does its own gather and scatter-add (`_sorted_tiles_fused`); on TPU the whole
    [M, H] sorted rows go through `grouped_ragged`. `grouped`: a grouped matmul of `grouped_swiglu`'s signature to
    run instead (e.g. `grouped_ragged` on a CPU, or a kernel). `act_block`: W8A8, as in `experts_dense`."""
    x, weights, experts, gate_up, down = _arrays(x, weights, experts, gate_up, down)
    N, H, E, k = check_routed(x, weights, experts, gate_up, down)
    order, group_sizes = sort_by_expert(experts, E)
    token = order // k  # token of each sorted row
    w_sorted = weights.reshape(-1)[order].astype(x.dtype)
    if N == 0:
        return jnp.zeros_like(x)
    if grouped is None and not _ragged_here():  # gather and scatter-add inside the tiles
        return _sorted_tiles_fused(x, token, w_sorted, group_sizes, gate_up.astype(x.dtype), down.astype(x.dtype),
                                   tile, act_block)
    x_sorted = x[token]  # [M, H]
    y_sorted = (grouped or grouped_ragged)(x_sorted, group_sizes, gate_up, down, act_block=act_block)
    return jnp.zeros((N, H), x.dtype).at[token].add(y_sorted * w_sorted[:, None])


# Up to this many slots (N·k), `experts_gather` writes one product pair per slot (unrolled) rather than a scan.
# Unrolled, the slots' products are independent ops that XLA's CPU runtime spreads over its threads (the gain needs
# a second core); in a scan they run one after another. The bound keeps the program small for large configurations
# (the released model's 10 slots per token).
GATHER_UNROLL_MAX = 64


@functools.partial(jax.jit, static_argnames=("max_unrolled",))
def experts_gather(x, weights, experts, gate_up, down, *, max_unrolled: int = GATHER_UNROLL_MAX):
    """Decode-sized batches: M = N·k small matrix-vector products, one per slot, each with its expert's weights.

    Reads only the experts the slots use, with no sort or padding; the right schedule when M = N·k is at most
    about E (a decode step), where the weight reads dominate. Each slot slices its expert's [2I, H] and [H, I]
    in place; gathering all M experts' weights at once instead would write — and on CPU page-fault in — fresh
    [M, 2I, H] and [M, H, I] buffers every call. Up to `max_unrolled` slots the products are written out one per
    slot (independent ops, run concurrently: see `GATHER_UNROLL_MAX`); more slots go through a `lax.scan`."""
    x, weights, experts, gate_up, down = _arrays(x, weights, experts, gate_up, down)
    N, H, E, k = check_routed(x, weights, experts, gate_up, down)
    dtype = x.dtype

    def one_slot(e, x_m):
        # Written as vector @ matrix.T ([1, H] @ [H, 2I]), XLA's CPU backend emits each product as one loop fusion
        # that reads the expert's rows in place; matrix @ vector would copy the expert's weights out first.
        h = x_m[None] @ gate_up[e].astype(dtype).T  # [1, 2I]
        return (_swiglu(h) @ down[e].astype(dtype).T)[0]  # [H]

    slots = experts.reshape(-1)  # slot m = (token m // k, its (m % k)-th expert)
    if N * k <= max_unrolled:
        y = jnp.stack([one_slot(slots[m], x[m // k]) for m in range(N * k)])  # [M, H]
    else:
        _, y = jax.lax.scan(lambda _, s: (None, one_slot(*s)), None, (slots, jnp.repeat(x, k, axis=0)))
    return jnp.sum(y.reshape(N, k, H) * weights.astype(dtype)[..., None], axis=1)


# ------------------------------------------------------------------------------------------------------------
# Path 3: capacity factor
class CapacityStats(NamedTuple):
    """What the capacity path dropped. dropped: slots over capacity (int32); drop_rate: dropped / (N·k);
    dropped_per_expert [E]; capacity: C, the buffer rows per expert (a Python int)."""

    dropped: jax.Array
    drop_rate: jax.Array
    dropped_per_expert: jax.Array
    capacity: int


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor · N · k / E), capped at N (one token never sends two slots to the same expert,
    so no expert can receive more than N)."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def experts_capacity(x, weights, experts, gate_up, down, *, capacity_factor: float = 1.25):
    """Fixed per-expert buffers [E, C, H]; a slot whose rank within its expert (token order) is >= C is dropped:
    it adds nothing for that token (the other k − 1 slots still do; weights are not renormalised).

    Returns (y [N, H], CapacityStats). With C >= the largest expert load nothing drops and y equals the others."""
    x, weights, experts, gate_up, down = _arrays(x, weights, experts, gate_up, down)
    N, H, E, k = check_routed(x, weights, experts, gate_up, down)
    C = capacity(N, E, k, capacity_factor)
    y, dropped_per_expert = _experts_capacity(x, weights, experts, gate_up, down, C=C)
    dropped = jnp.sum(dropped_per_expert)
    return y, CapacityStats(dropped, dropped / (N * k), dropped_per_expert, C)


@functools.partial(jax.jit, static_argnames="C")
def _experts_capacity(x, weights, experts, gate_up, down, *, C: int):
    (N, H), E, k = x.shape, gate_up.shape[0], experts.shape[1]
    dtype = x.dtype
    rank = rank_in_expert(experts, E)  # [N, k]
    keep = rank < C
    # Dropped slots get an out-of-bounds row index: mode="drop" ignores them on the way in, fill 0 on the way out.
    slot_row = jnp.where(keep, rank, C)
    token = jnp.broadcast_to(jnp.arange(N)[:, None], (N, k))
    buf = jnp.zeros((E, C, H), dtype).at[experts, slot_row].set(x[token], mode="drop")  # [E, C, H]
    h = jnp.einsum("ech,eih->eci", buf, gate_up.astype(dtype))
    out = jnp.einsum("eci,ehi->ech", _swiglu(h), down.astype(dtype))  # [E, C, H]
    y_slots = out.at[experts, slot_row].get(mode="fill", fill_value=0)  # [N, k, H]
    y = jnp.einsum("nk,nkh->nh", (weights * keep).astype(dtype), y_slots)
    dropped_per_expert = jnp.zeros((E,), jnp.int32).at[experts].add((~keep).astype(jnp.int32))
    return y.astype(dtype), dropped_per_expert


# ------------------------------------------------------------------------------------------------------------
# Statistics and the auxiliary loss
class ExpertLoad(NamedTuple):
    """tokens_per_expert [E] int32 (slots routed to each expert; Σ = N·k), imbalance = max / mean load (1 is
    perfectly balanced, E/k when every slot goes to k experts)."""

    tokens_per_expert: jax.Array
    imbalance: jax.Array


@functools.partial(jax.jit, static_argnames="num_experts")
def expert_load(experts: jax.Array, num_experts: int) -> ExpertLoad:
    experts = jnp.asarray(experts)
    if experts.ndim != 2:
        raise ValueError(f"experts must be [N, k], got shape {_shape(experts)}")
    counts = jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)
    mean = experts.size / num_experts
    return ExpertLoad(counts, jnp.max(counts) / mean)


def load_balancing_loss(router_logits, num_experts: int, top_k: int, attention_mask=None) -> jax.Array:
    """Switch-style auxiliary loss with the semantics of transformers' `load_balancing_loss_func`:

        aux = E · Σ_e f_e · P_e,   f_e = (tokens whose top-k includes e) / tokens,   P_e = mean softmax prob of e

    over the rows of every layer together. Note f_e is per *token*, so Σ_e f_e = k: perfectly uniform routing
    (f_e = k/E, P_e = 1/E) gives aux = k, not 1 — so does any routing with balanced counts, or with equal
    probabilities — and collapse onto k experts (probability 1/k each) gives E.

    router_logits: a list/tuple of per-layer [N, E] arrays, a stacked [L, N, E] array, or the concatenation
    [L·N, E]. attention_mask [B, T] (B·T = N) or [N], 1 for real tokens: padding rows are left out of both
    f and P, the same mask applied to every layer. Returns a float32 scalar (without the coefficient).
    """
    if isinstance(router_logits, (list, tuple)):
        if not router_logits:
            raise ValueError("router_logits is an empty list; pass one [N, E] array per layer")
        layers = [jnp.asarray(r) for r in router_logits]
        for i, r in enumerate(layers):
            if r.ndim != 2 or r.shape[-1] != num_experts or r.shape != layers[0].shape:
                raise ValueError(f"router_logits[{i}] must be [N, E={num_experts}] like layer 0 "
                                 f"{_shape(layers[0])}, got {_shape(r)}")
        logits = jnp.stack(layers)
    else:
        logits = jnp.asarray(router_logits)
        if logits.ndim == 2:
            logits = logits[None]
    if logits.ndim != 3 or logits.shape[-1] != num_experts:
        raise ValueError(f"router_logits must be [N, E], [L, N, E] or a list of [N, E] with E = {num_experts}, "
                         f"got shape {_shape(logits)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts = {num_experts}], got {top_k}")
    R = logits.shape[1]
    if attention_mask is None:
        mask = jnp.ones((R,), jnp.float32)
    else:
        mask = jnp.asarray(attention_mask, jnp.float32).reshape(-1)
        if R % mask.shape[0]:
            raise ValueError(f"attention_mask has {mask.shape[0]} tokens, which does not divide the {R} router "
                             f"rows per layer; pass the [B, T] mask of the batch the logits came from")
        mask = jnp.tile(mask, R // mask.shape[0])  # a concatenated [L·N, E] input: the same mask per layer
    return _aux_loss(logits, mask, top_k=int(top_k))


@functools.partial(jax.jit, static_argnames="top_k")
def _aux_loss(logits, mask, *, top_k: int):
    L, _, E = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)  # [L, R, E]
    _, idx = jax.lax.top_k(probs, top_k)
    chosen = jnp.sum(jax.nn.one_hot(idx, E, dtype=jnp.float32), axis=-2)  # [L, R, E], k ones per row
    rows = L * jnp.sum(mask)
    f = jnp.einsum("lre,r->e", chosen, mask) / rows
    P = jnp.einsum("lre,r->e", probs, mask) / rows
    return E * jnp.sum(f * P)


def moe_flops(N: int, H: int, E: int, k: int, I: int, capacity_factor: float = 1.25) -> dict[str, float]:
    """Matmul FLOPs (2 per multiply-add) of the routed experts for each path: dense runs all E experts on every
    token, sorted only the k chosen, capacity E·C buffer rows."""
    per_row = 2 * 3 * I * H  # gate + up + down
    return {
        "dense": float(N * E * per_row),
        "sorted": float(N * k * per_row),
        "capacity": float(E * capacity(N, E, k, capacity_factor) * per_row),
    }


# ------------------------------------------------------------------------------------------------------------
# The layer
class TopKRouter(nnx.Module):
    """`gate.weight` [E, H]."""

    def __init__(self, num_experts: int, hidden: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.weight = nnx.Param(init_normal(rngs, (num_experts, hidden), DEFAULT_INIT_STD, param_dtype))


class Experts(nnx.Module):
    """Fused expert weights in the HF layout: `gate_up_proj` [E, 2I, H] (rows gate then up), `down_proj` [E, H, I].

    With `fp8=True` both are float8_e4m3fn with the official release's 128x128 block scales beside them,
    `gate_up_proj_scale_inv` [E, ceil(2I/128), ceil(H/128)] and `down_proj_scale_inv` [E, ceil(H/128),
    ceil(I/128)] (float32): a quarter of float32's bytes, half of bfloat16's — how the 397B model's experts (720
    GiB in bf16, 360 GiB in FP8) fit one serving host. `dequantized(dtype)` gives the weights the expert paths
    multiply with."""

    def __init__(self, num_experts: int, hidden: int, width: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32,
                 fp8: bool = False):
        E, H, I = num_experts, hidden, width
        self.fp8 = fp8
        self.gate_up_proj = nnx.Param(init_normal(rngs, (E, 2 * I, H), DEFAULT_INIT_STD, param_dtype))
        self.down_proj = nnx.Param(init_normal(rngs, (E, H, I), DEFAULT_INIT_STD, param_dtype))
        if fp8:  # a random init quantised with unit scales (loading a checkpoint replaces both)
            self.gate_up_proj = nnx.Param(self.gate_up_proj[...].astype(jnp.float8_e4m3fn))
            self.down_proj = nnx.Param(self.down_proj[...].astype(jnp.float8_e4m3fn))
            b = lambda n: -(-n // FP8_BLOCK)  # noqa: E731
            self.gate_up_proj_scale_inv = nnx.Param(jnp.ones((E, b(2 * I), b(H)), jnp.float32))
            self.down_proj_scale_inv = nnx.Param(jnp.ones((E, b(H), b(I)), jnp.float32))

    def fp8_tiles(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None:
        """(gate_up, down, gate_up_scale_inv, down_scale_inv) as stored, when the experts are FP8 with whole 128-wide
        scale blocks along both contractions (H and I): what the Pallas kernels read tile by tile, scaling in VMEM,
        so the weights stream from HBM at one byte each. Else None (the kernels then take `dequantized`)."""
        gu, dn = self.gate_up_proj[...], self.down_proj[...]
        if not self.fp8 or gu.shape[2] % FP8_BLOCK or dn.shape[2] % FP8_BLOCK:
            return None
        return gu, dn, self.gate_up_proj_scale_inv[...], self.down_proj_scale_inv[...]

    def dequantized(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(gate_up, down) to multiply with: the stored arrays, or with `fp8` the block-dequantised ones in `dtype`
        (inside a jitted forward, a transient copy of this layer's experts). The Pallas paths skip it when they can
        (`fp8_tiles`): their kernels read the FP8 tiles and scales themselves (`qwen35.kernels.grouped_matmul`);
        the XLA paths and the sharded model's `moe_ep` use it."""
        gu, dn = self.gate_up_proj[...], self.down_proj[...]
        if not self.fp8:
            return gu, dn
        return (fp8_dequantize(gu, self.gate_up_proj_scale_inv[...], dtype),
                fp8_dequantize(dn, self.down_proj_scale_inv[...], dtype))


class MLP(nnx.Module):
    """SwiGLU MLP (the shared expert): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, width: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.gate_proj = Linear(hidden, width, rngs=rngs, param_dtype=param_dtype)
        self.up_proj = Linear(hidden, width, rngs=rngs, param_dtype=param_dtype)
        self.down_proj = Linear(width, hidden, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


# Below this many multiply-adds for running *every* expert on every token (N·E·3·I·H), the sorted path's sort,
# gathers and tile loop cost more than the E/k-fold extra FLOPs of `experts_dense`, which is a few fused ops; on a
# 2-core CPU the two cross near 2M (the tiny preset's MoE, `python benchmarks/moe.py --hidden 64 --experts 8
# --top-k 2 --width 32 --tokens N` at N = 32 to 256, times both). Decode-sized batches (N·k <= E) take
# `experts_gather` before this test, and the `small` preset's smallest batch past that bound is 113M MACs: only toy
# configurations get here.
DENSE_MAX_MACS = 2 * 2**20


class SparseMoeBlock(nnx.Module):
    """Qwen3.5's MoE FFN (`model.layers.{i}.mlp.*`): top-k routed experts plus a sigmoid-gated shared expert.

    Parameters (checkpoint names and layouts): `gate.weight` [E, H], `experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I], `shared_expert.{gate,up}_proj.weight` [Is, H], `shared_expert.down_proj.weight`
    [H, Is], `shared_expert_gate.weight` [1, H].

    `execution` (a `qwen35.execution.Execution`) picks how the routed experts run, in one place (`routed`):
    `experts` "sorted" (default; a decode-sized batch with N·k <= E takes `experts_gather`, the same sum with the
    used experts' weights gathered, and a batch whose dense work N·E·3IH is at most `DENSE_MAX_MACS`
    multiply-adds takes `experts_dense`; with `kernels="pallas"` every batch size takes the Pallas kernels,
    `qwen35.kernels.grouped_matmul.experts_sorted_pallas`: permute, grouped SwiGLU, unpermute; FP8 experts go to
    them as FP8 tiles + block scales), "dense" or "capacity" (slots per expert `execution.capacity`; its drop
    statistics are available from `experts_capacity`).

    `execution.w8a8` (FP8 experts, `experts` "sorted" or "dense"): the routed tokens and the SwiGLU output are
    quantised to FP8 per row and 512 columns before their matmuls. With `kernels="pallas"` the kernels multiply
    FP8 by FP8 (the MXU's FP8 rate); the XLA paths round the activations through FP8 and multiply the dequantised
    weights (`fp8_round_activations`: the same values). The shared expert stays in the compute dtype.
    `__call__(x [B, T, H]) -> (y [B, T, H], router_logits [B·T, E] fp32)`.
    """

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs, param_dtype=jnp.float32, fp8_experts: bool = False,
                 execution: Execution = Execution()):
        c, ex = config, execution
        if c.num_experts_per_tok > c.num_experts:
            raise ValueError(f"num_experts_per_tok ({c.num_experts_per_tok}) cannot exceed num_experts "
                             f"({c.num_experts})")
        if ex.w8a8 and not fp8_experts:
            raise ValueError("Execution(w8a8=True) multiplies FP8 activations with FP8 expert weights: build the "
                             "model with fp8_experts=True, or load an FP8 checkpoint with fp8='keep'")
        if ex.w8a8 and (c.hidden_size % ACT_BLOCK or c.moe_intermediate_size % ACT_BLOCK):
            raise ValueError(
                f"Execution(w8a8=True) quantises the expert activations in {ACT_BLOCK}-wide blocks, so hidden_size "
                f"and moe_intermediate_size must be multiples of {ACT_BLOCK}, got {c.hidden_size} and "
                f"{c.moe_intermediate_size}; use w8a8=False (activations stay in the compute dtype)")
        self.config, self.execution = c, ex
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        H = c.hidden_size
        self.gate = TopKRouter(c.num_experts, H, rngs=rngs, param_dtype=param_dtype)
        self.experts = Experts(c.num_experts, H, c.moe_intermediate_size, rngs=rngs, param_dtype=param_dtype,
                               fp8=fp8_experts)
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(H, c.shared_expert_intermediate_size, rngs=rngs, param_dtype=param_dtype)
            self.shared_expert_gate = Linear(H, 1, rngs=rngs, param_dtype=param_dtype)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def routed(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """The routed-expert sum for x [N, H] on one device, as `execution` says."""
        ex, run = self.experts, self.execution
        if run.experts == "sorted" and run.kernels == "pallas":  # the Pallas kernels, prefill and decode
            tiles = ex.fp8_tiles()
            if tiles is not None:  # FP8 tiles read in VMEM
                gu, dn, gs, ds = tiles
                return experts_sorted_pallas(x, weights, experts, gu, dn, gate_up_scale=gs, down_scale=ds,
                                             w8a8=run.w8a8)
            return experts_sorted_pallas(x, weights, experts, *ex.dequantized(x.dtype))
        gu, dn = ex.dequantized(x.dtype)
        act = ACT_BLOCK if run.w8a8 else None
        if run.experts == "dense":
            return experts_dense(x, weights, experts, gu, dn, act_block=act)
        if run.experts == "capacity":
            return experts_capacity(x, weights, experts, gu, dn, capacity_factor=run.capacity)[0]
        N, E, I2, H = x.shape[0], *gu.shape
        if N * self.top_k <= self.num_experts and act is None:  # decode-sized: gather the used experts' weights
            return experts_gather(x, weights, experts, gu, dn)
        if N * E * 3 * (I2 // 2) * H <= DENSE_MAX_MACS:  # so little work that the fewest ops win (see the constant)
            return experts_dense(x, weights, experts, gu, dn, act_block=act)
        return experts_sorted(x, weights, experts, gu, dn, act_block=act)

    def __call__(self, x: jax.Array, *, routed_fn=None) -> tuple[jax.Array, jax.Array]:
        """`routed_fn(block, x [N, H], weights [N, k], experts [N, k]) -> y [N, H]` replaces `routed` for the
        routed-expert sum, around the same router and shared expert: a placed model hands in the expert-parallel
        exchange (`qwen35.sharding.moe_on_mesh`, a `shard_map`), the serving engine's data-parallel
        step, already inside a `shard_map`, its explicit collectives (`qwen35.sharding.moe_ep_local`)."""
        H = self.config.hidden_size
        if x.ndim != 3 or x.shape[-1] != H:
            raise ValueError(f"SparseMoeBlock expects x [B, T, {H}], got {_shape(x)}")
        B, T, _ = x.shape
        x_nh = x.reshape(B * T, H)
        weights, experts, logits = route(x_nh, self.gate.weight[...], self.top_k)
        if routed_fn is None:
            y = self.routed(x_nh, weights.astype(x.dtype), experts)
        else:
            y = routed_fn(self, x_nh, weights.astype(x.dtype), experts)
        if self.shared_expert is not None:
            gate = jax.nn.sigmoid(self.shared_expert_gate(x_nh).astype(jnp.float32)).astype(x.dtype)  # [N, 1]
            y = y + gate * self.shared_expert(x_nh)
        return y.reshape(B, T, H), logits
