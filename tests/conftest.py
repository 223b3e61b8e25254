"""Test setup: 8 fake CPU devices (configured before jax starts its backend) and fp32-exact matmuls."""

import ctypes
import gc
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU client runs computations and host callbacks on one pool of threads, sized from the core count (NPROC
# overrides it; 8 threads with 8 fake devices on a 2-core machine). A kernel in TPU interpret mode inside
# `shard_map` holds a pool thread per device in its callback, each waiting for an array that XLA computes on the
# same pool: once the kernel's operands pass ~100 KiB per device no thread was left and the run hung. 32 leave room.
os.environ.setdefault("NPROC", "32")
# One persistent compilation cache for the whole run, shared by both workers and the notebooks' kernels (they
# inherit the environment): many files build the same tiny-preset programs (an engine's step programs take a few
# seconds each to compile on CPU), and each compiles them once. A fresh directory per run (made by the first
# process, removed when it exits), so no run reads what an earlier run compiled.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache_dir = tempfile.mkdtemp(prefix="qwen35-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
# Run each CPU computation on the calling thread (before the backend starts; read once). TPU interpret mode runs a
# kernel's body through host callbacks that launch computations of their own; with asynchronous dispatch the main
# thread can queue enough eager work to take every slot of the CPU client's in-flight limit while the queued
# computations wait on a kernel whose callback waits for a slot: a deadlock (seen as a worker killed by the timeout
# in an eager W8A8 MoE block test, about one run in twenty under load).
jax.config.update("jax_cpu_enable_async_dispatch", False)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {len(jax.devices())} x {jax.devices()[0].platform}"


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """After each test file, free what jax compiled for it. Otherwise a worker keeps every executable of every file
    it ran: 4+ GB per worker by the end of the suite, against about 1.5 GB with this (the files share few shapes,
    so the suite takes no longer)."""
    yield
    import qwen35.model

    qwen35.model.clear_programs()
    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the freed heap back to the OS (glibc)
    except (OSError, AttributeError):
        pass
