"""Shared test helpers (import as `from helpers import ...`; tests/ is on sys.path under pytest).

The float32 comparison rule (fp32_tol, assert_close, the blocks' reduction lengths and the greedy-token checks
under near ties) lives in qwen35.numerics, where the notebooks use it too; it is re-exported here. This file adds
the test-only checks: top-k choices under ties, and a torch conversion.
"""

import numpy as np

from qwen35.numerics import (  # noqa: F401 (re-exported for the tests)
    BF16_EPS,
    F32_EPS,
    ULPS,
    assert_close,
    assert_no_near_tie,
    assert_same_greedy,
    attention_terms,
    fp32_tol,
    gdn_terms,
    greedy_step_logits,
    model_terms,
    moe_terms,
    near_tie_tol,
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
