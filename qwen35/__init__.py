"""qwen35: Qwen3.5-MoE (397B-A17B) in JAX, Flax NNX and Pallas — an educational reference implementation."""

from qwen35.config import ConfigError, Qwen35Config, qwen35_35b_a3b, qwen35_397b_a17b, tiny

__version__ = "0.1.0"

__all__ = ["ConfigError", "Qwen35Config", "qwen35_35b_a3b", "qwen35_397b_a17b", "tiny"]
