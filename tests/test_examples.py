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
    "read_report.py": ["skipped: layers.4.attention.rope.cached_freqs: written in the graph"],
}
TAKES_INNER = {name for name in EXPECTED if name != "audit.py"}


def test_every_example_is_covered() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py") if p.name != "toy_decoder.py"}
    assert scripts == set(EXPECTED)


def run_example(name: str, *args: str) -> str:
    run = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    for line in EXPECTED[name]:
        assert line in run.stdout, run.stdout
    return run.stdout


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str) -> None:
    run_example(name, *(["--inner", "eager"] if name in TAKES_INNER else []))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TAKES_INNER))
def test_example_runs_with_inductor(name: str) -> None:
    run_example(name)
