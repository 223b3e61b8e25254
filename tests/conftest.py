"""Test setup: 8 fake CPU devices (configured before jax starts its backend) and fp32-exact matmuls."""

import ctypes
import gc
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


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
