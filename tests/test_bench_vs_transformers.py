"""Smoke test of benchmarks/vs_transformers.py on the tiny preset: it runs both frameworks on the same checkpoint,
their greedy tokens agree, and its JSON has every figure (no timing assertions: the machines are shared)."""

import importlib.util
import json
from pathlib import Path

import torch  # noqa: F401  (the parity extra, installed by .ci/run: like test_parity.py, fail loudly without it)
import transformers  # noqa: F401

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "vs_transformers.py"


def test_vs_transformers_quick_runs_and_agrees(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_vs_transformers", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
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
    assert "qwen35 / transformers: prefill x" in capsys.readouterr().out  # the table was printed
