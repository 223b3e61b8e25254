"""Shared by the Pallas kernel tests: TPU interpret mode with race detection, the race flag, and a clean
interpreter state around every test (import the fixture into a test module to use it there)."""

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc  # the race flag lives here (private)

RACES = pltpu.InterpretParams(detect_races=True)


def races_found() -> bool:
    """The interpreter's race flag (a race is printed, not raised, so tests must look here). A jitted call returns
    before its kernels have run (async dispatch), so first wait for every callback in flight: read too early, the
    flag is still None (no kernel started) and a racy kernel would pass."""
    jax.effects_barrier()
    assert _ipc.races is not None, "no kernel ran in TPU interpret mode with detect_races since the last reset"
    return bool(_ipc.races.races_found)


@pytest.fixture(autouse=True)
def clean_interpreter():
    jax.effects_barrier()
    pltpu.reset_tpu_interpret_mode_state()
    yield
    # Wait for the test's kernels first: resetting the shared state under a kernel still running (async dispatch)
    # fails its callbacks and can leave the simulated devices waiting at a barrier forever (a hung worker).
    jax.effects_barrier()
    pltpu.reset_tpu_interpret_mode_state()  # also after an exception inside an interpreted kernel
