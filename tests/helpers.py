"""Shared test helpers (import as `from helpers import ...`; tests/ is on sys.path under pytest).

The float32 comparison rule (fp32_tol, assert_close and the block's reduction lengths) lives in qwen35.numerics,
where the notebooks use it too; it is re-exported here. This file adds the test-only checks: top-k choices under
ties, and greedy tokens under near ties.
"""

import numpy as np

from qwen35.numerics import (  # noqa: F401 (re-exported for the tests)
    BF16_EPS,
    F32_EPS,
    ULPS,
    assert_close,
    attention_terms,
    fp32_tol,
    gdn_terms,
    model_terms,
    moe_terms,
    rule_terms,
    topk_margin,
)


def assert_topk_consistent(experts, weights, logits, logit_tol, weight_tol, *, name="top-k"):
    """experts [N, k] and weights [N, k] are a correct softmax top-k of the reference logits [N, E] (float64),
    whatever order exact or near ties were broken in. Ties are judged on the logits, where rounding errors have
    one scale (`logit_tol`): every chosen expert's logit is within logit_tol of the k-th largest or above it, the
    k choices are distinct and in descending order (within logit_tol), and the weights are the chosen experts'
    softmax renormalised over the k (within weight_tol)."""
    experts, logits = np.asarray(experts), np.asarray(logits, np.float64)
    N, k = experts.shape
    kth = -np.sort(-logits, axis=-1)[:, k - 1]
    chosen = np.take_along_axis(logits, experts, axis=-1)
    assert all(len(set(row)) == k for row in experts.tolist()), f"{name}: an expert chosen twice"
    worst = float(np.max(kth - chosen.min(-1)))
    assert worst <= logit_tol, f"{name}: a choice below the k-th largest logit by {worst:.3g} > {logit_tol:.3g}"
    if k > 1:
        climb = float(np.max(np.diff(chosen, axis=-1)))
        assert climb <= logit_tol, f"{name}: choices not in descending order (a rise of {climb:.3g})"
    w = np.exp(chosen - chosen.max(-1, keepdims=True))
    assert_close(weights, w / w.sum(-1, keepdims=True), atol=weight_tol, name=f"{name} weights")


def to_torch(x):
    import torch

    return torch.from_numpy(np.array(x, copy=True))


def greedy_step_logits(model, prompt, tokens, bucket=64):
    """The logits each greedy token was chosen from, by one forward pass over prompt + tokens (teacher forcing):
    row j is the model's distribution after prompt + tokens[:j]. float64 [len(tokens), V]. The ids are padded to a
    multiple of `bucket` (the model is causal, so padding after them changes none of these rows) to share compiles."""
    prompt, tokens = np.asarray(prompt).reshape(-1), np.asarray(tokens).reshape(-1)
    ids = np.concatenate([prompt, tokens])
    ids = np.pad(ids, (0, -len(ids) % bucket))
    logits, _ = model(ids[None].astype(np.int32))
    T = len(prompt)
    return np.asarray(logits[0, T - 1:T - 1 + len(tokens)], np.float64)


def near_tie_tol(step_logits, terms):
    """Two correct float32 evaluations of one step's logits may each err by fp32_tol(scale, terms), so they may
    order two tokens whose logits lie within twice that either way."""
    return 2 * fp32_tol(float(np.max(np.abs(step_logits))), terms)


def assert_same_greedy(actual, expected, logits, terms, *, name="greedy tokens"):
    """Greedy tokens `actual` are the reference's `expected` (chosen from `logits` [>= len(actual), V], see
    greedy_step_logits), up to one near tie: at the first step where they differ, the reference must rate the
    actual token within near_tie_tol of its own choice (a tie that another CPU's rounding may order the other
    way); after it the two continue from different prefixes and are not compared. Any other difference fails.
    Returns the number of leading steps that matched."""
    actual, expected = [int(t) for t in np.asarray(actual).reshape(-1)], np.asarray(expected).reshape(-1)
    assert len(actual) <= len(expected), f"{name}: {len(actual)} tokens, the reference has {len(expected)}"
    for j, tok in enumerate(actual):
        if tok == expected[j]:
            continue
        gap = float(logits[j, expected[j]] - logits[j, tok])
        tol = near_tie_tol(logits[j], terms)
        assert gap <= tol, (f"{name}: step {j} chose {tok}, the reference {int(expected[j])}, whose logit is higher "
                            f"by {gap:.3g} > the near-tie bound {tol:.3g}; tokens {actual} vs {expected.tolist()}")
        return j
    return len(actual)


def assert_no_near_tie(logits, terms, *, name="reference"):
    """The test data has no near tie at these greedy steps (logits [n, V]): the top-2 gap of every step exceeds
    near_tie_tol, so an exact token comparison over them holds on any CPU. A guard on fixed test data (it fails
    the same way everywhere if a seed change lands on a tie), not on the code under test."""
    logits = np.asarray(logits, np.float64)
    top2 = -np.sort(-logits, axis=-1)[:, :2]
    for j, (row, (a, b)) in enumerate(zip(logits, top2)):
        tol = near_tie_tol(row, terms)
        assert a - b > tol, f"{name}: step {j}'s top-2 logits are a near tie ({a - b:.3g} <= {tol:.3g}); reseed"
