"""How the model runs: one frozen value, chosen once, read by one dispatch function per operation.

The config says what the model computes (its sizes and math); an `Execution` says how: which kernels, which expert
path, whether the experts' activations are FP8 too (W8A8), and on a device mesh the mesh, its rules table and the
MoE's token exchange. It is given to the model when it is built (`Qwen35ForCausalLM(config, execution=...)`,
`load_hf_checkpoint(path, execution=...)`) and when it is placed (`qwen35.sharding.shard_model(model, mesh)` builds the placed model with
the same value, or the one given as `execution=`, plus the mesh); the serving engine reads the model's.

Four words choose an implementation in the whole package, all of them fields of this value:

    kernels   "xla" (pure JAX) | "pallas" (the kernels of `qwen35.kernels`; interpreted on a CPU)
    experts   the MoE's expert path: "sorted" (dropless, sorted by expert) | "dense" (every expert on every token,
              masked) | "capacity" (fixed slots per expert; drops past `capacity_factor`)
    exchange  on a mesh with an expert axis, how tokens meet their experts: "allgather" (all-gather +
              reduce-scatter, exact) | "ragged" (a dropless ragged all-to-all, exact) | "alltoall" (fixed-capacity
              all-to-all, drops past `capacity_factor`)
    w8a8      False | True: FP8 activations times the FP8 experts (needs experts stored in FP8)

Each operation reads it in one place: attention (`GatedAttention.attend`), the chunked and the single-step GDN
(`GatedDeltaNet.__call__`), the grouped SwiGLU (`SparseMoeBlock.routed`) and the MoE exchange
(`qwen35.sharding.moe_on_mesh`). The value is hashable and part of every module's static structure,
so jitted programs are built per execution.
"""

from __future__ import annotations

import dataclasses
from typing import Any

KERNELS = ("xla", "pallas")
EXPERTS = ("sorted", "dense", "capacity")
EXCHANGES = ("allgather", "ragged", "alltoall")
DEFAULT_CAPACITY_FACTOR = 1.25

__all__ = ["Execution", "KERNELS", "EXPERTS", "EXCHANGES", "DEFAULT_CAPACITY_FACTOR"]


@dataclasses.dataclass(frozen=True)
class Execution:
    """How the model runs (see the module docstring for the four words and their values).

    capacity_factor: the slots per expert as a multiple of the average load, for `experts="capacity"` and
      `exchange="alltoall"` (default 1.25; `num_experts / top_k` guarantees no drops).
    moe_chunks: the MoE exchange in this many pieces of the tokens (overlapping one piece's transfer with the
      previous piece's experts).
    mesh, rules: where a placed model lives (`shard_model` sets them; None on one device). `rules` is the logical
      rules table (`qwen35.sharding.LOGICAL_RULES` or `rules_with(...)`), kept as a hashable tuple of items.
    """

    kernels: str = "xla"
    experts: str = "sorted"
    exchange: str = "allgather"
    w8a8: bool = False
    capacity_factor: float | None = None
    moe_chunks: int = 1
    mesh: Any = None
    rules: tuple | None = None

    def __post_init__(self):
        def bad(word, value, allowed):
            raise ValueError(f"Execution({word}={value!r}): {word} must be one of {allowed}")

        if self.kernels not in KERNELS:
            bad("kernels", self.kernels, KERNELS)
        if self.experts not in EXPERTS:
            bad("experts", self.experts, EXPERTS)
        if self.exchange not in EXCHANGES:
            bad("exchange", self.exchange, EXCHANGES)
        if not isinstance(self.w8a8, bool):
            raise ValueError(f"Execution(w8a8={self.w8a8!r}): w8a8 is True or False")
        if self.w8a8 and self.experts == "capacity":
            raise ValueError("Execution(w8a8=True) runs with experts 'sorted' or 'dense', not 'capacity'")
        if self.w8a8 and self.exchange == "alltoall":
            raise ValueError("Execution(w8a8=True) runs with the exact exchanges; use exchange='allgather' or "
                             "'ragged'")
        drops = self.experts == "capacity" or self.exchange == "alltoall"
        if self.capacity_factor is not None:
            if not drops:
                raise ValueError(f"Execution(capacity_factor={self.capacity_factor}) applies to experts='capacity' "
                                 f"or exchange='alltoall' only (the others drop nothing)")
            if not self.capacity_factor > 0:
                raise ValueError(f"Execution(capacity_factor={self.capacity_factor}) must be > 0")
        if not isinstance(self.moe_chunks, int) or self.moe_chunks < 1:
            raise ValueError(f"Execution(moe_chunks={self.moe_chunks!r}) must be an integer >= 1")

    @property
    def capacity(self) -> float:
        """The capacity factor the dropping paths run with."""
        return DEFAULT_CAPACITY_FACTOR if self.capacity_factor is None else self.capacity_factor

    def replace(self, **changes) -> "Execution":
        """A copy with `changes` (checked like a new value)."""
        return dataclasses.replace(self, **changes)

    @property
    def pallas(self) -> bool:
        """Whether the kernels are the Pallas ones."""
        return self.kernels == "pallas"
