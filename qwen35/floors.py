"""The package's floors, read from its own sources (ast, nothing imported): kernels → layers → model → execution
→ serving, each importing only its own floor and the floors below it.

    kernels    qwen35.kernels.*: Pallas kernels beside their pure-JAX references; jax and numpy only
    layers     the config and the modules with the checkpoint's parameter names (GDN, attention, MoE, the decoder
               layer, the MTP head), calling the kernels
    model      the model, its weights, generation, training, the parity harness
    execution  qwen35.sharding: where and how the model runs on a mesh (placement, the MoE exchange)
    serving    qwen35.serving: the engine, its cache pool and scheduler, the step
    tools      the command line, the roofline, measurement helpers: above everything, importing anything

`import_graph()` is what tests/test_architecture.py checks (no cycle, no import upward) and what `draw()` draws
(README's architecture figure: `python -m qwen35.floors figures/floors.png`).
"""

from __future__ import annotations

import ast
import pathlib
import sys

__all__ = ["FLOORS", "floor_of", "modules", "imports", "import_graph", "cycles", "upward_imports", "draw"]

FLOORS = ("kernels", "layers", "model", "execution", "serving", "tools")
_MODEL = {"qwen35.model", "qwen35.weights", "qwen35.generation", "qwen35.parity", "qwen35.train"}
_TOOLS = {"qwen35.__main__", "qwen35.bench", "qwen35.utils", "qwen35.roofline", "qwen35.floors"}


def floor_of(module: str) -> int:
    """The floor (an index into `FLOORS`) of a module of the package."""
    if module == "qwen35.kernels" or module.startswith("qwen35.kernels."):
        return 0
    if module == "qwen35.sharding" or module.startswith("qwen35.sharding."):
        return 3
    if module == "qwen35.serving" or module.startswith("qwen35.serving."):
        return 4
    if module in _TOOLS:
        return 5
    return 2 if module in _MODEL else 1


def modules() -> dict[str, pathlib.Path]:
    """Module name -> source file, for the package and its kernels (wherever they are installed: `kernels/` beside
    the package in a checkout, `qwen35/kernels/` in a wheel)."""
    pkg = pathlib.Path(__file__).resolve().parent
    found = {}
    for root, prefix in ((pkg, "qwen35"), (_kernels_dir(), "qwen35.kernels")):
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if prefix == "qwen35" and parts[0] == "kernels":
                continue  # a wheel's copy of the kernels: counted under their own root
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _kernels_dir() -> pathlib.Path:
    import importlib.util

    spec = importlib.util.find_spec("qwen35.kernels")  # finds the folder; runs nothing of it
    return pathlib.Path(spec.origin).parent


def imports(path: pathlib.Path):
    """(module, line) of every absolute import in a file, at any depth (module level, in functions, in classes);
    `from a import b` yields both a and a.b (b may be a submodule)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
            for alias in node.names:
                yield f"{node.module}.{alias.name}", node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module of the package it imports: the line of the first such import}."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        deps: dict[str, int] = {}
        for target, line in imports(path):
            if target in mods and target != name:
                deps.setdefault(target, line)
        graph[name] = deps
    return graph


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def upward_imports(graph) -> list[str]:
    """Every import of a module on a higher floor than the importer's, as 'a -> b (line n)'."""
    return [f"{a} -> {b} (line {line})" for a, deps in sorted(graph.items()) for b, line in sorted(deps.items())
            if floor_of(b) > floor_of(a)]


def draw(path=None):
    """The floors as bands, bottom to top, each listing its modules, with the number of imports each floor makes
    of each floor below it. Saved to `path` if given; returns the figure."""
    import matplotlib.pyplot as plt

    graph = import_graph()
    by_floor: dict[int, list[str]] = {i: [] for i in range(len(FLOORS))}
    for m in graph:
        short = m.removeprefix("qwen35.")
        for pkg in ("kernels", "sharding", "serving"):  # a floor's own package: its modules by their short names
            short = "__init__" if short == pkg else short.removeprefix(pkg + ".")
        by_floor[floor_of(m)].append("__init__" if m == "qwen35" else short)
    fig, ax = plt.subplots(figsize=(11, 6.2))
    colors = ["#d9e8f5", "#dff0d8", "#fcf3cf", "#f8e0d0", "#e8daef", "#eeeeee"]
    for i, name in enumerate(FLOORS):
        ax.add_patch(plt.Rectangle((0, i), 1, 0.9, color=colors[i], ec="#666666"))
        pkg = {0: "qwen35.kernels", 3: "qwen35.sharding", 4: "qwen35.serving"}.get(i, "qwen35")
        ax.text(0.01, i + 0.72, name, fontsize=12, weight="bold", va="center")
        ax.text(0.01, i + 0.45, pkg, fontsize=8, va="center", color="#444444")
        names, lines = sorted(by_floor[i]), [""]
        for n in names:  # wrapped at about 90 characters
            lines[-1:] = [lines[-1] + ", " + n] if lines[-1] and len(lines[-1]) + len(n) < 88 else (
                [lines[-1], n] if lines[-1] else [n])
        ax.text(0.15, i + 0.45, "\n".join(lines), fontsize=8.5, va="center", family="monospace")
        below = {}
        for a, deps in graph.items():
            if floor_of(a) == i:
                for b in deps:
                    if floor_of(b) < i:
                        below[FLOORS[floor_of(b)]] = below.get(FLOORS[floor_of(b)], 0) + 1
        if below:
            ax.text(0.99, i + 0.12, "imports ↓ " + ", ".join(f"{k} {v}" for k, v in below.items()), fontsize=8,
                    ha="right", color="#444444")
    up, cyc = upward_imports(graph), cycles(graph)
    ax.set_title(f"qwen35's floors: {len(graph)} modules, {sum(len(d) for d in graph.values())} imports, "
                 f"{len(up)} upward, {len(cyc)} cycles", fontsize=12)
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.05, len(FLOORS))
    ax.axis("off")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "figures/floors.png"
    draw(out)
    print(f"saved {out}")
