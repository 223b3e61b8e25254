"""One kernel benchmark case, shared by `kernels_vs_xla.py` and `kernels_gdn.py`: `applies()` says whether it runs here
and why not; `run()` builds the inputs, times the Pallas kernel and its XLA reference in the same process (jitted,
after a warm-up, median of `repeats`), checks that they agree (`tol`, on max |Δ| / max |ref| of every output)
and returns a row with both times, their ratio, FLOPs and bytes from napkin math, and the roofline fraction."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qwen35.bench import log, timeit
from qwen35.roofline import device_roofline

__all__ = ["Case", "log_backend"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark: `build()` returns (kernel_fn or None, reference_fn, args, flops, bytes)."""

    name: str
    kernel: str  # which kernel, e.g. "ragged_paged_attention", "grouped_swiglu", "paged_gdn_decode"
    size: str  # "realistic" (accelerators) | "correctness" (CPU)
    build: Callable[[], tuple[Callable | None, Callable, tuple, float, float]]
    min_devices: int = 1
    tol: float = 2e-2  # agreement required between kernel and reference: max |Δ| / max |ref| over each output

    def applies(self, backend: str | None = None, n_devices: int | None = None) -> tuple[bool, str]:
        backend = backend or jax.default_backend()
        n_devices = jax.device_count() if n_devices is None else n_devices
        if n_devices < self.min_devices:
            return False, f"needs {self.min_devices} devices, have {n_devices}"
        if self.size == "realistic" and backend == "cpu":
            return False, "realistic sizes run on an accelerator; on CPU only the correctness sizes run"
        if self.size == "correctness" and backend != "cpu":
            return False, "correctness size: for CPU runs"
        return True, ""

    def run(self, repeats: int = 5) -> dict[str, Any]:
        kernel_fn, ref_fn, args, flops, nbytes = self.build()
        backend = jax.default_backend()
        if backend not in ("tpu", "cpu"):  # Mosaic-TPU kernels: compiled on a TPU, interpreted on a CPU
            kernel_fn = None
        row: dict[str, Any] = {"name": self.name, "kernel": self.kernel, "size": self.size, "flops": flops,
                               "bytes": nbytes}
        t_ref = timeit(lambda: ref_fn(*args), repeats=repeats)["median"]
        row["reference_s"] = t_ref
        if kernel_fn is None:
            row["kernel_s"] = None
            row["note"] = "Mosaic-TPU kernel: does not compile for this backend; reference timed only"
        else:
            row["kernel_s"] = timeit(lambda: kernel_fn(*args), repeats=repeats)["median"]
            row["note"] = ("TPU interpret mode on CPU: a simulator, not kernel speed" if backend == "cpu" else "")
            row["max_rel_err"] = _max_rel_err(kernel_fn(*args), ref_fn(*args))
            if not row["max_rel_err"] <= self.tol:
                raise AssertionError(f"{self.name}: kernel and reference disagree (max |Δ| / max |ref| = "
                                     f"{row['max_rel_err']:.2e} > {self.tol})")
        peak_f, peak_b, source = device_roofline()
        row["roofline_source"] = source
        t = row["kernel_s"] if row["kernel_s"] is not None else t_ref
        row["speedup_vs_reference"] = None if row["kernel_s"] is None else t_ref / row["kernel_s"]
        row["achieved_flops"] = flops / t
        row["achieved_bytes_per_s"] = nbytes / t
        # The roofline time is the larger of compute and memory time; the fraction says how close we are to it.
        row["roofline_fraction"] = max(flops / peak_f, nbytes / peak_b) / t
        row["bound"] = "compute" if flops / peak_f > nbytes / peak_b else "memory"
        return row


def _max_rel_err(out, ref) -> float:
    errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                  max(float(jnp.max(jnp.abs(b.astype(jnp.float32)))), 1e-30))
            for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True)]
    return max(errs)


def log_backend() -> str:
    """Log which backend runs and what its timings mean; returns the backend's name."""
    backend = jax.default_backend()
    log(f"backend {backend}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    if backend == "cpu":
        log("CPU: correctness-size cases only; the kernels run in TPU interpret mode (a simulator), so their "
            "times say nothing about kernel speed. Run on a TPU for the realistic sizes.")
    elif backend != "tpu":
        log(f"{backend}: the Mosaic-TPU kernels do not compile here; timing the XLA references at realistic sizes.")
    return backend
