"""Freed tables go back to the OS (glibc's malloc_trim) after a compile that freed them, never per call."""

from __future__ import annotations

import pytest
import torch

import rope_dedup.interning
import rope_dedup.core.memory
from rope_dedup import RopeDedupBackend
from rope_dedup.core.memory import _malloc_trim, release_freed_memory
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def trims(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(rope_dedup.core.memory, "release_freed_memory", lambda: calls.append(1) or True)
    return calls


def test_this_machine_s_c_library_can_trim() -> None:
    if _malloc_trim() is None:
        pytest.skip("no malloc_trim in this C library (not glibc)")
    assert release_freed_memory()


@pytest.mark.parametrize("settings, expected", [({}, 1), ({"release_memory": False}, 0), ({"dry_run": True}, 0)])
def test_one_trim_per_compile_that_freed_tables(settings, expected, trims) -> None:
    model = ToyDecoder(homogeneous(3))
    compiled = torch.compile(model, backend=RopeDedupBackend("eager", **settings))
    for _ in range(3):
        compiled(TOKENS)
    assert len(trims) == expected


def test_nothing_freed_nothing_trimmed(trims) -> None:
    torch.compile(ToyDecoder(homogeneous(1)), backend=RopeDedupBackend("eager"))(TOKENS)
    assert trims == []


def test_run_time_interning_trims_once_enough_piled_up(trims, monkeypatch) -> None:
    table_pair = 2 * 128 * 8 * 4  # one block's cos and sin: (128, 8) float32 each
    monkeypatch.setattr(rope_dedup.interning, "TRIM_THRESHOLD_BYTES", 2 * table_pair)
    model = ToyDecoder(homogeneous(7))
    backend = RopeDedupBackend("eager")
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend)
    model(TOKENS)
    assert len(trims) == 3  # blocks 1..6 freed by interning: a trim after every second block
    model(TOKENS)
    assert len(trims) == 3  # later calls: pointer checks only
