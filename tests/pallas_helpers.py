"""Shared by the Pallas kernel tests: TPU interpret mode with race detection, the race flag, and a clean
interpreter state around every test (import the fixture into a test module to use it there)."""

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

from qwen35.kernels.interpret import races_found  # noqa: F401 (re-exported for the kernel tests)

RACES = pltpu.InterpretParams(detect_races=True)


@pytest.fixture(autouse=True)
def clean_interpreter():
    jax.effects_barrier()
    pltpu.reset_tpu_interpret_mode_state()
    yield
    # Wait for the test's kernels first: resetting the shared state under a kernel still running (async dispatch)
    # fails its callbacks and can leave the simulated devices waiting at a barrier forever (a hung worker).
    jax.effects_barrier()
    pltpu.reset_tpu_interpret_mode_state()  # also after an exception inside an interpreted kernel
