"""Smoke test of benchmarks/gdn.py at tiny sizes: it runs, and its JSON has the expected keys and sane numbers."""

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import fp32_tol, rule_terms

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "gdn.py"


@pytest.fixture(scope="module")
def bench():
    assert BENCH.exists(), f"{BENCH} is missing: the benchmark ships with the repo"
    spec = importlib.util.spec_from_file_location("bench_gdn", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gdn_benchmark_smoke(bench, tmp_path):
    out = tmp_path / "gdn.json"
    res = bench.run([64, 128], H=2, Dk=16, Dv=16, chunk_size=32, repeats=1, peak_n=128, peak_repeats=1,
                    json_path=out)
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "gdn" and saved["rows"] == json.loads(json.dumps(res["rows"]))
    assert saved["device"]["kind"] and saved["machine"]["backend"]
    assert saved["matmul_peak_gflops"] > 0
    assert [r["T"] for r in saved["rows"]] == [64, 128]
    for r in saved["rows"]:
        for key in ("recurrent_ms", "chunked_ms", "speedup", "recurrent_gflop", "chunked_gflop", "recurrent_gflops",
                    "chunked_gflops", "recurrent_pct_peak", "chunked_pct_peak"):
            assert r[key] > 0, key


def test_chunk_sweep_smoke(bench, tmp_path):
    """The chunk-size sweep behind `default_chunk_size`: every size gives the largest size's result (the check it
    reports), and the JSON holds a time for each size on each shape."""
    out = tmp_path / "sweep.json"
    shapes = (("tiny", 1, 40, 2, 8, 12), ("two sequences", 2, 24, 2, 8, 8))
    res = bench.chunk_sweep(shapes, sizes=(8, 16), repeats=1, json_path=out)
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "gdn_chunk_sweep" and saved["sizes"] == [8, 16]
    assert saved["default_chunk_size"] in (16, 64)
    assert [r["shape"] for r in saved["rows"]] == ["tiny", "two sequences"] == [r["shape"] for r in res["rows"]]
    for r in saved["rows"]:
        assert set(r["ms"]) == {"8", "16"} and all(t > 0 for t in r["ms"].values())
        assert r["ratio_to_C16"]["16"] == pytest.approx(1.0) and r["best"] in (8, 16)
        assert r["max_abs_diff"] <= fp32_tol(r["max_abs_out"], rule_terms(r["T"], r["Dk"], 16)), r
