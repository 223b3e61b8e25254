"""qwen35: Qwen3.5-MoE (397B-A17B) in JAX, Flax NNX and Pallas — an educational reference implementation.

`import qwen35` is light (no jax import): the config is loaded eagerly, everything else on first use.
"""

from __future__ import annotations

import importlib

from qwen35.config import ConfigError, Qwen35Config, get_preset, qwen35_35b_a3b, qwen35_397b_a17b, tiny
from qwen35.execution import Execution

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access (PEP 562).
_LAZY = {
    "Qwen35ForCausalLM": "qwen35.model",
    "HybridCache": "qwen35.model",
    "generate": "qwen35.generation",
    "load_hf_checkpoint": "qwen35.weights",
    "save_hf_checkpoint": "qwen35.weights",
    "load_tokenizer": "qwen35.weights",
    "CheckpointError": "qwen35.weights",
    "load_trained": "qwen35.weights",
}

__all__ = ["ConfigError", "Qwen35Config", "Execution", "get_preset", "qwen35_35b_a3b", "qwen35_397b_a17b", "tiny", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qwen35' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
