"""Shared by the Pallas kernel tests: TPU interpret mode with race detection, the race flag, and a clean
interpreter state around every test (import the fixture into a test module to use it there)."""

import pytest
from jax.experimental.pallas import tpu as pltpu
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _ipc  # the race flag lives here (private)

RACES = pltpu.InterpretParams(detect_races=True)


def races_found() -> bool:
    """The interpreter's race flag (a race is printed, not raised, so tests must look here)."""
    return _ipc.races is not None and bool(_ipc.races.races_found)


@pytest.fixture(autouse=True)
def clean_interpreter():
    pltpu.reset_tpu_interpret_mode_state()
    yield
    pltpu.reset_tpu_interpret_mode_state()  # also after an exception inside an interpreted kernel
