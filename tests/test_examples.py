"""Every script in examples/ runs as it is, so none can rot (fast inner backend here; inductor under -m slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXPECTED = {  # script -> lines its output must contain
    "basic_compile.py": ["after:  16 RoPE tensors in 2 storages", "outputs equal eager"],
    "regional_compile.py": ["graphs compiled: 1; 16 RoPE tensors now in 2 storages"],
    "local_global.py": ["12 RoPE tensors now in 4 storages", "theta=1e+06 cos: 2 layers share one table"],
    "audit.py": ["check layers.5: theta 10000 (most layers: 500000)"],
    "catch_misconfiguration.py": [
        "theta_ignored (bug): layers.1: theta: expected 500000, found 10000",
        "llama3_dropped (bug): model.layers.0: scaling: expected llama3:32:1:4:8192, found none",
        "yarn_attention_factor_dropped (bug): model.layers.0: attention_factor: expected 1.13863, found 1",
        "partial_rotary_ignored (bug): model.layers.0: rotary_dim: expected 8, found 16",
        "gemma3_local_global_swapped (bug): model.layers.0: theta: expected 10000, found 1e+06",
        "inv_freq_in_bf16 (bug): model.layers.1: frequency dtype: expected float32, found bfloat16 (inv_freq rounded)",
        "inv_freq_in_bf16 (fixed): every layer applies the expected RoPE",
        "rope_unfilled_after_to_empty (bug): model.rotary_emb: content: expected a RoPE table, found "
        "model.rotary_emb.inv_freq: NaN or inf: uninitialized memory",
        "rope_unfilled_after_to_empty (fixed): every table holds the expected RoPE",
        "theta_lost_in_rope_parameters (bug): layers.1: theta: expected 500000, found 10000",
        "theta_lost_in_rope_parameters (fixed): every table holds the expected RoPE"],
    "read_report.py": ["skipped: layers.4.attention.rope.cached_freqs: written in the graph"],
    "export_program.py": ["constants: 16 -> 2", "reloaded program equals eager"],
    "bench_computed_rope.py": ["fold+merge"],
    "bench_recognition_peak.py": ["complex (freqs_cis)"],
    "bench_step_time.py": ["worst median paired ratio"],
    "bench_move_peak.py": ["RoPE storages after the move: 2"],
    "bench_precision.py": ["tables judged: 2 (1 distinct content), 0 diverge"],
    "bench_recompute.py": ["RoPE bytes: unshared 8.4 MB, shared 4.2 MB, recompute 256 B (2 tables recomputed)"],
    # 8 GPT-J layers, each a (16384, 32) float32 embed_positions: 7 of 8 copies freed.
    "profile_gptj.py": ["alone: RoPE storage 14.7 MB less"],  # vs eager alone, or inductor alone under -m slow
}
TAKES_INNER = {name for name in EXPECTED
               if name not in ("audit.py", "catch_misconfiguration.py", "export_program.py", "bench_computed_rope.py",
                            "bench_recognition_peak.py", "bench_step_time.py", "bench_move_peak.py",
                            "bench_recompute.py", "bench_precision.py")}
# The benchmark at a size that only checks it runs (its figures come from the full run, docs/benchmarks.md).
ARGS = {"bench_computed_rope.py": ["--layers", "2", "--context", "256", "--seq", "16", "--rounds", "2",
                                   "--warmup", "1", "--inners", "eager", "--modes", "forward"],
        "bench_step_time.py": ["--layers", "2", "--rounds", "4", "--warmup", "1", "--inner", "eager",
                               "--processes", "1"],
        "bench_move_peak.py": ["--layers", "4", "--context", "1024"],
        "bench_precision.py": ["--layers", "2", "--context", "8192", "--rounds", "1"],
        "profile_gptj.py": ["--rounds", "20"],
        "bench_recompute.py": ["--preset", "titan-128k", "--layers", "2", "--context", "8192", "--rounds", "2",
                               "--prefill", "16", "--backend", "eager"]}


def start(name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(EXAMPLES / name), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def check(name: str, process: subprocess.Popen) -> None:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    for line in EXPECTED[name]:
        assert line in out, out


@pytest.fixture(scope="module")
def fast_runs() -> dict[str, subprocess.Popen]:
    """All scripts started at once with the eager inner backend: they are mostly interpreter start-up."""
    return {name: start(name, *(["--inner", "eager"] if name in TAKES_INNER else []), *ARGS.get(name, []))
            for name in EXPECTED}


def test_every_example_is_covered() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str, fast_runs) -> None:
    check(name, fast_runs[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TAKES_INNER))
def test_example_runs_with_inductor(name: str) -> None:
    check(name, start(name))
