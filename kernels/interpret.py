"""TPU interpret mode's race detector, read from one place. With `pltpu.InterpretParams(detect_races=True)` the
interpreter prints a race instead of raising, and keeps its flag in a private module: `races_found` reads it, so
tests and notebooks need no import from `jax._src` (if jax moves the flag, only this file changes)."""

from __future__ import annotations

import jax


def races_found() -> bool:
    """Whether a kernel run in TPU interpret mode with `detect_races=True` since the last
    `pltpu.reset_tpu_interpret_mode_state()` raced. A jitted call returns before its kernels have run (async
    dispatch), so this first waits for every callback in flight: read too early, the flag is still unset (no
    kernel started) and a racy kernel would pass."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # private: where the flag lives

    jax.effects_barrier()
    assert ipc.races is not None, "no kernel ran in TPU interpret mode with detect_races since the last reset"
    return bool(ipc.races.races_found)
