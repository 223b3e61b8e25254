"""The package's floors, read from its sources (`qwen35.floors`: ast, nothing imported): kernels → layers → model →
execution → serving, each importing only its own floor and the floors below it.

- No import cycle among the package's modules, counting imports inside functions too (a cycle hidden behind a
  function-level import is still a cycle: each side needs the other to be understood), and no import upward.
- Every file of `kernels/` imports only jax, numpy, the standard library and other kernels: a kernel's reference
  and its shape checks live beside it, and it takes layouts as plain sizes.
- The words that choose an implementation are a known list: a new parameter with a string or boolean default must
  be classified here, so a new word is a decision, not an accident.
"""

from __future__ import annotations

import ast
import sys

from qwen35.floors import FLOORS, cycles, floor_of, import_graph, imports, modules, upward_imports

def test_the_graph_sees_the_package():
    """The walk finds the floors (so the checks below are not vacuous)."""
    graph = import_graph()
    for name in ("qwen35.kernels.delta_rule", "qwen35.kernels.grouped_matmul", "qwen35.gdn", "qwen35.moe",
                 "qwen35.model", "qwen35.serving.runner", "qwen35.sharding.exchange"):
        assert name in graph
    assert "qwen35.kernels.delta_rule" in graph["qwen35.gdn"]
    assert "qwen35.kernels.grouped_matmul" in graph["qwen35.moe"]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    detail = [f"{a} -> {b} (line {graph[a][b]})" for comp in found for a in comp for b in graph[a] if b in comp]
    assert not found, ("import cycles (function-level imports count): move the shared code down a floor\n  "
                       + "\n  ".join(detail))


def test_no_floor_imports_a_floor_above_it():
    up = upward_imports(import_graph())
    assert not up, f"imports upward ({' < '.join(FLOORS)}):\n  " + "\n  ".join(up)


def test_the_checks_find_a_cycle_and_an_upward_import():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []
    assert [floor_of(m) for m in ("qwen35.kernels.fp8", "qwen35.gdn", "qwen35.model", "qwen35.sharding.exchange",
                                  "qwen35.serving.runner", "qwen35.roofline")] == [0, 1, 2, 3, 4, 5]
    assert upward_imports({"qwen35.moe": {"qwen35.serving.cache": 7}, "qwen35.serving.cache": {}}) == [
        "qwen35.moe -> qwen35.serving.cache (line 7)"]


def test_kernels_import_only_jax_numpy_and_other_kernels():
    allowed = {"jax", "numpy", "__future__"} | set(sys.stdlib_module_names)
    bad = []
    kernel_files = {m: p for m, p in modules().items() if floor_of(m) == 0}
    assert len(kernel_files) > 8
    for module, path in kernel_files.items():
        for target, line in imports(path):
            top = target.split(".")[0]
            if top == "qwen35":
                if not (target == "qwen35.kernels" or target.startswith("qwen35.kernels.")):
                    bad.append(f"{module}:{line} imports {target}")
            elif top not in allowed:
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, "kernels are the ground floor (jax, numpy, other kernels only):\n  " + "\n  ".join(bad)


# The words that choose how an operation runs: the fields of `qwen35.execution.Execution`, and the same word wherever
# a function below it takes that choice (a kernel's `w8a8`, `default_chunk_size(kernels)`).
IMPLEMENTATION_WORDS = {
    "kernels",   # "xla" | "pallas"
    "experts",   # the MoE's expert path: "sorted" | "dense" | "capacity"
    "exchange",  # the MoE's token exchange on a mesh: "allgather" | "ragged" | "alltoall"
    "w8a8",      # FP8 activations times the FP8 experts
}
# Every other option with a string or boolean default: what it computes or reports, not how.
OTHER_OPTIONS = {
    "activation", "attention", "attn_implementation", "axis_types", "dequantize_fp8", "desc", "description",
    "dtype", "enable_chunked_prefill", "expert_layout", "fp8", "fp8_experts", "hardware",
    "hidden_act", "layer_type", "layout", "model", "mtp", "name", "normalize", "notes", "precision", "progress", "record_history",
    "return_cache", "return_logits", "return_stats", "speculative", "split", "step", "use_qk_l2norm", "verify_only",
    "which", "zero_centred",
    "fused",  # the engine's step as one program or one per layer: how many programs it compiles, not how an op runs
}


def _options() -> dict[str, set[str]]:
    """Name -> where: every public parameter with a string or boolean default (or None, typed `bool | None` or
    `str | None`), and every class field with a string default, in the package and its kernels."""
    found: dict[str, set[str]] = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pos = a.posonlyargs + a.args
                pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults))
                pairs += [(x, d) for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                for arg, d in pairs:
                    if arg.arg.startswith("_") or not isinstance(d, ast.Constant):
                        continue
                    optional = d.value is None and arg.annotation is not None and ast.unparse(arg.annotation) in (
                        "bool | None", "str | None")  # a choice whose default is "decide for me"
                    if isinstance(d.value, (str, bool)) or optional:
                        found.setdefault(arg.arg, set()).add(f"{name}.{node.name}")
            elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                  and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                found.setdefault(node.target.id, set()).add(name)
    return found


def test_no_new_word_chooses_an_implementation():
    found = _options()
    unknown = {k: sorted(v) for k, v in found.items() if k not in IMPLEMENTATION_WORDS | OTHER_OPTIONS}
    assert not unknown, (
        "new options with a string or boolean default: if one chooses how an operation runs, use an existing "
        "word (IMPLEMENTATION_WORDS) instead of a new one; otherwise add it to OTHER_OPTIONS. " + repr(unknown))
    assert {"kernels", "w8a8"} <= set(found)  # the scan sees the words


def test_one_execution_value_holds_the_four_words():
    """At most four public words choose an implementation, all fields of `Execution`; the model's config has none
    of them (it describes the model's math only), and a model's layers all hold the one value it was built with."""
    import dataclasses

    from flax import nnx

    from qwen35 import Execution, tiny
    from qwen35.config import Qwen35Config
    from qwen35.model import Qwen35ForCausalLM

    assert len(IMPLEMENTATION_WORDS) <= 4
    assert IMPLEMENTATION_WORDS <= {f.name for f in dataclasses.fields(Execution)}
    assert not IMPLEMENTATION_WORDS & {f.name for f in dataclasses.fields(Qwen35Config)}
    assert not {"backend", "act_fp8"} & {f.name for f in dataclasses.fields(Qwen35Config)}
    ex = Execution(kernels="pallas", experts="dense")
    model = Qwen35ForCausalLM(tiny(num_hidden_layers=2, layer_types=("linear_attention", "full_attention")),
                              rngs=nnx.Rngs(0), execution=ex)
    held = {id(m.execution) for _, m in nnx.iter_graph(model) if hasattr(m, "execution")}
    assert held == {id(ex)}


def test_fp8_constants_agree():
    """The jax-free config and the kernels' FP8 module hold the same block sizes."""
    from qwen35 import config
    from qwen35.kernels import fp8

    assert (config.FP8_BLOCK, config.ACT_BLOCK) == (fp8.FP8_BLOCK, fp8.ACT_BLOCK)
