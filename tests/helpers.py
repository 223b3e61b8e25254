"""Shared test helpers (import as `from helpers import ...`; tests/ is on sys.path under pytest)."""

import numpy as np


def assert_close(actual, expected, *, atol, rtol=0.0, name="value"):
    """np.testing.assert_allclose with the max abs error in the message."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    err = float(np.max(np.abs(a - e))) if a.size else 0.0
    np.testing.assert_allclose(a, e, atol=atol, rtol=rtol, err_msg=f"{name}: max abs err {err:.3g}")


def to_torch(x):
    import torch

    return torch.from_numpy(np.array(x, copy=True))
