"""Per-layer divergence between this model and transformers' `Qwen3_5MoeForCausalLM`.

When logits disagree, the question is *where* the two models part ways. Both produce one hidden state per layer;
compare them in order and the first layer whose difference jumps is the one with the bug (differences from
float rounding grow smoothly, layer by layer).

    theirs = hf_hidden_states(hf_model, ids)                 # L + 1 arrays [B, T, H]
    ours = model.forward_with_details(ids)                   # ModelOutput, .hidden_states has L + 1 entries
    report = divergence_report(ours, theirs, atol=1e-4)
    assert report.ok, str(report)

Convention (aligned here): entry 0 is the embedding output and entry i + 1 is decoder layer i's output, all
*before* the final norm — what `ModelOutput.hidden_states` holds. transformers' `output_hidden_states=True`
returns L + 1 entries too, but its last one has `model.norm` applied (it is the model's `last_hidden_state`);
`hf_hidden_states` replaces it with the last layer's raw output, captured by a forward hook on `model.norm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["hf_text_config", "hf_hidden_states", "divergence_report", "Report", "LayerDiff"]


def hf_text_config(cfg, attn_implementation: str = "eager"):
    """transformers' `Qwen3_5MoeTextConfig` for a `Qwen35Config` (needs the `parity` extra)."""
    import transformers

    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    c = transformers.Qwen3_5MoeTextConfig(**d)
    c._attn_implementation = attn_implementation
    return c


def hf_hidden_states(hf_model, input_ids) -> list[np.ndarray]:
    """Run a transformers causal LM on `input_ids` ([B, T] ints: numpy, list, jax or torch) and return its
    L + 1 hidden states as float32 numpy arrays, all before the final norm (see the module docstring)."""
    import torch

    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.from_numpy(np.asarray(input_ids, np.int64))
    captured = {}
    norm = hf_model.model.norm
    handle = norm.register_forward_hook(lambda mod, args, out: captured.setdefault("pre_norm", args[0].detach()))
    try:
        with torch.no_grad():
            out = hf_model(ids, output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    hs = [h.detach().float().numpy() for h in out.hidden_states]
    if "pre_norm" in captured:
        hs[-1] = captured["pre_norm"].float().numpy()
    return hs


@dataclass(frozen=True)
class LayerDiff:
    name: str
    max_abs: float
    ref_max_abs: float  # scale of the reference values, to read the error against


@dataclass(frozen=True)
class Report:
    """Per-entry max |ours - theirs| and the first entry beyond `atol` (None when all are within)."""

    rows: tuple[LayerDiff, ...]
    atol: float
    first_divergent: int | None
    logits_max_abs: float | None = None

    @property
    def ok(self) -> bool:
        return self.first_divergent is None and (self.logits_max_abs is None or self.logits_max_abs <= self.atol)

    @property
    def max_abs(self) -> np.ndarray:
        return np.array([r.max_abs for r in self.rows])

    def __str__(self) -> str:
        if self.first_divergent is None:
            head = f"all {len(self.rows)} hidden states within atol={self.atol:g}"
        else:
            head = (f"first divergence beyond atol={self.atol:g} at {self.rows[self.first_divergent].name} "
                    f"(entry {self.first_divergent})")
        lines = [head, f"{'entry':>5}  {'hidden state':<28} {'max|diff|':>10}  {'max|ref|':>9}"]
        for i, r in enumerate(self.rows):
            flag = "  <-- first beyond atol" if i == self.first_divergent else ""
            lines.append(f"{i:>5}  {r.name:<28} {r.max_abs:>10.3e}  {r.ref_max_abs:>9.3g}{flag}")
        if self.logits_max_abs is not None:
            lines.append(f"{'':>5}  {'logits':<28} {self.logits_max_abs:>10.3e}")
        return "\n".join(lines)


def divergence_report(ours: Any, theirs: Sequence, *, atol: float, layer_types: Sequence[str] | None = None,
                      logits: tuple | None = None) -> Report:
    """Compare hidden states in order; name the first beyond `atol`.

    ours: a `ModelOutput` (its `hidden_states`) or a sequence of L + 1 arrays; theirs: a sequence of L + 1
    arrays (e.g. `hf_hidden_states`). `layer_types` (e.g. `config.layer_types`) labels the rows
    GDN / attention. `logits=(ours, theirs)` adds a logits row, counted by `ok`.
    """
    hs = getattr(ours, "hidden_states", ours)
    hs = [np.asarray(h, np.float32) for h in hs]
    ref = [np.asarray(h.detach().float().numpy() if type(h).__module__.startswith("torch") else h, np.float32)
           for h in theirs]
    if len(hs) != len(ref):
        raise ValueError(f"ours has {len(hs)} hidden states, theirs {len(ref)}: both should be L + 1 "
                         f"(embeddings, then every layer)")
    rows, first = [], None
    for i, (a, b) in enumerate(zip(hs, ref)):
        if a.shape != b.shape:
            raise ValueError(f"hidden state {i}: shape {a.shape} vs {b.shape}")
        if i == 0:
            name = "embeddings"
        else:
            kind = "" if layer_types is None else f" ({'GDN' if layer_types[i - 1] == 'linear_attention' else 'attention'})"
            name = f"layer {i - 1}{kind}"
        d = float(np.max(np.abs(a - b))) if a.size else 0.0
        if not np.isfinite(d):
            d = float("inf")
        rows.append(LayerDiff(name, d, float(np.max(np.abs(b))) if b.size else 0.0))
        if first is None and d > atol:
            first = i
    lg = None
    if logits is not None:
        la, lb = (np.asarray(x, np.float32) for x in logits)
        lg = float(np.max(np.abs(la - lb)))
    return Report(tuple(rows), float(atol), first, lg)
