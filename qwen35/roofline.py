"""A first-principles roofline for serving a Qwen3.5-MoE model: compute the bound before measuring.

Everything here is arithmetic on named quantities, no fitted constants:

* `HARDWARE`: one `Hardware` entry per chip (peak FLOP/s by dtype, HBM bytes and bandwidth, interconnect, logical
  devices per chip), plus `measure_local()`, which builds the entry for the machine the code runs on from a
  matmul and a memory-read microbenchmark (`qwen35.bench`).
* `weight_bytes(cfg, precision)`: parameter bytes by component (`Qwen35Config.param_counts()` × bytes per
  weight; the FP8 release quantises experts, shared expert, attention q/k/v/o and GDN in_proj_qkv/z/out_proj with
  128×128 fp32 block scales and keeps the rest in bf16).
* `flops_per_token(cfg, context)`: 2 × (active parameters that take part in a matmul) + the attention term
  (4·Hq·Dh per token of context per full-attention layer) + the Gated DeltaNet state term.
* `Scenario`: a model on `chips` chips of a `Hardware`, with a `Layout` (how weights, KV and state are spread
  over the devices) and a `Precision` (bytes per weight/KV/state, which matmul peak applies).
  `decode_step`, `prefill`, `wave` (prefill then a growing-context decode) and `what_if` compute on it.

Counting conventions for tokens/s/chip (both are reported): *generated* (output tokens only, what the published
978 tokens/s/chip counts) and *input + output* (what the Ironwood post's measured figures count).

Notation: B concurrent sequences, n logical devices, E experts (k per token), S context length in tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from qwen35.config import FP8_BLOCK, ConfigError, Qwen35Config, get_preset, PRESETS

GB = 1e9
GiB = 2**30
TB = 1e12


class RooflineError(ValueError):
    """A roofline question that cannot be answered as asked; the message names the valid choices."""


# ----------------------------------------------------------------------------------------------------------
# Hardware
@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator chip. FLOP/s and bytes are per chip; a chip holds `devices_per_chip` logical devices
    (TPU v7x: 2 TensorCores, each a JAX device), which split its peak, HBM and bandwidth evenly."""

    name: str
    peak_flops: dict[str, float]  # dense matmul peak by dtype ("bf16", "fp8"; "f32" for a measured CPU)
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    interconnect_bandwidth: float | None  # bytes/s per chip (ICI / NVLink), None if not applicable
    interconnect: str
    devices_per_chip: int = 1
    measured: bool = False
    notes: str = ""

    def peak(self, dtype: str) -> float:
        """Matmul peak for `dtype`; fp8 falls back to bf16 on chips without an fp8 path (v5e, v5p, v6e)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "fp8" and "bf16" in self.peak_flops:
            return self.peak_flops["bf16"]
        if len(self.peak_flops) == 1:  # a measured machine has one figure (its float32 matmul)
            return next(iter(self.peak_flops.values()))
        raise RooflineError(f"{self.name} has no {dtype} peak; it has {sorted(self.peak_flops)}.")

    def ridge(self, dtype: str = "bf16") -> float:
        """Arithmetic intensity (FLOP/byte) where the roofline turns from memory- to compute-bound."""
        return self.peak(dtype) / self.hbm_bandwidth

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware("tpu-v7x", {"bf16": 2307 * TB, "fp8": 4614 * TB}, 192 * GiB, 7380 * GB, 1200 * GB, "ICI", 2,
                 notes="Ironwood: 2 TensorCores (JAX devices) per chip, 2 MXUs each, 2.2 GHz, plus SparseCores"),
        Hardware("tpu-v6e", {"bf16": 918 * TB}, 32 * GiB, 1638 * GB, 800 * GB, "ICI", 1, notes="Trillium"),
        Hardware("tpu-v5p", {"bf16": 459 * TB}, 95 * GiB, 2765 * GB, 1200 * GB, "ICI", 1,
                 notes="megacore: 2 TensorCores seen as one device"),
        Hardware("tpu-v5e", {"bf16": 197 * TB}, 16 * GB, 819 * GB, 400 * GB, "ICI", 1),
        Hardware("h100", {"bf16": 989 * TB, "fp8": 1979 * TB}, 80 * GB, 3350 * GB, 900 * GB, "NVLink 4", 1,
                 notes="SXM, dense (no 2:4 sparsity) peaks"),
        Hardware("h200", {"bf16": 989 * TB, "fp8": 1979 * TB}, 141 * GB, 4800 * GB, 900 * GB, "NVLink 4", 1,
                 notes="SXM, dense (no 2:4 sparsity) peaks"),
    ]
}


def measure_local(matmul_n: int = 1024, bandwidth_bytes: int = 128 * 2**20, repeats: int = 5) -> Hardware:
    """The roofline of the machine this runs on (its first JAX device, taken as one "chip" with one device),
    from `qwen35.bench.matmul_peak` (float32 n×n matmul, FLOP/s) and `qwen35.bench.memory_bandwidth` (bytes/s
    of a jitted sum: a pure stream of reads, like weight streaming in decode). Noisy on shared machines."""
    import jax

    from qwen35.bench import matmul_peak, memory_bandwidth

    peak = matmul_peak(matmul_n, repeats=repeats)
    bw = memory_bandwidth(bandwidth_bytes, repeats=repeats)
    d = jax.devices()[0]
    return Hardware(f"local-{jax.default_backend()}", {"f32": peak}, float("nan"), bw, None, "none", 1, True,
                    notes=f"measured on {d.device_kind}: f32 matmul n={matmul_n}, sum over "
                          f"{bandwidth_bytes / 2**20:.0f} MiB")


# JAX device kinds -> `HARDWARE` entries (spec-sheet peaks; per chip, split over its logical devices).
DEVICE_KINDS = {"TPU7x": "tpu-v7x", "TPU v6 lite": "tpu-v6e", "TPU v6e": "tpu-v6e", "TPU v5 lite": "tpu-v5e",
                "TPU v5e": "tpu-v5e", "TPU v5p": "tpu-v5p", "TPU v5": "tpu-v5p", "H100": "h100", "H200": "h200"}
_measured_devices: dict[str, Hardware] = {}


def device_hardware() -> Hardware:
    """The `Hardware` entry of the chip behind JAX device 0: the spec sheet for a known chip (`DEVICE_KINDS`),
    else `measure_local()` (measured once per device kind in a process)."""
    import jax

    kind = jax.devices()[0].device_kind
    for name, hw in sorted(DEVICE_KINDS.items(), key=lambda kv: -len(kv[0])):
        if name.lower() in kind.lower():
            return HARDWARE[hw]
    if kind not in _measured_devices:
        _measured_devices[kind] = measure_local(1024, 64 * 2**20, repeats=3)
    return _measured_devices[kind]


def device_roofline() -> tuple[float, float, str]:
    """(peak bf16 FLOP/s, HBM bytes/s, where the figures come from) for one JAX device (device 0), from
    `device_hardware()` with a chip's figures split over its logical devices. Used by the kernel benchmarks to
    place achieved rates against the roofline."""
    h = device_hardware()
    if h.measured:
        return h.peak("f32"), h.hbm_bandwidth, "measured here (fp32 matmul, read bandwidth)"
    n = h.devices_per_chip
    return h.peak("bf16") / n, h.hbm_bandwidth / n, f"spec sheet ({h.name}, qwen35.roofline)"


def get_hardware(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    try:
        return HARDWARE[name]
    except KeyError:
        raise RooflineError(f"unknown hardware {name!r}; choose one of {sorted(HARDWARE)}.") from None


def get_model(name: str | Qwen35Config) -> Qwen35Config:
    if isinstance(name, Qwen35Config):
        return name
    try:
        return get_preset(name)
    except ConfigError:
        raise RooflineError(f"unknown model {name!r}; choose one of {sorted(PRESETS)}.") from None


# ----------------------------------------------------------------------------------------------------------
# Precision and layout
@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state, and which matmul peak applies to which weights.

    `quantized_*` covers the weights the FP8 release quantises (routed and shared experts, attention q/k/v/o, GDN
    in_proj_qkv/z/out_proj); `other_*` the rest (lm_head, router, GDN in_proj_a/b, conv, norms, gates)."""

    name: str
    quantized_weight_bytes: float
    other_weight_bytes: float
    kv_bytes: int
    state_bytes: int  # GDN recurrent state (and conv state)
    quantized_matmul: str  # peak used for matmuls with quantised weights
    other_matmul: str  # peak used for everything else (bf16 matmuls, attention and GDN cores)


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in [
        # fp8 weights + one fp32 scale per 128×128 block; bf16 KV; bf16 GDN state (the Ironwood post's assumptions).
        # The fp8 matmul peak needs both operands in FP8: the activations quantised too (W8A8, 512-wide scales,
        # `grouped_swiglu(w8a8=True)`); "fp8-w8a16" keeps bf16 activations (the same bytes, the bf16 peak).
        Precision("fp8", 1 + 4 / FP8_BLOCK**2, 2, 2, 2, "fp8", "bf16"),
        Precision("fp8-w8a16", 1 + 4 / FP8_BLOCK**2, 2, 2, 2, "bf16", "bf16"),
        Precision("bf16", 2, 2, 2, 2, "bf16", "bf16"),
        Precision("f32", 4, 4, 4, 4, "f32", "f32"),  # the CPU reference model
    ]
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one model instance is spread over n logical devices.

    attention: "dp" — each device runs whole sequences (B/n of them) with its own copy of the attention/GDN
        weights and its sequences' whole KV cache and GDN state; "tp" — every device sees all B sequences and
        holds 1/n of the heads (KV heads replicated when n > Hkv, so each device keeps max(1/Hkv, 1/n) of the KV).
    dense_replicated: whether the dense weights (attention, GDN, shared expert, router, norms, lm_head) are read
        in full by every device (True under DP) or split n ways (an idealised "pooled" read).
    experts: "all" — every local expert (E/n per device, expert parallel) is streamed every step; "touched" —
        only those the step's B·k routed slots select (expected E/n · (1 − (1 − k/E)^B)).
    """

    name: str
    attention: str = "dp"
    dense_replicated: bool = True
    experts: str = "all"
    description: str = ""

    def __post_init__(self):
        if self.attention not in ("dp", "tp"):
            raise RooflineError(f"Layout.attention must be 'dp' or 'tp', got {self.attention!r}.")
        if self.experts not in ("all", "touched"):
            raise RooflineError(f"Layout.experts must be 'all' or 'touched', got {self.experts!r}.")


LAYOUTS: dict[str, Layout] = {
    l.name: l
    for l in [
        Layout("playbook", "dp", True, "all",
               "attention DP (dense weights replicated on every device), EP over all devices, every local expert "
               "streamed every step"),
        Layout("playbook-touched", "dp", True, "touched",
               "as 'playbook', but only the experts the step's routed slots touch are read"),
        Layout("pooled", "dp", False, "all",
               "every byte read once across all devices: the chips' bandwidth pooled, no replication"),
        Layout("tp-attention", "tp", False, "all",
               "attention/GDN tensor-parallel over all devices (KV heads replicated), EP for the experts"),
    ]
}


EXCHANGES = ("overlapped", "serial", "ignored")


def get_layout(name: str | Layout) -> Layout:
    if isinstance(name, Layout):
        return name
    try:
        return LAYOUTS[name]
    except KeyError:
        raise RooflineError(f"unknown layout {name!r}; choose one of {sorted(LAYOUTS)}.") from None


def get_precision(name: str | Precision) -> Precision:
    if isinstance(name, Precision):
        return name
    try:
        return PRECISIONS[name]
    except KeyError:
        raise RooflineError(f"unknown precision {name!r}; choose one of {sorted(PRECISIONS)}.") from None


# ----------------------------------------------------------------------------------------------------------
# The model's bytes and FLOPs
def quantized_params(cfg: Qwen35Config) -> dict[str, int]:
    """Per `param_counts()` component, how many of its parameters the FP8 release quantises (the rest stay bf16)."""
    H = cfg.hidden_size
    Hq, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gdn_q = cfg.num_linear_layers * (cfg.linear_conv_dim * H + 2 * cfg.linear_value_dim * H)  # in_proj_qkv, z, out
    attn_q = cfg.num_full_layers * (2 * Hq * Dh * H + 2 * Hkv * Dh * H + H * Hq * Dh)  # q(+gate), k, v, o
    pc = cfg.param_counts()["components"]
    return {
        "embed_tokens": 0, "lm_head": 0, "router": 0, "norms": 0,
        "gdn": gdn_q, "attention": attn_q,
        "shared_experts": cfg.num_hidden_layers * 3 * cfg.shared_expert_intermediate_size * H,  # not the gate
        "routed_experts": pc["routed_experts"]["total"],
    }


def weight_bytes(cfg: Qwen35Config, precision: str | Precision = "fp8", which: str = "total") -> dict[str, float]:
    """Bytes of each `param_counts()` component (`which` = "total" or "active" parameters)."""
    p = get_precision(precision)
    pc, q = cfg.param_counts()["components"], quantized_params(cfg)
    out = {}
    for name, c in pc.items():
        n = c[which]
        nq = n if name == "routed_experts" else q[name]  # routed experts are all quantised
        out[name] = nq * p.quantized_weight_bytes + (n - nq) * p.other_weight_bytes
    return out


DENSE = ("gdn", "attention", "router", "shared_experts", "norms")  # read by every token, besides lm_head


def expected_touched_experts(E: int, k: int, B: float) -> float:
    """Expected number of distinct experts B tokens select, each choosing k distinct experts of E uniformly:
    an expert is missed by one token with probability 1 − k/E, so E·(1 − (1 − k/E)^B) are touched."""
    return E * (1.0 - (1.0 - k / E) ** B)


def flops_per_token(cfg: Qwen35Config, context, *, split: bool = False):
    """FLOPs for one token at `context` tokens of attention context (a number or a numpy array).

    matmuls: 2 × every active parameter that multiplies an activation (all active parameters except the
        embedding table, which is a row lookup, and norms/conv/gate scalars counted with it: < 0.01%).
    attention: per full-attention layer, QKᵀ and PV each take 2·Hq·Dh FLOPs per context token.
    gdn: per GDN layer and value head, the recurrent step touches the Dk×Dv state 7 times per element (decay 1,
        Sᵀk 2, rank-1 update 2, Sᵀq 2). The chunked prefill does comparable work; this term is ~1% of the total.
    With `split`, returns {"quantized_matmul", "other_matmul", "attention", "gdn"} (FLOPs of each kind)."""
    pc, q = cfg.param_counts()["components"], quantized_params(cfg)
    active = {name: c["active"] for name, c in pc.items()}
    q_active = dict(q, routed_experts=active["routed_experts"])
    mm_q = 2 * sum(q_active.values())
    mm_other = 2 * (sum(active.values()) - active["embed_tokens"] - sum(q_active.values()))
    attn = cfg.num_full_layers * 4 * cfg.num_attention_heads * cfg.head_dim * np.asarray(context, dtype=float)
    gdn = cfg.num_linear_layers * 7 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    if split:
        return {"quantized_matmul": float(mm_q), "other_matmul": float(mm_other), "attention": attn, "gdn": float(gdn)}
    return mm_q + mm_other + attn + gdn


# ----------------------------------------------------------------------------------------------------------
# Scenario
@dataclasses.dataclass(frozen=True)
class Scenario:
    """A model served on `chips` chips of `hardware`, with a layout and a precision.

    page_size: KV page (block) size in tokens; a sequence's KV is read in whole pages.
    state_writeback: count writing the GDN state back after each decode step (the published model reads it once).
    prefill_chunk: tokens each device prefills per step (`max-num-batched-tokens` per core).
    exchange: how the MoE exchange's time on the interconnect (`comm_per_device`) enters a step: "overlapped"
        (it runs beside the weight stream and the matmuls: step = max(memory, compute, exchange)), "serial"
        (nothing hides it: step = max(memory, compute) + exchange) or "ignored" (the published analysis)."""

    model: Qwen35Config
    hardware: Hardware
    chips: int = 4
    layout: Layout = LAYOUTS["playbook"]
    precision: Precision = PRECISIONS["fp8"]
    page_size: int = 256
    state_writeback: bool = False
    prefill_chunk: int = 1024
    exchange: str = "overlapped"

    def __post_init__(self):
        if self.exchange not in EXCHANGES:
            raise RooflineError(f"Scenario.exchange must be one of {EXCHANGES}, got {self.exchange!r}.")

    @classmethod
    def make(cls, model="qwen35-397b-a17b", hardware="tpu-v7x", chips=4, layout="playbook", precision="fp8",
             **kw) -> Scenario:
        if not isinstance(chips, int) or chips <= 0:
            raise RooflineError(f"chips must be a positive integer, got {chips!r}.")
        return cls(get_model(model), get_hardware(hardware), chips, get_layout(layout), get_precision(precision),
                   **kw)

    def replace(self, **changes) -> Scenario:
        for key, get in (("model", get_model), ("hardware", get_hardware), ("layout", get_layout),
                         ("precision", get_precision)):
            if key in changes:
                changes[key] = get(changes[key])
        return dataclasses.replace(self, **changes)

    @property
    def devices(self) -> int:
        return self.chips * self.hardware.devices_per_chip

    @property
    def bandwidth_per_device(self) -> float:
        return self.hardware.hbm_bandwidth / self.hardware.devices_per_chip

    def peak_per_device(self, dtype: str) -> float:
        return self.hardware.peak(dtype) / self.hardware.devices_per_chip

    @property
    def interconnect_per_device(self) -> float:
        """Bytes/s one device sends over the chips' interconnect: the chip's figure split over its devices (the
        two devices of a v7x chip are counted as if they too talked over ICI: a conservative bound)."""
        bw = self.hardware.interconnect_bandwidth
        return float("inf") if bw is None else bw / self.hardware.devices_per_chip

    def comm_per_device(self, tokens) -> dict[str, Any]:
        """Bytes one device sends in one step over `tokens` tokens (all devices together; an array works), summed
        over the model's layers, and their time on the interconnect.

        DP attention (the post's layout): every MoE layer all-gathers the step's tokens and their packed routing
        and reduce-scatters the experts' outputs (`qwen35.sharding.moe_comm_bytes(..., "allgather")`, which is
        linear in the tokens per device t = tokens / n). TP attention: every device holds all tokens, so each
        layer all-reduces its mixer's output and its MoE output over the n devices: 2 · 2(n−1)/n · tokens · H
        bytes. Activations travel in bf16 (f32 under the "f32" precision). One device: nothing."""
        cfg, n = self.model, self.devices
        T = np.asarray(tokens, dtype=float)
        b = self.precision.other_weight_bytes
        if n == 1:
            sent = 0.0 * T
        elif self.layout.attention == "dp":
            from qwen35.sharding import moe_comm_bytes  # lazy: the roofline needs no jax until here

            per_token = moe_comm_bytes(cfg, 1, n, "allgather", dtype_bytes=int(b))["total"]  # t = 1
            sent = cfg.num_hidden_layers * per_token * T / n
        else:
            sent = cfg.num_hidden_layers * 2 * 2 * (n - 1) / n * T * cfg.hidden_size * b
        return {"bytes": sent, "time_s": sent / self.interconnect_per_device}

    def _combine(self, t_mem, t_cmp, t_comm):
        """A phase's time from its memory, compute and exchange times (see `exchange`)."""
        if self.exchange == "overlapped":
            return np.maximum(np.maximum(t_mem, t_cmp), t_comm)
        if self.exchange == "serial":
            return np.maximum(t_mem, t_cmp) + t_comm
        return np.maximum(t_mem, t_cmp)

    # --- per-device shares ----------------------------------------------------------------------------------
    def _kv_share(self) -> float:
        """Fraction of all B sequences' KV one device holds."""
        n, Hkv = self.devices, self.model.num_key_value_heads
        return 1 / n if self.layout.attention == "dp" else max(1 / Hkv, 1 / n)

    def bytes_per_device(self, concurrency, context) -> dict[str, Any]:
        """Bytes one device reads in one decode step of `concurrency` sequences at `context` tokens each."""
        cfg, p, n = self.model, self.precision, self.devices
        wb = weight_bytes(cfg, p)
        dense_share = 1.0 if self.layout.dense_replicated else 1 / n
        E = cfg.num_experts
        touched = self.experts_read_per_device(concurrency)
        cb = cfg.cache_bytes_per_sequence(1, kv_dtype_bytes=p.kv_bytes, state_dtype_bytes=p.state_bytes)
        ctx_read = np.ceil(np.asarray(context, dtype=float) / self.page_size) * self.page_size  # whole pages
        B = np.asarray(concurrency, dtype=float)
        kv = B * self._kv_share() * cb["kv_bytes_per_token"] * ctx_read
        state_share = 1 / n  # DP: B/n whole sequences; TP: all B sequences, 1/n of the heads
        state = B * state_share * (cb["gdn_recurrent_bytes"] + cfg.num_linear_layers * cfg.linear_conv_dim
                                   * cfg.linear_conv_kernel_dim * p.state_bytes) * (2 if self.state_writeback else 1)
        rows = B / n if self.layout.attention == "dp" else B  # embedding rows gathered for this device's tokens
        out = {
            "routed_experts": wb["routed_experts"] * touched / E,
            "dense_weights": dense_share * sum(wb[c] for c in DENSE),
            "lm_head": dense_share * wb["lm_head"],
            "embedding_rows": rows * cfg.hidden_size * p.other_weight_bytes,
            "kv_cache": kv,
            "gdn_state": state,
        }
        out["total"] = sum(out.values())
        return out

    def experts_read_per_device(self, concurrency):
        """Experts one device streams per layer in a decode step: its E/n (expert parallel over all devices), or
        under "touched" the expected number of them the step's B·k routed slots select (all B tokens reach
        every device: all-gather before the local MoE)."""
        E, k, n = self.model.num_experts, self.model.num_experts_per_tok, self.devices
        if self.layout.experts == "touched":
            return expected_touched_experts(E, k, np.asarray(concurrency, dtype=float)) / n
        return E / n

    def flops_per_device(self, tokens, context) -> dict[str, Any]:
        """FLOPs one device does for `tokens` tokens (all devices' total / n: balanced DP and EP), by kind."""
        f = flops_per_token(self.model, context, split=True)
        share = np.asarray(tokens, dtype=float) / self.devices
        out = {k: v * share for k, v in f.items()}
        out["total"] = sum(out.values())
        return out

    def compute_time(self, flops: dict[str, Any]):
        p = self.precision
        return (flops["quantized_matmul"] / self.peak_per_device(p.quantized_matmul)
                + (flops["other_matmul"] + flops["attention"] + flops["gdn"]) / self.peak_per_device(p.other_matmul))

    # --- phases ---------------------------------------------------------------------------------------------
    def decode_step(self, concurrency, context) -> dict[str, Any]:
        """One decode step (one new token for each of `concurrency` sequences at `context` tokens): time = max of
        bytes per device / bandwidth per device and FLOPs per device / peak per device, with the MoE exchange's
        time on the interconnect (`comm_s`) entering as `exchange` says. Works elementwise on numpy arrays of
        concurrency or context."""
        b = self.bytes_per_device(concurrency, context)
        f = self.flops_per_device(concurrency, context)
        t_mem = b["total"] / self.bandwidth_per_device
        t_cmp = self.compute_time(f)
        comm = self.comm_per_device(concurrency)
        t = self._combine(t_mem, t_cmp, comm["time_s"])
        return {"step_s": t, "memory_s": t_mem, "compute_s": t_cmp, "comm_s": comm["time_s"],
                "comm_bytes": comm["bytes"], "bytes": b, "flops": f, "intensity": f["total"] / b["total"],
                "tokens_per_s_per_chip": np.asarray(concurrency, dtype=float) / t / self.chips}

    def speculative_decode_step(self, concurrency, context, k: int, acceptance: float) -> dict[str, Any]:
        """A speculative decode step (`Engine(speculative_tokens=k)`): one target step verifying k drafts per
        sequence, then the k MTP passes that draft the next ones. Works elementwise on arrays of concurrency.

        verify: B·(k + 1) tokens of FLOPs; bytes: the weights once (under "touched", the experts B·(k + 1) tokens
            select), each sequence's KV once, the GDN state as a plain step plus k more writes (the state after
            each draft is kept until the verification picks one).
        draft: k passes of B tokens through the MTP layer (one gated-attention + MoE layer, its weights a layer's
            share of the model's, plus fc [H, 2H]) and the lm_head, each pass max(bytes, FLOPs) with one MoE
            layer's exchange, like a step.
        tokens per sequence per step: 1 + a + a^2 + ... + a^k, each draft accepted with probability a
            (`acceptance`) when the ones before it were (Leviathan et al. 2023)."""
        cfg, p, n = self.model, self.precision, self.devices
        B = np.asarray(concurrency, dtype=float)
        K1 = k + 1
        plain = self.decode_step(concurrency, context)
        b = dict(self.bytes_per_device(B, context))
        b["routed_experts"] = self.bytes_per_device(B * K1, context)["routed_experts"]
        b["embedding_rows"] *= K1
        once = b["gdn_state"] / (2 if self.state_writeback else 1)
        b["gdn_state"] += k * once  # the state after each draft written too
        b["total"] = sum(v for key, v in b.items() if key != "total")
        f = self.flops_per_device(B * K1, context)
        t_verify = self._combine(b["total"] / self.bandwidth_per_device, self.compute_time(f),
                                 self.comm_per_device(B * K1)["time_s"])
        # one MTP pass over B tokens
        L, A, H = cfg.num_hidden_layers, cfg.num_full_layers, cfg.hidden_size
        wb, pc = weight_bytes(cfg, p), cfg.param_counts()["components"]
        dense_share = 1.0 if self.layout.dense_replicated else 1 / n
        fc = 2 * H * H
        layer_bytes = dense_share * (wb["attention"] / A + (wb["shared_experts"] + wb["router"]) / L
                                     + fc * p.other_weight_bytes + wb["lm_head"])
        experts = wb["routed_experts"] / L * self.experts_read_per_device(B) / cfg.num_experts
        kv_layer = B * self._kv_share() * 2 * cfg.num_key_value_heads * cfg.head_dim * p.kv_bytes * np.asarray(
            context, dtype=float)
        pass_bytes = layer_bytes + experts + kv_layer
        act = {name: c["active"] for name, c in pc.items()}
        per_token = 2 * (act["attention"] / A + (act["routed_experts"] + act["shared_experts"] + act["router"]) / L
                         + fc + act["lm_head"]) + 4 * cfg.num_attention_heads * cfg.head_dim * np.asarray(
            context, dtype=float)
        pass_flops = per_token * B / n
        t_pass = self._combine(pass_bytes / self.bandwidth_per_device, pass_flops / self.peak_per_device("bf16"),
                               self.comm_per_device(B)["time_s"] / L)  # one MoE layer's exchange
        step = t_verify + k * t_pass
        tokens = sum(acceptance ** i for i in range(K1))
        tps = B * tokens / step / self.chips
        return {"step_s": step, "verify_s": t_verify, "draft_s": k * t_pass, "tokens_per_sequence": tokens,
                "verify_memory_s": b["total"] / self.bandwidth_per_device, "verify_compute_s": self.compute_time(f),
                "state_writes_s": k * once / self.bandwidth_per_device,  # the k extra GDN state writes in it
                "tokens_per_s_per_chip": tps, "speedup": tps / plain["tokens_per_s_per_chip"],
                "plain_step_s": plain["step_s"]}

    def prefill(self, concurrency, input_len) -> dict[str, Any]:
        """Prefill of `concurrency` prompts of `input_len` tokens, in steps of `prefill_chunk` tokens per device.

        Compute: every prompt token's FLOPs (causal attention: the token at position i attends to i+1 tokens, a
        prompt's attention total is T(T+1)/2 token-contexts). Memory: each step streams the device's weights once
        (all local experts: a chunk of ~1K tokens per device touches them all) plus the KV written.
        Time = max(compute, memory) (and the exchange as `exchange` says), summed as if the steps were uniform."""
        cfg, n = self.model, self.devices
        B, T = float(concurrency), float(input_len)
        tokens = B * T
        steps = math.ceil(tokens / (self.prefill_chunk * n))
        f = self.flops_per_device(tokens, (T + 1) / 2)  # mean context of a causal prompt
        full = self.replace(layout=dataclasses.replace(self.layout, experts="all"))
        wbytes = full.bytes_per_device(0, 0)
        weights = wbytes["routed_experts"] + wbytes["dense_weights"] + wbytes["lm_head"]
        cb = cfg.cache_bytes_per_sequence(1, kv_dtype_bytes=self.precision.kv_bytes)
        kv_written = tokens * self._kv_share() * cb["kv_bytes_per_token"]
        b_total = steps * weights + kv_written
        t_mem = b_total / self.bandwidth_per_device
        t_cmp = self.compute_time(f)
        comm = self.comm_per_device(tokens)
        t = float(self._combine(t_mem, t_cmp, comm["time_s"]))
        return {"time_s": t, "memory_s": t_mem, "compute_s": t_cmp, "comm_s": float(comm["time_s"]),
                "comm_bytes": float(comm["bytes"]), "steps": steps, "flops": f,
                "bytes": {"weights_per_step": weights, "kv_written": kv_written, "total": b_total},
                "tokens_per_s_per_chip": tokens / t / self.chips}

    def wave(self, concurrency: int, input_len: int, output_len: int) -> dict[str, Any]:
        """A workload wave: all `concurrency` prompts prefilled, then `output_len` decode steps, the s-th at context
        input_len + s + 1 (every sequence starts and ends together). Reports both tokens/s/chip conventions."""
        pre = self.prefill(concurrency, input_len)
        ctx = input_len + 1 + np.arange(output_len, dtype=float)
        steps = self.decode_step(concurrency, ctx)
        t_dec = float(np.sum(steps["step_s"]))
        avg = self.decode_step(concurrency, input_len + output_len / 2)  # the step at the average context
        total = pre["time_s"] + t_dec
        gen, inp = concurrency * output_len, concurrency * input_len
        return {
            "prefill": pre, "decode_time_s": t_dec, "decode_step_at_average_context": avg,
            "decode_memory_bound_fraction": float(np.mean(steps["memory_s"] >= steps["compute_s"])),
            "total_s": total,
            "end_to_end_tokens_per_s_per_chip": (gen + inp) / total / self.chips,
            "end_to_end_generated_tokens_per_s_per_chip": gen / total / self.chips,
        }

    def memory_per_device(self, concurrency, max_context) -> dict[str, Any]:
        """Bytes one device must hold: its weights (replicated or sharded dense, E/n experts) and the KV (at
        `max_context`, whole pages) and state of its sequences; and how many sequences would fit in its HBM."""
        full = self.replace(layout=dataclasses.replace(self.layout, experts="all"), state_writeback=False)
        w = full.bytes_per_device(0, 0)
        weights = w["routed_experts"] + w["dense_weights"] + w["lm_head"] + self.precision.other_weight_bytes * (
            self.model.param_counts()["components"]["embed_tokens"]["total"]
            * (1.0 if self.layout.dense_replicated else 1 / self.devices))
        per_seq = full.bytes_per_device(1, max_context)
        per_seq = per_seq["kv_cache"] + per_seq["gdn_state"]  # one sequence's share on this device
        hbm = self.hardware.hbm_bytes / self.hardware.devices_per_chip
        return {"weights": weights, "per_sequence": per_seq, "cache": per_seq * concurrency,
                "total": weights + per_seq * concurrency, "hbm": hbm,
                "max_concurrency": int(max(0.0, (hbm - weights) // per_seq)) if math.isfinite(hbm) else None}


# ----------------------------------------------------------------------------------------------------------
# Reports
def report(scenario: Scenario, concurrency: int, input_len: int, output_len: int) -> dict[str, Any]:
    """The flat summary the CLI prints and writes as JSON (times in ms, bytes, FLOPs, tokens/s/chip)."""
    sc = scenario
    w = sc.wave(concurrency, input_len, output_len)
    d, pre = w["decode_step_at_average_context"], w["prefill"]
    avg_ctx = input_len + output_len / 2
    mem = sc.memory_per_device(concurrency, input_len + output_len)
    fl = lambda x: {k: float(v) for k, v in x.items()}  # noqa: E731
    return {
        "model": sc.model.name, "hardware": sc.hardware.name, "chips": sc.chips, "devices": sc.devices,
        "layout": sc.layout.name, "layout_description": sc.layout.description, "precision": sc.precision.name,
        "page_size": sc.page_size,
        "concurrency": concurrency, "input_len": input_len, "output_len": output_len,
        "bandwidth_per_device": sc.bandwidth_per_device,
        "peak_flops_per_device": {k: sc.peak_per_device(k) for k in sorted({sc.precision.quantized_matmul,
                                                                             sc.precision.other_matmul})},
        "decode_context": avg_ctx,
        "decode_step_ms": float(d["step_s"]) * 1e3,
        "decode_memory_ms": float(d["memory_s"]) * 1e3,
        "decode_compute_ms": float(d["compute_s"]) * 1e3,
        "decode_bound": "memory" if d["memory_s"] >= d["compute_s"] else "compute",
        "exchange": sc.exchange,
        "interconnect_per_device": sc.interconnect_per_device,
        "decode_comm_ms": float(d["comm_s"]) * 1e3,
        "decode_comm_bytes_per_device": float(d["comm_bytes"]),
        "decode_bytes_per_device": fl(d["bytes"]),
        "decode_experts_read_per_device": float(sc.experts_read_per_device(concurrency)),
        "decode_flops_per_device": fl(d["flops"]),
        "decode_intensity_flop_per_byte": float(d["intensity"]),
        "decode_tokens_per_s_per_chip": float(d["tokens_per_s_per_chip"]),
        "prefill_ms": pre["time_s"] * 1e3,
        "prefill_memory_ms": pre["memory_s"] * 1e3,
        "prefill_compute_ms": pre["compute_s"] * 1e3,
        "prefill_comm_ms": pre["comm_s"] * 1e3,
        "prefill_flops_per_device": fl(pre["flops"]),
        "prefill_bytes_per_device": fl(pre["bytes"]),
        "prefill_tokens_per_s_per_chip": pre["tokens_per_s_per_chip"],
        "decode_total_ms": w["decode_time_s"] * 1e3,
        "wave_ms": w["total_s"] * 1e3,
        "end_to_end_tokens_per_s_per_chip": w["end_to_end_tokens_per_s_per_chip"],
        "end_to_end_generated_tokens_per_s_per_chip": w["end_to_end_generated_tokens_per_s_per_chip"],
        "memory_per_device": mem,
    }


def format_report(r: dict[str, Any]) -> str:
    b, GBf = r["decode_bytes_per_device"], 1e9
    lines = [
        f"{r['model']} on {r['chips']} x {r['hardware']} ({r['devices']} devices), layout {r['layout']}, "
        f"precision {r['precision']}, KV page {r['page_size']}",
        f"layout {r['layout']}: {r['layout_description']}",
        f"workload: concurrency {r['concurrency']}, {r['input_len']} in / {r['output_len']} out",
        f"per device: {r['bandwidth_per_device'] / 1e12:.2f} TB/s, "
        + ", ".join(f"{k} {v / 1e12:,.0f} TFLOP/s" for k, v in r["peak_flops_per_device"].items()),
        "",
        f"decode step at context {r['decode_context']:,.0f} (bytes one device reads):",
    ]
    names = {"routed_experts": "routed experts", "dense_weights": "dense weights (attn, GDN, shared, router)",
             "lm_head": "lm_head", "embedding_rows": "embedding rows", "kv_cache": "KV cache",
             "gdn_state": "GDN state (recurrent + conv)"}
    for k, label in names.items():
        lines.append(f"  {label:<44}{b[k] / GBf:9.3f} GB  {b[k] / r['bandwidth_per_device'] * 1e3:8.3f} ms")
    lines += [
        f"  {'total':<44}{b['total'] / GBf:9.3f} GB  {r['decode_memory_ms']:8.3f} ms",
        f"  FLOPs {r['decode_flops_per_device']['total'] / 1e12:.3f} TFLOP -> {r['decode_compute_ms']:.3f} ms; "
        f"intensity {r['decode_intensity_flop_per_byte']:.1f} FLOP/B; {r['decode_bound']}-bound",
        f"  MoE exchange {r['decode_comm_bytes_per_device'] / GBf:.3f} GB sent -> {r['decode_comm_ms']:.3f} ms at "
        f"{r['interconnect_per_device'] / 1e9:,.0f} GB/s per device ({r['exchange']})",
        f"  decode step {r['decode_step_ms']:.2f} ms -> {r['decode_tokens_per_s_per_chip']:,.0f} generated "
        f"tokens/s/chip",
        "",
        f"prefill: {r['prefill_ms']:.1f} ms (compute {r['prefill_compute_ms']:.1f}, memory {r['prefill_memory_ms']:.1f}, "
        f"exchange {r['prefill_comm_ms']:.1f})"
        f" -> {r['prefill_tokens_per_s_per_chip']:,.0f} input tokens/s/chip",
        f"wave: prefill {r['prefill_ms'] / 1e3:.2f} s + decode {r['decode_total_ms'] / 1e3:.2f} s = "
        f"{r['wave_ms'] / 1e3:.2f} s -> {r['end_to_end_tokens_per_s_per_chip']:,.0f} (input + output) / "
        f"{r['end_to_end_generated_tokens_per_s_per_chip']:,.0f} (generated) tokens/s/chip",
    ]
    m = r["memory_per_device"]
    lines.append(f"memory per device: weights {m['weights'] / GBf:.1f} GB + cache {m['cache'] / GBf:.1f} GB = "
                 f"{m['total'] / GBf:.1f} GB of {m['hbm'] / GBf:.1f} GB HBM; fits up to {m['max_concurrency']} "
                 f"sequences at full length")
    if m["total"] > m["hbm"]:
        lines.append("  does NOT fit in HBM: the times above are a bound for hardware that does not exist; lower "
                     "--concurrency, add --chips or use fp8 weights")
    return "\n".join(lines)


def what_if(base: Scenario, changes: dict[str, dict[str, Any]], concurrency: int, input_len: int,
            output_len: int) -> list[dict[str, Any]]:
    """One row per named change (Scenario.replace keyword arguments) next to the base: decode step, tokens/s/chip
    in both conventions, and the largest concurrency whose full-length cache fits."""
    rows = []
    for label, kw in {"base": {}, **changes}.items():
        r = report(base.replace(**kw), concurrency, input_len, output_len)
        rows.append({"change": label, "decode_step_ms": r["decode_step_ms"],
                     "decode_tokens_per_s_per_chip": r["decode_tokens_per_s_per_chip"],
                     "end_to_end_tokens_per_s_per_chip": r["end_to_end_tokens_per_s_per_chip"],
                     "max_concurrency": r["memory_per_device"]["max_concurrency"]})
    return rows


def all_params_reading(scenario: Scenario, input_len: int, output_len: int) -> float:
    """The one reading found that gives the published prefill-heavy 5,170 tokens/s/chip: every one of the model's
    parameters multiplied for every token (input and output) at the chip's fp8 peak, 2 FLOPs each, and only the
    input tokens counted: peak / (2 · P_total) · input / (input + output)."""
    P = scenario.model.param_counts()["total"]
    return scenario.hardware.peak("fp8") / (2 * P) * input_len / (input_len + output_len)


def min_chips(scenario: Scenario, concurrency: int, max_context: int, max_chips: int = 1024) -> int | None:
    """The smallest power-of-two number of chips on which every device holds its weights and the cache of its
    share of `concurrency` sequences at `max_context` tokens (None if even `max_chips` chips do not)."""
    chips = 1
    while chips <= max_chips:
        m = scenario.replace(chips=chips).memory_per_device(concurrency, max_context)
        if m["total"] <= m["hbm"]:
            return chips
        chips *= 2
    return None
