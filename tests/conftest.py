"""Test setup: 8 fake CPU devices (configured before jax starts its backend) and fp32-exact matmuls."""

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
