"""Small helpers shared by notebooks, benchmarks and the CLI."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def repo_root() -> Path | None:
    """The checkout this package was imported from (editable install / notebooks), or None for a wheel install."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").exists() and (here / "notebooks").is_dir() else None


def figures_dir() -> Path:
    """Where notebooks and benchmarks save figures: the repo's `figures/`, else `./figures`."""
    root = repo_root()
    d = (root / "figures") if root is not None else Path.cwd() / "figures"
    d.mkdir(parents=True, exist_ok=True)
    return d


def results_dir() -> Path:
    """Where benchmarks write JSON: the repo's `results/` (git-ignored), else `./results`."""
    root = repo_root()
    d = (root / "results") if root is not None else Path.cwd() / "results"
    d.mkdir(parents=True, exist_ok=True)
    return d


def env_summary() -> str:
    """One block describing the software and devices, for the first cell of every notebook."""
    import flax
    import jax
    import numpy as np

    import qwen35

    devs = jax.devices()
    lines = [
        f"python {platform.python_version()} | jax {jax.__version__} | flax {flax.__version__} | "
        f"numpy {np.__version__} | qwen35 {qwen35.__version__}",
        f"backend: {jax.default_backend()} | {len(devs)} device(s): {devs[0].device_kind}",
        f"cpu cores: {os.cpu_count()}",
    ]
    return "\n".join(lines)
