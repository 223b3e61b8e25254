"""Smoke test of benchmarks/vs_transformers.py on the tiny preset: it runs both frameworks on the same checkpoint,
their greedy tokens agree, and its JSON has every figure (no timing assertions: the machines are shared)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch  # noqa: F401  (the parity extra, installed by .ci/run: like test_parity.py, fail loudly without it)
import transformers  # noqa: F401

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "vs_transformers.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_vs_transformers", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_paired_speedups_cancel_a_drift_between_rounds():
    # the machine runs twice as slow in round 2: both frameworks' times double, each round's ratio stays 2.1
    m = {"transformers": {"prefill_rounds_s": [[2.0, 2.2, 2.1], [4.0, 4.4, 4.2]], "decode_all_s": [6.0, 12.0]},
         "qwen35": {"prefill_rounds_s": [[1.0, 1.1, 0.9], [2.2, 1.8, 2.0]], "decode_all_s": [2.0, 4.0]}}
    p = _load().paired_speedups(m)
    assert p["prefill"] == pytest.approx([2.1, 2.1])
    assert p["decode"] == pytest.approx([3.0, 3.0])


def test_vs_transformers_quick_runs_and_agrees(tmp_path, capsys):
    mod = _load()
    out = tmp_path / "vs.json"
    mod.main(["--quick", "--json", str(out)])
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert run["preset"] == "tiny"
    assert run["greedy_tokens_agree"] == 1.0  # same checkpoint, same greedy tokens in both frameworks
    for name in ("transformers", "qwen35"):
        r = run["results"][name]
        assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0
        assert len(r["decode_ms_per_step_all"]) == 1 and len(r["prefill_s_all"]) == 2  # --quick: one round
        assert 0 < r["prefill_frac_of_roofline"] and 0 < r["decode_frac_of_roofline"]
    assert run["speedup_decode"] > 0 and run["speedup_prefill"] > 0
    assert run["speedup_decode_median"] > 0 and run["speedup_prefill_median"] > 0
    # one round (--quick): its within-round ratios are the ratios of that round's medians
    pre = {n: np.median(run["results"][n]["prefill_s_all"]) for n in ("transformers", "qwen35")}
    assert run["speedup_prefill_rounds"] == pytest.approx([pre["transformers"] / pre["qwen35"]], rel=1e-2)
    assert run["speedup_decode_rounds"] == pytest.approx([run["speedup_decode"]], rel=1e-2)
    assert "qwen35 / transformers: prefill x" in capsys.readouterr().out  # the table was printed
