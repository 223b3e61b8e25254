"""Pallas kernels, each beside its pure-JAX reference. Installed as `qwen35.kernels` (never as a top-level
`kernels`, a name owned by Hugging Face's `kernels` package, which transformers probes for)."""
