"""Sparse MoE: the router against torch, the three expert paths against each other (empty experts, capacity
drops counted by hand), the aux loss against transformers' `load_balancing_loss_func`, and the whole
`SparseMoeBlock` against transformers' `Qwen3_5MoeSparseMoeBlock` with the same weights."""

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import assert_close, assert_topk_consistent, fp32_tol, to_torch, topk_margin
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

import qwen35
from qwen35.execution import Execution
from qwen35 import moe
from qwen35.parity import hf_text_config

ODD = dict(hidden_size=40, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
           shared_expert_intermediate_size=12)


def expert_weights(rng, E, H, I, scale=0.1):
    gate_up = (scale * rng.standard_normal((E, 2 * I, H))).astype(np.float32)
    down = (scale * rng.standard_normal((E, H, I))).astype(np.float32)
    return gate_up, down


def routed_inputs(rng, N, H, E, k, I, *, skip_expert=None):
    """x, normalised weights and k distinct expert ids per token (optionally never using one expert)."""
    x = rng.standard_normal((N, H)).astype(np.float32)
    pool = [e for e in range(E) if e != skip_expert]
    experts = np.stack([rng.choice(pool, size=k, replace=False) for _ in range(N)]).astype(np.int32)
    w = rng.uniform(0.1, 1.0, size=(N, k)).astype(np.float32)
    return x, w / w.sum(-1, keepdims=True), experts, *expert_weights(rng, E, H, I)


