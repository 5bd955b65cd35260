"""Shared test set-up: examples/ importable, a clean dynamo state and a private inductor cache per test, the
device the device-generic tests put their tables and inputs on, and the op harness's end-of-run summary.

``ROPE_DEDUP_TEST_DEVICE`` (default ``cpu``) names that device: ``ROPE_DEDUP_TEST_DEVICE=cuda pytest -m device``
runs every test that takes the ``device`` fixture (they carry the ``device`` mark) on the GPU, and skips them
cleanly where torch sees no such device. scripts/cuda_checks.sh runs it so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

# Each pytest-xdist worker gets its share of the cores, and so do the scripts it starts (examples, the CLI):
# two workers with an OpenMP pool of every core each spin against each other, and a test of small ops then
# ran 10x slower than alone (49 s against 4.5 s on 2 cores).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)


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


TEST_DEVICE = os.environ.get("ROPE_DEDUP_TEST_DEVICE", "cpu")


def device_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    backend = getattr(torch, device.type, None)
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    return count > (device.index or 0)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where device-generic tests put tables and inputs: ``ROPE_DEDUP_TEST_DEVICE``, skipped if absent."""
    where = torch.device(TEST_DEVICE)
    if not device_available(where):
        pytest.skip(f"ROPE_DEDUP_TEST_DEVICE={TEST_DEVICE}: torch {torch.__version__} sees no such device")
    return where


def pytest_collection_modifyitems(config, items) -> None:
    """Every test that takes the ``device`` fixture is selectable with ``-m device``."""
    for item in items:
        if "device" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.device)


def pytest_terminal_summary(terminalreporter) -> None:
    """The op harness's counts (tests/test_recompute_ops.py), added up over every test that ran, on any
    pytest-xdist worker: what ran, and each sample or run left out with its reason."""
    totals: dict[str, int] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, counts in getattr(report, "user_properties", ()):
                if name == "recompute_ops" and getattr(report, "when", None) == "call":
                    for key, n in counts.items():
                        totals[key] = totals.get(key, 0) + n
    if totals:
        terminalreporter.section("recomputed tables against plain tables, op by op")
        for key in sorted(totals, key=lambda k: (k.startswith("excluded"), k)):
            terminalreporter.write_line(f"{totals[key]:>8}  {key}")
