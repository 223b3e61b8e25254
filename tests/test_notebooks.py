"""Notebook hygiene that nbval itself does not check."""

import json
import re
from pathlib import Path

from nbval.plugin import comment_markers

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_every_nbval_marker_is_one_nbval_recognises():
    """nbval honours a marker only when the comment is exactly the marker (`# NBVAL_IGNORE_OUTPUT`); any text after
    it on the same line silently turns the marker off, and the cell's printed floats are then compared on a CPU
    whose rounding differs. The reason goes on the next line."""
    assert NOTEBOOKS
    bad = []
    for nb_path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(nb_path.read_text())["cells"]):
            if cell["cell_type"] != "code":
                continue
            for line in "".join(cell["source"]).splitlines():
                m = re.match(r"\s*#+\s*((NBVAL|PYTEST_VALIDATE)\w*)(.*)", line)
                if m and line.strip().lstrip("#").strip() not in comment_markers:
                    bad.append(f"{nb_path.name} cell {i}: {line.strip()!r}")
    assert not bad, "markers nbval ignores (put the reason on the next line):\n" + "\n".join(bad)


def test_every_notebook_opens_cites_installs_and_ends_with_a_takeaway():
    """The course's shape (each notebook read alone, or opened on a fresh Colab runtime): it opens with its question,
    links its sources, its first code cell installs the package when it is missing, and it ends with a takeaway."""
    bad = []
    for nb_path in NOTEBOOKS:
        cells = json.loads(nb_path.read_text())["cells"]
        text = lambda c: "".join(c["source"])  # noqa: E731
        code = [c for c in cells if c["cell_type"] == "code"]
        if cells[0]["cell_type"] != "markdown" or "**The question.**" not in text(cells[0]):
            bad.append(f"{nb_path.name}: the first cell does not state the question")
        if not re.search(r"\]\(https?://", "".join(text(c) for c in cells if c["cell_type"] == "markdown")):
            bad.append(f"{nb_path.name}: no source is linked")
        if not code or 'find_spec("qwen35")' not in text(code[0]):
            bad.append(f"{nb_path.name}: the first code cell does not install the package when it is missing")
        if not any("Takeaway" in text(c) for c in cells[-2:] if c["cell_type"] == "markdown"):
            bad.append(f"{nb_path.name}: no takeaway at the end")
    assert not bad, "\n".join(bad)