def numpy_moe(x, weights, experts, gate_up, down):
    """Per-token loop in float64: the plainest statement of the routed sum."""
    I = down.shape[-1]
    y = np.zeros(x.shape, np.float64)
    for n in range(x.shape[0]):
        for w, e in zip(weights[n], experts[n]):
            h = gate_up[e].astype(np.float64) @ x[n]
            g, u = h[:I], h[I:]
            y[n] += w * (down[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return y


# ---------------------------------------------------------------------------------------------------------
# Router
def route_tols(x, w_r):
    """Bounds for route(x, w_r): the logits are H-term sums; a top-k weight w_i = exp(l_i) / sum over the top k of
    exp(l_j), so an error d in the logits moves it by w_i (d_i - sum_j w_j d_j): at most 2 |d| (plus its own few
    roundings). Returns (logit bound, weight bound)."""
    logits = np.asarray(x, np.float64) @ np.asarray(w_r, np.float64).T
    lt = fp32_tol(np.max(np.abs(logits)), x.shape[-1])
    return lt, 2 * lt + fp32_tol(1.0, w_r.shape[0])


def check_route(x, w_r, k, weights, experts, logits, t_logits):
    """route's outputs against float64 numpy (the tie-aware top-k) and torch's logits."""
    lt, wt = route_tols(x, w_r)
    ref = np.asarray(x, np.float64) @ np.asarray(w_r, np.float64).T
    assert_close(logits, t_logits, atol=2 * lt, name="logits vs torch")  # two float32 evaluations
    assert_close(logits, ref, atol=lt, name="logits vs float64")
    assert_topk_consistent(experts, weights, ref, lt, wt, name="route")
    assert_close(np.sum(np.asarray(weights), -1), np.ones(len(x)), terms=k, name="sum of weights")


@pytest.mark.parametrize("N,H,E,k", [(37, 64, 8, 2), (50, 40, 6, 3), (16, 24, 5, 5), (9, 8, 4, 1)])
def test_route_matches_torch(rng, N, H, E, k):
    x = rng.standard_normal((N, H)).astype(np.float32)
    w_r = rng.standard_normal((E, H)).astype(np.float32)
    weights, experts, logits = moe.route(x, w_r, k)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32 and logits.dtype == jnp.float32
    assert weights.shape == experts.shape == (N, k) and logits.shape == (N, E)
    t_logits = to_torch(x) @ to_torch(w_r).T
    p = torch.softmax(t_logits, dim=-1, dtype=torch.float)
    tw, ti = torch.topk(p, k, dim=-1)
    tw = tw / tw.sum(-1, keepdim=True)
    check_route(x, w_r, k, weights, experts, logits, t_logits.numpy())
    # torch's own choice is a correct top-k too (its order among near ties may differ from ours)
    assert_topk_consistent(ti.numpy(), tw.numpy(), t_logits.numpy(), *route_tols(x, w_r), name="torch")


def test_route_exact_ties_go_to_the_lower_expert(rng):
    """Experts 1 and 4 (and 2 and 3) have identical router rows, so their logits tie exactly on every CPU: route
    takes the lower id first (torch.topk leaves the order of ties unspecified), and either way the weights are the
    same."""
    N, H, E, k = 24, 16, 6, 3
    x = rng.standard_normal((N, H)).astype(np.float32)
    w_r = rng.standard_normal((E, H)).astype(np.float32)
    w_r[4], w_r[3] = w_r[1], w_r[2]
    weights, experts, logits = moe.route(x, w_r, k)
    lg = np.asarray(logits)
    assert np.array_equal(lg[:, 1], lg[:, 4]) and np.array_equal(lg[:, 2], lg[:, 3])  # the ties are exact
    e = np.asarray(experts)
    for a, b in ((1, 4), (2, 3)):
        both = (e == a).any(-1) & (e == b).any(-1)
        assert both.any(), "the data has rows choosing both tied experts"
        pos_a, pos_b = np.argmax(e == a, -1), np.argmax(e == b, -1)
        assert np.all(pos_a[both] < pos_b[both]), f"expert {a} before its tie {b}"
        only_b = (e == b).any(-1) & ~(e == a).any(-1)
        assert not only_b.any(), f"expert {b} chosen without its lower tie {a}"
    t_logits = (to_torch(x) @ to_torch(w_r).T).numpy()
    check_route(x, w_r, k, weights, experts, logits, t_logits)


def test_route_matches_hf_router(rng):
    cfg = qwen35.tiny()
    router = hf.Qwen3_5MoeTopKRouter(hf_config(cfg))
    x = rng.standard_normal((20, cfg.hidden_size)).astype(np.float32)
    w_r = rng.standard_normal((cfg.num_experts, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(to_torch(w_r))
        t_logits, t_w, t_i = router(to_torch(x))
    weights, experts, logits = moe.route(x, w_r, cfg.num_experts_per_tok)
    check_route(x, w_r, cfg.num_experts_per_tok, weights, experts, logits, t_logits.numpy())
    assert_topk_consistent(t_i.numpy(), t_w.numpy(), t_logits.numpy(), *route_tols(x, w_r), name="transformers")


def test_route_bounds_catch_real_bugs(rng):
    """The router's bounds are loose enough for any CPU's rounding and tight enough for real bugs: weights left
    unnormalised, a transposed router matrix and a wrong expert all fail check_route."""
    N, H, E, k = 37, 64, 8, 2
    x = rng.standard_normal((N, H)).astype(np.float32)
    w_r = rng.standard_normal((E, H)).astype(np.float32)
    t_logits = (to_torch(x) @ to_torch(w_r).T).numpy()
    weights, experts, logits = moe.route(x, w_r, k)
    check_route(x, w_r, k, weights, experts, logits, t_logits)
    raw, _, _ = moe.route(x, w_r, k, normalize=False)
    wrong_expert = np.asarray(experts).copy()
    wrong_expert[5, 1] = next(e for e in range(E) if e not in wrong_expert[5])
    sq = rng.standard_normal((H, H)).astype(np.float32)  # a square router, so its transpose has the same shape
    for name, args in [("unnormalised", (raw, experts, logits, t_logits)),
                       ("wrong expert", (weights, wrong_expert, logits, t_logits))]:
        with pytest.raises(AssertionError):
            check_route(x, w_r, k, *args)
    wt, et, lt = moe.route(x, sq.T, k)
    with pytest.raises(AssertionError):
        check_route(x, sq, k, wt, et, lt, (to_torch(x) @ to_torch(sq).T).numpy())


def test_route_rejects_bad_inputs(rng):
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="top-k"):
        moe.route(x, np.zeros((3, 8), np.float32), 4)
    with pytest.raises(ValueError, match=r"router_w must be \[E, H\]"):
        moe.route(x, np.zeros((3, 7), np.float32), 2)
    with pytest.raises(ValueError, match=r"x must be \[N, H\]"):
        moe.route(x[None], np.zeros((3, 8), np.float32), 2)


# ---------------------------------------------------------------------------------------------------------
# Three expert paths
PATHS = {
    "dense": moe.experts_dense,
    "sorted": moe.experts_sorted,  # the tiles off TPU, gather and scatter-add inside them
    "sorted_ragged_dot": lambda *a: moe.experts_sorted(*a, grouped=moe.grouped_ragged),
    "capacity_big": lambda *a: moe.experts_capacity(*a, capacity_factor=100.0)[0],
    "gather": moe.experts_gather,
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("N,H,E,k,I,skip", [(33, 16, 8, 2, 12, None), (50, 40, 6, 3, 20, 4), (7, 8, 5, 1, 4, 0),
                                            (1, 8, 4, 4, 6, None)])
def test_paths_equal_numpy(rng, path, N, H, E, k, I, skip):
    x, w, e, gu, dn = routed_inputs(rng, N, H, E, k, I, skip_expert=skip)
    if skip is not None:
        assert moe.expert_load(e, E).tokens_per_expert[skip] == 0  # an expert with an empty group
    y = PATHS[path](x, w, e, gu, dn)
    assert y.shape == (N, H) and y.dtype == jnp.float32
    assert_close(y, numpy_moe(x, w, e, gu, dn), terms=H + I + k, name=path)


@pytest.mark.parametrize("max_unrolled", [0, moe.GATHER_UNROLL_MAX])
def test_gather_scan_and_unrolled(rng, max_unrolled):
    """Both schedules of experts_gather (a scan over the slots; the slots written out one by one) against numpy,
    with repeated experts across tokens."""
    N, H, E, k, I = 6, 24, 8, 3, 10
    x, w, e, gu, dn = routed_inputs(rng, N, H, E, k, I)
    e[1] = e[0]  # two tokens on the same experts
    assert N * k <= moe.GATHER_UNROLL_MAX  # the default unrolls this batch
    y = moe.experts_gather(x, w, e, gu, dn, max_unrolled=max_unrolled)
    assert_close(y, numpy_moe(x, w, e, gu, dn), terms=H + I + k, name=f"gather max_unrolled={max_unrolled}")


def test_paths_agree_under_jit_and_skewed_routing(rng):
    """Every token sends a slot to expert 0 (one full group, several empty ones), all paths jitted."""
    N, H, E, k, I = 300, 16, 16, 2, 8
    x, w, e, gu, dn = routed_inputs(rng, N, H, E, k, I)
    e[:, 0] = 0
    e[:, 1] = np.where(e[:, 1] == 0, 1, e[:, 1]) % 3 + 1  # experts 1..3 only; 4..15 receive nothing
    ref = numpy_moe(x, w, e, gu, dn)
    for name, fn in PATHS.items():
        assert_close(jax.jit(fn)(x, w, e, gu, dn), ref, terms=H + I + k, name=name)


@pytest.mark.parametrize("N, k, E", [(2048, 4, 32), (37, 3, 5), (1, 1, 1), (512, 4, 2**20)])
def test_sort_by_expert_is_stable_argsort(rng, N, k, E):
    """The sorted order is numpy's stable argsort of the expert ids (token order inside each group), whether it
    comes from one int32 key per slot or, when E·M does not fit in int32 (E = 2**20 here), from `argsort`; the
    group sizes are the counts."""
    experts = rng.integers(0, min(E, 40), (N, k)).astype(np.int32)
    if E == 2**20:
        assert (E + 1) * N * k >= 2**31  # the argsort branch
        experts[::7] += E - 40  # ids near the top of the range
    order, group_sizes = moe.sort_by_expert(jnp.asarray(experts), E)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(experts.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(np.asarray(group_sizes), np.bincount(experts.reshape(-1), minlength=E))


@pytest.mark.parametrize("group_sizes", [[0, 7, 0, 130, 3], [600, 0, 0, 300, 1], [700, 0, 0, 63, 738],
                                         [900, 0, 0, 0, 20]])
def test_grouped_swiglu_methods_agree(rng, group_sizes):
    """Full tiles of 8 to 256 rows (`tile_rows`, capped by `tile`), each group's remainder in one tile of the
    smallest size that holds it (`remainder_tiles`): groups of whole tiles plus a remainder, groups smaller than a
    tile, a remainder tile running into the next groups' rows (700 = 2·256 + 188, then 63), one that would run
    past the last row (738 = 2·256 + 226: shifted back to end at the last row) and a last group smaller than its
    tile, which starts inside the previous group's rows (20 rows after 900, in a 32-row tile); all against numpy,
    per group."""
    E, H, I = 5, 12, 8
    gu, dn = expert_weights(rng, E, H, I)
    group_sizes = np.array(group_sizes, np.int32)
    xs = rng.standard_normal((int(group_sizes.sum()), H)).astype(np.float32)
    ref = _grouped_reference(xs, group_sizes, gu, dn)
    for name, fn in [("tiles 128", lambda *a: moe.grouped_tiles(*a, tile=128)),
                     ("tiles 64", lambda *a: moe.grouped_tiles(*a, tile=64)),
                     ("tiles 8", lambda *a: moe.grouped_tiles(*a, tile=8)),
                     ("ragged_dot", moe.grouped_ragged), ("grouped_swiglu", moe.grouped_swiglu)]:
        assert_close(jax.jit(fn)(xs, group_sizes, gu, dn), ref, terms=H + I, name=name)


def _grouped_reference(xs, group_sizes, gu, dn):
    """numpy, group by group (float64)."""
    I = dn.shape[-1]
    h = np.zeros(xs.shape, np.float64)
    start = 0
    for e, n in enumerate(group_sizes):
        x = xs[start:start + n].astype(np.float64)
        a = x @ gu[e].T.astype(np.float64)
        g, u = a[:, :I], a[:, I:]
        h[start:start + n] = (g / (1 + np.exp(-g)) * u) @ dn[e].T.astype(np.float64)
        start += n
    return h


_TILES_M, _TILES_E = 1100, 4  # 275 rows per expert on average: 256-row full tiles, remainders in 256 down to 16
_FEW_M, _FEW_E = 40, 16  # 2 rows per expert: 8-row tiles, larger than the average group
_tiles_fn = jax.jit(moe.grouped_tiles)


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, _TILES_M), min_size=_TILES_E - 1, max_size=_TILES_E - 1))
def test_grouped_tiles_any_group_sizes(cuts):
    """Any split of 1,100 sorted rows over 4 experts (empty groups, groups of a few rows, groups of whole tiles,
    one group holding everything) gives numpy's per-group result: group sizes are data, so every example runs
    the same compiled program, with a different tile schedule."""
    edges = np.array([0, *sorted(cuts), _TILES_M])
    group_sizes = np.diff(edges).astype(np.int32)
    rng = np.random.default_rng(int(edges.sum()))
    gu, dn = expert_weights(rng, _TILES_E, 8, 4)
    xs = rng.standard_normal((_TILES_M, 8)).astype(np.float32)
    assert moe.tile_rows(_TILES_M, _TILES_E) == 256 and moe.remainder_tiles(256) == (128, 64, 32, 16)
    assert_close(_tiles_fn(xs, group_sizes, gu, dn), _grouped_reference(xs, group_sizes, gu, dn), terms=8 + 4,
                 name=f"group sizes {group_sizes.tolist()}")


_sorted_tiles_fn = jax.jit(moe.experts_sorted)  # the tiles off TPU


@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(0, _TILES_M), min_size=_TILES_E - 1, max_size=_TILES_E - 1))
def test_sorted_tiles_any_group_sizes(cuts):
    """experts_sorted with tiles, which gathers and scatter-adds inside each tile: 1,100 tokens (k = 1) split
    over 4 experts in any proportion, in shuffled token order, against the per-token numpy loop."""
    edges = np.array([0, *sorted(cuts), _TILES_M])
    group_sizes = np.diff(edges)
    rng = np.random.default_rng(int(edges.sum()) + 1)
    gu, dn = expert_weights(rng, _TILES_E, 8, 4)
    x = rng.standard_normal((_TILES_M, 8)).astype(np.float32)
    e = rng.permutation(np.repeat(np.arange(_TILES_E), group_sizes)).astype(np.int32)[:, None]
    w = rng.uniform(0.1, 1.0, (_TILES_M, 1)).astype(np.float32)
    assert_close(_sorted_tiles_fn(x, w, e, gu, dn), numpy_moe(x, w, e, gu, dn), terms=8 + 4 + 1,
                 name=f"group sizes {group_sizes.tolist()}")


