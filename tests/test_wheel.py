"""The built wheel in a fresh venv: the demo and ``backend="rope_dedup"`` work with no source checkout."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*command, cwd: Path) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.slow
def test_wheel_installs_and_runs_the_profile_and_the_backend_name(tmp_path) -> None:
    import torch

    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", ROOT,
        cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("rope_dedup-*.whl"))
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    # The torch this suite runs on (the pinned CPU wheel in CI), then the wheel with the demo extra.
    run(python, "-m", "pip", "install", "--quiet", f"torch=={torch.__version__.split('+')[0]}", cwd=tmp_path)
    run(python, "-m", "pip", "install", "--quiet", f"{wheel}[demo]", cwd=tmp_path)
    files = run(python, "-c", "import rope_dedup, pathlib; print(pathlib.Path(rope_dedup.__file__).parent)",
                cwd=tmp_path).strip()
    assert str(ROOT) not in files  # the installed package, not this checkout
    assert (Path(files) / "py.typed").is_file()  # users' type checkers read the package's hints

    out = run(venv / "bin" / "rope-dedup", "profile", "--inner", "eager", "--layers", "2", "--context", "256",
              "--head-dim", "16", "--steps", "2", "--step-seconds", "0", cwd=tmp_path)
    assert "RoPE bytes after / ideal" in out and "rope_dedup vs eager alone: RoPE storage" in out

    script = textwrap.dedent("""
        import sys, torch
        from torch.nn import Module
        class Rope(Module):
            def __init__(self):
                super().__init__()
                angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
                self.register_buffer("cos", angles.cos(), persistent=False)
            def forward(self, x):
                return x * self.cos[: x.shape[0]]
        model = torch.nn.Sequential(Rope(), Rope())
        torch.compile(model, backend="rope_dedup")(torch.ones(8, 8))
        print("shared", model[0].cos.data_ptr() == model[1].cos.data_ptr())
    """)
    assert run(python, "-c", script, cwd=tmp_path).split() == ["shared", "True"]
