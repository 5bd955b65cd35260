"""An exception injected into the store midway (the k-th equality check, the k-th storage re-point) leaves no
half-shared state: every table reads its own values, shared or not, and outputs stay exact, through the
compile-time pass (which then compiles the graph unshared and reports the error) and through share()."""

from __future__ import annotations

import copy

import pytest
import torch

import rope_dedup.core.store as store_module
from rope_dedup import RopeDedupBackend, share
from rope_dedup.tensors import same_values
from rope_dedup.testing.toy_decoder import ToyDecoder, local_global, rope_tensors

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def failing_at(k: int, real):
    calls = {"n": 0}

    def wrapper(*args):
        calls["n"] += 1
        if calls["n"] == k:
            raise MemoryError(f"injected at call {k}")
        return real(*args)
    return wrapper


@pytest.mark.parametrize("where", ["same_values", "_share_storage"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("how", ["compile", "share"])
def test_an_injected_failure_leaves_every_table_whole(where: str, k: int, how: str, monkeypatch) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ToyDecoder(local_global(6)).eval()
    reference = copy.deepcopy(model)
    monkeypatch.setattr(store_module, where, failing_at(k, getattr(store_module, where)))
    backend = RopeDedupBackend("eager")
    with torch.no_grad():
        if how == "compile":
            out = torch.compile(model, backend=backend)(TOKENS)
            assert any("injected" in error for error in backend.report.errors)
        else:
            with pytest.raises(MemoryError, match="injected"):
                share(model, backend=backend)
            out = model(TOKENS)
        torch.testing.assert_close(out, reference(TOKENS), rtol=0, atol=0)
    for (name, table), (_, original) in zip(rope_tensors(model), rope_tensors(reference)):
        assert same_values(table, original), name