@settings(max_examples=15, deadline=None)
@given(experts=st.lists(st.integers(0, _FEW_E - 1), min_size=_FEW_M, max_size=_FEW_M))
def test_sorted_tiles_many_small_groups(experts):
    """experts_sorted with tiles when most groups are smaller than a tile: each remainder tile reaches into its
    neighbours' rows, whose tokens it must not add to (k = 1, 40 tokens, 16 experts)."""
    e = np.array(experts, np.int32)[:, None]
    rng = np.random.default_rng(int(e.sum()) + 1)
    gu, dn = expert_weights(rng, _FEW_E, 8, 4)
    x = rng.standard_normal((_FEW_M, 8)).astype(np.float32)
    w = rng.uniform(0.1, 1.0, (_FEW_M, 1)).astype(np.float32)
    assert_close(_sorted_tiles_fn(x, w, e, gu, dn), numpy_moe(x, w, e, gu, dn), terms=8 + 4 + 1,
                 name=f"experts {experts}")


def test_remainder_tiles():
    """tm/2, tm/4, ... down to max(8, tm/16); none below 16."""
    assert moe.remainder_tiles(256) == (128, 64, 32, 16)
    assert moe.remainder_tiles(128) == (64, 32, 16, 8)
    assert moe.remainder_tiles(16) == (8,)
    assert [moe.remainder_tiles(t) for t in (1, 5, 8, 15)] == [()] * 4


