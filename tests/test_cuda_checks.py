"""scripts/cuda_checks.sh stops at once without CUDA; scripts/cuda_graphs_check.py runs and checks on CPU too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "scripts" / "cuda_checks.sh"
GRAPHS = ROOT / "scripts" / "cuda_graphs_check.py"


def run_graphs_check(tmp_path: Path, *args: str, timeout: float) -> dict:
    """Run the CUDA graphs check in a fresh interpreter (own inductor cache); its JSON, after exit 0."""
    out = tmp_path / "cuda_graphs.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    run = subprocess.run([sys.executable, str(GRAPHS), *args, "--json", str(out)], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["ok"] and not result["failures"]
    assert set(result["styles"]) == {"whole", "regional"}
    for style in result["styles"].values():
        assert style["outputs_equal"] and style["max_abs_diff"] == 0.0
        assert style["rope_storages"] == style["ideal_storages"] < style["rope_storages_before"]
        assert style["rope_bytes"] == style["ideal_bytes"]
        assert style["rope_storages_without_pass"] == style["rope_storages_before"]
        assert style["graphs_compiled"] >= 1 and not style["pass_errors"]
    return result


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_checks_stop_at_once_without_cuda(tmp_path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}  # the interpreter running the tests, whatever venv it is in
    started = time.monotonic()
    run = subprocess.run(["bash", str(CHECKS), str(out)], capture_output=True, text=True, timeout=60, env=env,
                         cwd=tmp_path)
    elapsed = time.monotonic() - started
    assert run.returncode == 2, run.stdout + run.stderr
    assert elapsed < 30
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    expected = f"no CUDA device visible to torch {torch.__version__} ({sys.executable}); nothing was run"
    assert lines[0] == f"cuda_checks: {expected}"
    assert run.stdout == ""
    assert not out.exists()  # nothing was run, nothing written


def test_graphs_check_on_cpu(tmp_path) -> None:
    """Both compile styles on CPU (no CUDA graphs there): equal outputs and ideal storage. aot_eager keeps it
    near 15 s on 2 cores; the inductor run below takes 30-80 s, so it is in the slow set."""
    result = run_graphs_check(tmp_path, "--device", "cpu", "--mode", "default", "--inner", "aot_eager",
                              "--layers", "2", "--context", "256", "--timed-steps", "5", timeout=300)
    for style in result["styles"].values():
        assert style["cudagraph_recordings"] is None
        assert style["rope_tables"] == 4 and style["ideal_storages"] == 2  # cos and sin, once each


@pytest.mark.slow
def test_graphs_check_on_cpu_inductor(tmp_path) -> None:
    result = run_graphs_check(tmp_path, "--device", "cpu", "--mode", "default", "--layers", "2", "--context", "256",
                              "--timed-steps", "5", timeout=600)
    for style in result["styles"].values():
        assert style["inductor_counters"]["rope_dedup"]["cudagraph_skips"] == 0


@pytest.mark.slow
def test_graphs_check_on_cpu_reduce_overhead(tmp_path) -> None:
    """mode="reduce-overhead" reaches inductor through rope_dedup: on CPU inductor then skips CUDA graphs, once
    per compiled graph, exactly as it does alone."""
    result = run_graphs_check(tmp_path, "--device", "cpu", "--mode", "reduce-overhead", "--layers", "2",
                              "--context", "256", "--timed-steps", "5", timeout=600)
    for style in result["styles"].values():
        skips = style["inductor_counters"]
        assert skips["rope_dedup"]["cudagraph_skips"] == skips["inductor"]["cudagraph_skips"] >= 1


def test_graphs_check_refuses_cuda_without_cuda(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    run = subprocess.run([sys.executable, str(GRAPHS), "--json", str(tmp_path / "x.json")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2
    assert "no CUDA device is visible to torch" in run.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphs_check_on_cuda_reduce_overhead(tmp_path) -> None:
    result = run_graphs_check(tmp_path, "--device", "cuda", "--mode", "reduce-overhead", "--layers", "4",
                              "--context", "4096", "--timed-steps", "10", timeout=600)
    for style in result["styles"].values():
        recordings = style["cudagraph_recordings"]
        assert recordings["inductor"] == recordings["rope_dedup"] > 0
