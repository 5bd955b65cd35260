"""Shared test set-up: examples/ importable, a clean dynamo state and a private inductor cache per test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path_factory, monkeypatch):
    """Reset dynamo and its counters (reset() alone keeps counters), and isolate inductor's FX cache,
    which can hand back code compiled before a rewrite took effect."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_terminal_size(monkeypatch):
    """pytest-xdist workers set COLUMNS=80, and the CLI honours COLUMNS: unset, its tables keep the width
    they have whenever stdout is not a terminal, with or without ``-n``."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
