"""The greedy-token comparison accepts a near tie and nothing else (tests/helpers.py)."""

import numpy as np
import pytest
from helpers import assert_no_near_tie, assert_same_greedy, near_tie_tol


def test_same_greedy_accepts_only_a_near_tie():
    logits = np.zeros((3, 5))
    logits[:, 2] = 4.0
    tol = near_tie_tol(logits[1], terms=1000)
    logits[1, 3] = 4.0 - tol / 2  # step 1: token 3 is a near tie with token 2
    want = [2, 2, 2]
    assert assert_same_greedy([2, 2, 2], want, logits, 1000) == 3
    assert assert_same_greedy([2, 3, 0], want, logits, 1000) == 1  # diverged at the tie: the rest is not compared
    with pytest.raises(AssertionError, match="step 0 chose 3"):
        assert_same_greedy([3, 2, 2], want, logits, 1000)  # no tie at step 0
    with pytest.raises(AssertionError, match="step 1 chose 4"):
        assert_same_greedy([2, 4, 2], want, logits, 1000)  # at the tie, only the runner-up is accepted
    with pytest.raises(AssertionError, match="near tie"):
        assert_no_near_tie(logits, 1000)
    assert_no_near_tie(logits[[0, 2]], 1000)
