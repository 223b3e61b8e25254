"""Where the kernels run, decided in one place.

`default_interpret`: a kernel called with `interpret=None` compiles with Mosaic on a TPU and runs in TPU interpret
mode anywhere else (the same kernel, executed by an interpreter on the host). `lower_for_tpu()`: inside it,
`interpret=None` means Mosaic whatever the host, so `jax.export(..., platforms=["tpu"])` of a whole program (the
serving engine's step) lowers every kernel for a TPU from a CPU machine.

`races_found`: TPU interpret mode's race detector. With `pltpu.InterpretParams(detect_races=True)` the interpreter
prints a race instead of raising, and keeps its flag in a private module: `races_found` reads it, so tests and
notebooks need no import from `jax._src` (if jax moves the flag, only this file changes).

`check_interpreter_threads`: interpreted kernels on several CPU devices need spare threads in XLA's CPU pool."""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings

import jax
from jax.experimental.pallas import tpu as pltpu

_FOR_TPU = contextvars.ContextVar("qwen35_kernels_lower_for_tpu", default=False)


def default_interpret(interpret=None):
    """`interpret` itself if given; else `False` (compile with Mosaic) on a TPU or inside `lower_for_tpu()`, TPU
    interpret mode (`pltpu.InterpretParams()`) anywhere else."""
    if interpret is not None:
        return interpret
    return False if _FOR_TPU.get() or jax.default_backend() == "tpu" else pltpu.InterpretParams()


@contextlib.contextmanager
def lower_for_tpu():
    """Kernels called with `interpret=None` inside this block lower with Mosaic, for `jax.export(...,
    platforms=["tpu"])` on a machine without a TPU (running them here would fail: Mosaic calls execute only on a
    TPU). Trace a fresh `jax.jit` inside: a jitted program traced earlier, in interpret mode, is reused from its
    cache (the kernels' own jitted functions take the mode as a static argument, so theirs are keyed by it)."""
    token = _FOR_TPU.set(True)
    try:
        yield
    finally:
        _FOR_TPU.reset(token)


def races_found() -> bool:
    """Whether a kernel run in TPU interpret mode with `detect_races=True` since the last
    `pltpu.reset_tpu_interpret_mode_state()` raced. A jitted call returns before its kernels have run (async
    dispatch), so this first waits for every callback in flight: read too early, the flag is still unset (no
    kernel started) and a racy kernel would pass."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # private: where the flag lives

    jax.effects_barrier()
    assert ipc.races is not None, "no kernel ran in TPU interpret mode with detect_races since the last reset"
    return bool(ipc.races.races_found)


def check_interpreter_threads(num_devices: int) -> None:
    """Warn when kernels will run in TPU interpret mode on `num_devices` > 1 CPU devices with XLA's CPU thread pool
    (sized from the core count, or `NPROC`, when jax starts) under twice the devices. Inside `shard_map` each
    device's kernel holds a pool thread in its host callback while it waits for an array computed on the same
    pool: with 8 fake devices on a 2-core machine a kernel whose operands pass ~100 KiB per device hung."""
    if num_devices <= 1 or default_interpret() is False or jax.default_backend() != "cpu":
        return
    threads = int(os.environ.get("NPROC") or os.cpu_count() or 1)
    if threads < 2 * num_devices:
        warnings.warn(f"Pallas kernels will run in TPU interpret mode on {num_devices} CPU devices with about "
                      f"{threads} XLA threads; they can hang once an operand passes ~100 KiB per device. Set "
                      f"NPROC={4 * num_devices} in the environment before jax starts (tests/conftest.py sets 32), "
                      f"or use backend='xla' on CPU", RuntimeWarning, stacklevel=3)