def test_tile_rows():
    """The average rows per expert, as a power of two in [8, tile], never above M."""
    assert moe.tile_rows(64, 32) == 8  # 2 rows per expert: the floor
    assert moe.tile_rows(512, 32) == 16  # a 128-token prefill's 512 slots, k = 4
    assert moe.tile_rows(2048, 32) == 64  # 64 rows per expert
    assert moe.tile_rows(3000, 32) == 64  # 93 rows per expert: rounded down
    assert moe.tile_rows(4096, 32) == 128
    assert moe.tile_rows(8192, 32) == 256  # the small preset's 4 x 512 prefill, k = 4
    assert moe.tile_rows(8192, 32, tile=64) == 64 and moe.tile_rows(10**6, 8) == 256  # capped
    assert moe.tile_rows(5, 32) == 5  # never more rows than there are
    assert moe.tile_rows(140, 5) == 16 and moe.tile_rows(901, 5) == 128 and moe.tile_rows(1501, 5) == 256


@settings(max_examples=15, deadline=None)
@given(experts=st.lists(st.integers(0, _FEW_E - 1), min_size=_FEW_M, max_size=_FEW_M))
def test_grouped_tiles_many_small_groups(experts):
    """More experts than the rows allow whole tiles for: up to 16 groups with a remainder each (more than M / 8
    tiles of 8 rows), against numpy."""
    group_sizes = np.bincount(experts, minlength=_FEW_E).astype(np.int32)
    rng = np.random.default_rng(int(group_sizes @ np.arange(_FEW_E)))
    gu, dn = expert_weights(rng, _FEW_E, 8, 4)
    xs = rng.standard_normal((_FEW_M, 8)).astype(np.float32)
    assert moe.tile_rows(_FEW_M, _FEW_E) == 8 and moe.remainder_tiles(8) == ()
    assert_close(_tiles_fn(xs, group_sizes, gu, dn), _grouped_reference(xs, group_sizes, gu, dn), terms=8 + 4,
                 name=f"group sizes {group_sizes.tolist()}")


