"""scripts/check_cost.py runs as documented: three models with equal outputs, the control's callables
unchecked where asked, both rope_dedup models sharing their tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_cost.py"


@pytest.mark.parametrize("control, unchecked", [("no-check", 1), ("same", 0)])
def test_check_cost_runs(control: str, unchecked: int) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--rounds", "4", "--warmup", "1",
                          "--inner", "eager", "--control", control], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    line = run.stdout.strip().splitlines()[-1]
    assert re.search(r"R/I \d\.\d{3}  C/I \d\.\d{3}  C/R \d\.\d{3}", line), line
    assert f"RoPE storages R 2, C 2; callables unchecked: {unchecked})" in line  # one block graph, cos and sin
