"""`kernels/` installs as `qwen35.kernels` (never as a top-level `kernels`, the name of Hugging Face's package
that transformers probes for), both from this editable install and from a regular (wheel) install, which also
carries the `serving` and `sharding` subpackages."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = (
    "import importlib.util, qwen35, qwen35.kernels;"
    "spec = importlib.util.find_spec('kernels');"
    "print(qwen35.kernels.__file__);"
    "print('TOPLEVEL', None if spec is None else spec.origin)"
)


def _run(args, cwd, env=None):
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{args} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_kernels_is_a_subpackage_here():
    import qwen35.kernels

    assert Path(qwen35.kernels.__file__).resolve() == (ROOT / "kernels" / "__init__.py").resolve()


def test_editable_install_imports_qwen35_kernels(tmp_path):
    out = _run([sys.executable, "-c", PROBE], cwd=tmp_path)  # outside the repo: only the installed finder
    lines = out.strip().splitlines()
    assert Path(lines[0]).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
    # a top-level `kernels` may exist (Hugging Face's, which transformers may install, even into a venv inside the
    # repo); it must not be this repo's kernels/
    top = lines[1].split(" ", 1)[1]
    assert top == "None" or Path(top).resolve().parent != (ROOT / "kernels").resolve(), \
        f"the repo's kernels/ leaked as a top-level package ({top})"


def test_regular_install_imports_qwen35_kernels(tmp_path):
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
          str(target), str(ROOT)], cwd=tmp_path)
    for sub in ("kernels", "serving", "sharding"):  # every subpackage ships
        assert (target / "qwen35" / sub / "__init__.py").exists(), f"qwen35/{sub} missing from a regular install"
    assert not (target / "kernels").exists(), "kernels/ must not be installed as a top-level package"
    env = dict(os.environ, PYTHONPATH=str(target), PYTHONNOUSERSITE="1")
    # -I would also drop PYTHONPATH; -S keeps the editable finder of this venv out of the way.
    out = _run([sys.executable, "-S", "-c", PROBE], cwd=tmp_path, env=env)
    assert Path(out.splitlines()[0]).resolve() == (target / "qwen35" / "kernels" / "__init__.py").resolve()
    assert importlib.util.find_spec("qwen35.kernels") is not None


def test_no_script_folder_shadows_hugging_faces_kernels():
    """A script's folder comes first on `sys.path`, and transformers imports Hugging Face's `kernels` package: a
    `kernels.py` (or `kernels/`) beside a script that imports transformers (`benchmarks/vs_transformers.py`) would
    be imported in its place and fail."""
    for folder in ("benchmarks", "notebooks", "tests"):
        assert not (ROOT / folder / "kernels.py").exists() and not (ROOT / folder / "kernels").is_dir(), folder