def test_capacity_drops_counted(rng):
    N, H, E, k, I = 64, 8, 4, 2, 4
    x, w, e, gu, dn = routed_inputs(rng, N, H, E, k, I)
    e[: N // 2, 0] = 0  # overload expert 0 with the first half of the tokens
    e[: N // 2, 1] = np.where(e[: N // 2, 1] == 0, 1, e[: N // 2, 1])
    for cf in (0.5, 1.0, 1.25, 2.0):
        C = math.ceil(cf * N * k / E)
        assert moe.capacity(N, E, k, cf) == min(C, N)
        # numpy: walk tokens in order, keep a slot while its expert has room
        used = np.zeros(E, int)
        keep = np.zeros((N, k), bool)
        for n in range(N):
            for j in range(k):
                if used[e[n, j]] < C:
                    keep[n, j] = True
                    used[e[n, j]] += 1
        y, stats = moe.experts_capacity(x, w, e, gu, dn, capacity_factor=cf)
        assert int(stats.dropped) == int((~keep).sum()), cf
        assert_close(stats.drop_rate, (~keep).sum() / (N * k), terms=1, name="drop rate")  # one division
        np.testing.assert_array_equal(np.asarray(stats.dropped_per_expert),
                                      np.bincount(e[~keep], minlength=E))
        assert stats.capacity == min(C, N)
        assert_close(y, numpy_moe(x, w * keep, e, gu, dn), terms=H + I + k, name=f"y at cf={cf}")
    assert int(stats.dropped) == 0  # cf = 2 covers the overload here: nothing dropped
    y_big, stats_big = jax.jit(lambda *a: moe.experts_capacity(*a, capacity_factor=8.0))(x, w, e, gu, dn)
    assert int(stats_big.dropped) == 0
    assert_close(y_big, moe.experts_dense(x, w, e, gu, dn), terms=H + I + k, name="big capacity == dense")


def test_path_input_checks(rng):
    x, w, e, gu, dn = routed_inputs(rng, 5, 8, 4, 2, 6)
    with pytest.raises(ValueError, match=r"x must be \[N, H\]"):
        moe.experts_sorted(x[None], w, e, gu, dn)
    with pytest.raises(ValueError, match=r"down must be \[E, H, I\]"):
        moe.experts_dense(x, w, e, gu, dn[:, :, :-1])
    with pytest.raises(ValueError, match=r"gate_up .* hidden size"):
        moe.experts_capacity(x[:, :-1], w, e, gu, dn)
    with pytest.raises(ValueError, match=r"experts .* and weights .* must both be \[N, k\]"):
        moe.experts_dense(x, w, e[:, :1], gu, dn)
    with pytest.raises(ValueError, match="integer expert ids"):
        moe.experts_dense(x, w, e.astype(np.float32), gu, dn)
    with pytest.raises(ValueError, match="cannot exceed E"):
        moe.experts_dense(x, np.ones((5, 5), np.float32), np.zeros((5, 5), np.int32), gu, dn)
    with pytest.raises(ValueError, match="group_sizes must be"):
        moe.grouped_swiglu(x, np.array([5], np.int32), gu, dn)
    with pytest.raises(ValueError, match="group_sizes must be"):
        moe.grouped_ragged(x, np.array([5], np.int32), gu, dn)
    with pytest.raises(ValueError, match="capacity_factor must be positive"):
        moe.experts_capacity(x, w, e, gu, dn, capacity_factor=0.0)


# ---------------------------------------------------------------------------------------------------------
# Statistics and the aux loss
def test_expert_load():
    experts = np.array([[0, 1], [0, 2], [0, 1]], np.int32)
    load = moe.expert_load(experts, 4)
    np.testing.assert_array_equal(np.asarray(load.tokens_per_expert), [3, 2, 1, 0])
    assert float(load.imbalance) == pytest.approx(3 / 1.5)


@pytest.mark.parametrize("E,k,L", [(8, 2, 3), (6, 3, 2), (16, 1, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_transformers(rng, E, k, L, masked):
    B, T = 3, 7
    layers = [(2.0 * rng.standard_normal((B * T, E))).astype(np.float32) for _ in range(L)]
    mask = (rng.uniform(size=(B, T)) > 0.3).astype(np.int64) if masked else None
    ref = hf.load_balancing_loss_func(tuple(to_torch(g) for g in layers), E, k,
                                      None if mask is None else to_torch(mask)).item()
    # aux counts top-k choices: the data must have no near tie, or a rounding could move a token between experts
    assert min(topk_margin(g, k) for g in layers) > 1e-4, "the test data has a near tie in its top-k"
    terms = 2 * E + L * B * T  # a softmax over E, a mean over the tokens, a sum over E
    for form in (layers, np.stack(layers), np.concatenate(layers)):
        aux = moe.load_balancing_loss(form, E, k, attention_mask=mask)
        assert_close(aux, ref, terms=terms, name="aux")
    assert_close(jax.jit(moe.load_balancing_loss, static_argnums=(1, 2))(layers, E, k), hf.load_balancing_loss_func(
        tuple(to_torch(g) for g in layers), E, k).item(), terms=terms, name="aux under jit")


def test_aux_loss_uniform_and_collapsed():
    """transformers' f_e counts tokens (Σ_e f_e = k) and P_e sums to 1, so aux = k whenever the counts are
    balanced (f_e = k/E) or the probabilities are uniform (P_e = 1/E), whatever top-k picks among exact ties;
    all tokens on the same k experts with probability ~1/k each gives aux = E, its maximum."""
    E, k = 8, 2
    equal = np.zeros((48, E), np.float32)  # P_e = 1/E exactly
    # balanced counts: token n prefers experts n, n+1 (mod E) by a hair, so each expert is chosen 2·6 times
    balanced = np.stack([np.roll(np.linspace(1e-3, 0, E), s) for s in range(E)] * 6).astype(np.float32)
    for name, logits in (("equal probabilities", equal), ("balanced counts", balanced)):
        aux = moe.load_balancing_loss([logits], E, k)
        ref = hf.load_balancing_loss_func((to_torch(logits),), E, k).item()
        assert_close(aux, k, terms=2 * E + 48, name=name)
        assert_close(aux, ref, terms=2 * E + 48, name=f"{name} vs transformers")
    counts = moe.expert_load(jax.lax.top_k(balanced, k)[1], E).tokens_per_expert
    np.testing.assert_array_equal(np.asarray(counts), np.full(E, 48 * k // E))  # the counts really are balanced
    collapsed = np.tile(np.array([20.0] * k + [0.0] * (E - k), np.float32), (10, 1))
    # exactly E up to the (E - k)·e^-20 ≈ 1e-8 probability left on the other experts
    assert_close(moe.load_balancing_loss([collapsed], E, k), E, terms=2 * E + 10, name="collapsed aux")


def test_aux_loss_input_checks():
    with pytest.raises(ValueError, match="empty list"):
        moe.load_balancing_loss([], 4, 2)
    with pytest.raises(ValueError, match="E = 4"):
        moe.load_balancing_loss(np.zeros((3, 5)), 4, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe.load_balancing_loss(np.zeros((3, 4)), 4, 5)
    with pytest.raises(ValueError, match="attention_mask"):
        moe.load_balancing_loss(np.zeros((6, 4)), 4, 2, attention_mask=np.ones((4,)))


def test_flops():
    f = moe.moe_flops(N=4096, H=512, E=32, k=4, I=256, capacity_factor=1.25)
    assert f["dense"] / f["sorted"] == 32 / 4
    assert f["capacity"] / f["sorted"] == pytest.approx(1.25)


# ---------------------------------------------------------------------------------------------------------
# The layer against transformers
hf_config = hf_text_config


def hf_block_from(block: moe.SparseMoeBlock, cfg) -> hf.Qwen3_5MoeSparseMoeBlock:
    ref = hf.Qwen3_5MoeSparseMoeBlock(hf_config(cfg)).eval()
    ours = dict(nnx.to_flat_state(nnx.state(block, nnx.Param)))
    theirs = dict(ref.named_parameters())
    assert sorted(".".join(map(str, k)) for k in ours) == sorted(theirs)  # same names ...
    with torch.no_grad():
        for path, v in ours.items():
            t = theirs[".".join(map(str, path))]
            assert tuple(t.shape) == tuple(v[...].shape), path  # ... and shapes
            t.copy_(to_torch(v[...]))
    return ref


@pytest.mark.parametrize("preset,impl", [("tiny", "sorted"), ("odd", "sorted"), ("tiny", "dense"), ("odd", "capacity")])
def test_block_matches_transformers(rng, preset, impl):
    cfg = qwen35.tiny() if preset == "tiny" else qwen35.tiny(**ODD)
    ex = Execution(experts=impl, capacity_factor=float(cfg.num_experts) if impl == "capacity" else None)
    block = moe.SparseMoeBlock(cfg, rngs=nnx.Rngs(1), execution=ex)
    # Larger router weights than the init so routing is decisive and uneven (some experts get more).
    block.gate.weight[...] = jnp.asarray(0.3 * rng.standard_normal(block.gate.weight.shape), jnp.float32)
    ref = hf_block_from(block, cfg)
    x = rng.standard_normal((2, 13, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        y_ref = ref(to_torch(x)).numpy()
        logits_ref = ref.gate(to_torch(x))[0].numpy()
    y, logits = nnx.jit(lambda m, x: m(x))(block, x)
    assert y.shape == x.shape and logits.shape == (26, cfg.num_experts) and logits.dtype == jnp.float32
    # both sides route on their own float32 logits: the data must have no near tie in its top-k
    H, k = cfg.hidden_size, cfg.num_experts_per_tok
    l64 = x.reshape(-1, H).astype(np.float64) @ np.asarray(block.gate.weight[...], np.float64).T
    assert topk_margin(l64, k) > 100 * route_tols(x.reshape(-1, H), block.gate.weight[...])[0], "a near tie"
    # router (H), expert gate/up (H) and down (I), the k-way combine, the shared expert (H, Is) and its gate (H)
    terms = 4 * H + cfg.moe_intermediate_size + k + cfg.shared_expert_intermediate_size
    assert_close(y, y_ref, terms=terms, name=f"{preset} {impl} y")
    assert_close(logits, logits_ref, terms=H, name="router logits")
    if impl == "sorted":  # a decode-sized batch (N·k <= E) takes the gather path: same block output
        x1 = x[:, :1]
        with torch.no_grad():
            y1_ref = ref(to_torch(x1)).numpy()
        assert_close(nnx.jit(lambda m, x: m(x))(block, x1)[0], y1_ref, terms=terms, name="decode-sized batch")


def test_block_options_and_checks():
    cfg = qwen35.tiny()
    with pytest.raises(ValueError, match="experts must be one of"):
        Execution(experts="fast")
    with pytest.raises(ValueError, match="applies to experts='capacity' or exchange='alltoall' only"):
        Execution(capacity_factor=2.0)
    block = moe.SparseMoeBlock(cfg, rngs=nnx.Rngs(0), execution=Execution(experts="capacity"))
    assert block.execution.capacity == 1.25
    with pytest.raises(ValueError, match=r"expects x \[B, T, 64\]"):
        block(jnp.zeros((3, 64)))
    bf16 = moe.SparseMoeBlock(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
    y, logits = bf16(jnp.ones((1, 3, 64), jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
    no_shared = moe.SparseMoeBlock(cfg.replace(shared_expert_intermediate_size=0), rngs=nnx.Rngs(0))
    assert no_shared.shared_expert is None and no_shared(jnp.ones((1, 2, 64)))[0].shape == (1, 2, 64)


# ---------------------------------------------------------------------------------------------------------
def test_benchmark_smoke(tmp_path, monkeypatch, capsys):
    """benchmarks/moe.py main runs on tiny shapes and prints its table (no timing assertions)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"
    spec = importlib.util.spec_from_file_location("bench_moe", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--quick", "--tokens", "32", "--repeats", "1", "--no-save"])
    out = capsys.readouterr().out
    assert "dense (one-hot)" in out and "grouped_swiglu ragged_dot" in out
    assert {r["name"] for r in result["rows"]} >= {"dense (one-hot)", "sorted + tiles", "sorted + ragged_dot"}
    assert result["rows"][0]["speedup_vs_dense"] == 1.0
