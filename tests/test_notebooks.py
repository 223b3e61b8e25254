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
