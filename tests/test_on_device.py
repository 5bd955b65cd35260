"""The device-generic suite: tables and inputs on ``ROPE_DEDUP_TEST_DEVICE`` (default cpu; see conftest.py).

Each test builds where a user would: a model under ``with torch.device(device)``, or on CPU and moved there,
while the library's own small tensors stay on CPU. It is the class of bug the first GPU run met (an
``inv_freq`` key mixing the table's device with the default one) that CPU alone cannot show:
``ROPE_DEDUP_TEST_DEVICE=cuda pytest -m device`` runs these, the property suite's pinned sequences and every
other test that takes the ``device`` fixture on the GPU; scripts/cuda_checks.sh does so.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from ideal import ideal_storages

from rope_dedup import RopeDedupBackend, RopeSpec, explain, share, sharing
from rope_dedup.core.store import Action, CanonicalStore
from rope_dedup.tables.keys import infer_key
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table
from rope_dedup.testing.toy_decoder import (LAYOUTS, TableRecipe, ToyDecoder, homogeneous, local_global,
                                            rope_tensors, unique_storages)
from rope_dedup.tensors import same_values

RECIPES = [TableRecipe(layout=layout, theta=5e5, max_len=64) for layout in LAYOUTS if layout != "lazy_cache"]
RECIPES += [TableRecipe(layout="cos_sin", scaling=s, max_len=64) for s in ("linear", "llama3", "yarn")]
RECIPES += [TableRecipe(layout="hf_halves", dtype=torch.bfloat16), TableRecipe(layout="inv_freq", scaling="llama3")]


def tokens(device: torch.device) -> torch.Tensor:
    return torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0)).to(device)


def storages(model: nn.Module) -> int:
    return unique_storages([t for _, t in rope_tensors(model)])[0]


def distinct(model: nn.Module) -> int:
    seen: list[torch.Tensor] = []
    for _, t in rope_tensors(model):
        if not any(u.dtype == t.dtype and u.shape == t.shape and same_values(u, t) for u in seen):
            seen.append(t)
    return len(seen)


def built(specs, device: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return ToyDecoder(specs).eval()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.layout}-{r.scaling}-{str(r.dtype)[6:]}")
def test_recognition_and_keys(recipe: TableRecipe, device: torch.device) -> None:
    """A table on the device gets the key of the same table on CPU, with the device's name in it."""
    for (_, on_cpu), (_, here) in zip(rope_tensors(built([recipe], torch.device("cpu"))),
                                      rope_tensors(built([recipe], device))):
        found, expected = recognize_rope_table(here), recognize_rope_table(on_cpu)
        assert isinstance(found, RopeTable) and isinstance(expected, RopeTable)
        key = infer_key(found, here)
        assert key.device == here.device
        assert dataclasses.replace(key, device=on_cpu.device) == infer_key(expected, on_cpu)


def test_store(device: torch.device) -> None:
    model = built(local_global(3, every=3), device)
    store = CanonicalStore()
    actions = [store.offer(t, name=name).action for name, t in rope_tensors(model)]
    assert actions == [Action.NEW, Action.NEW, Action.JOIN, Action.JOIN, Action.NEW, Action.NEW]
    assert storages(model) == 4 and {g.key.device for g, _, _ in store.snapshot()} == {model.embed.weight.device}


def test_share(device: torch.device) -> None:
    model = built(local_global(6) + homogeneous(2, layout="inv_freq"), device)
    reference = copy.deepcopy(model)
    report = share(model, backend=RopeDedupBackend("eager"))
    assert storages(model) == distinct(model) < storages(reference) and not report.errors
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(device)), reference(tokens(device)), rtol=0, atol=0)


def test_sharing_while_building_under_the_device(device: torch.device) -> None:
    """The first GPU run: ``with torch.device("cuda"), rope_dedup.sharing(): build()`` raised."""
    backend = RopeDedupBackend("eager")
    torch.manual_seed(0)
    with torch.device(device), sharing(backend=backend):
        model = ToyDecoder(local_global(6) + homogeneous(2, layout="inv_freq")).eval()
    assert storages(model) == distinct(model)
    assert not backend.report.errors


# inductor on the CPU repeats test_backend.py's inductor tests: slow set (``-m device`` runs it on a GPU).
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
def test_backend_on_a_toy_decoder(inner: str, regional: bool, device: torch.device) -> None:
    specs = local_global(4) + homogeneous(2, layout="inv_freq") + homogeneous(2, layout="lazy_cache")
    reference = built(specs, device)
    model = copy.deepcopy(reference)
    backend = RopeDedupBackend(inner)
    if regional:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)
        plain = copy.deepcopy(reference)
        for i, block in enumerate(plain.layers):
            plain.layers[i] = torch.compile(block, backend=inner)
        compiled = model
    else:
        compiled, plain = torch.compile(model, backend=backend), torch.compile(reference, backend=inner)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(tokens(device)), plain(tokens(device)), rtol=0, atol=0)
    assert not backend.report.errors
    assert storages(model) == ideal_storages(reference)


def test_static_and_dynamic_audit(device: torch.device) -> None:
    """The audit of a model on the device reads what the audit of the same model on CPU reads."""
    specs = local_global(3, every=3) + homogeneous(1, layout="inv_freq")
    expect = {"layers.2": RopeSpec(1e6), "*": RopeSpec(1e4)}
    on_cpu, here = built(specs, torch.device("cpu")), built(specs, device)

    def read(explanation) -> list:
        return [(row.layer, sorted((t.key.layout, t.key.theta, t.key.dim) for t in row.applied))
                for row in explanation.layers]

    for args in ((), (tokens(torch.device("cpu")),)):
        there = explain(here, *(a.to(device) for a in args), expect=expect)
        assert there.mismatches == () and read(there) == read(explain(on_cpu, *args, expect=expect))
    broken = built([dataclasses.replace(s, theta=2e4) for s in specs], device)
    assert {m.layer for m in explain(broken, expect=expect).mismatches} == {f"layers.{i}" for i in range(4)}


def test_build_on_cpu_share_then_move_to_the_device(device: torch.device) -> None:
    """The flow most GPU users follow: one table per group arrives on the device, never one per layer."""
    model = built(local_global(6), torch.device("cpu"))
    reference = copy.deepcopy(model)
    share(model, backend=RopeDedupBackend("eager"))
    model.to(device), reference.to(device)
    assert storages(model) == distinct(reference) == 4 < storages(reference)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens(device)), reference(tokens(device)), rtol=0, atol=0)


def test_to_empty_on_the_device_then_re_init(device: torch.device) -> None:
    """torchtitan's flow: build on meta, to_empty on the device, init; then share, compile, move again."""
    specs = local_global(6)
    with torch.device("meta"):
        model = ToyDecoder(specs).eval()
    model.to_empty(device=device)
    reference = built(specs, device)
    with torch.no_grad():
        for (_, a), (_, value) in zip([*model.named_parameters(), *model.named_buffers()],
                                      [*reference.named_parameters(), *reference.named_buffers()]):
            a.copy_(value)
    backend = RopeDedupBackend("eager")
    share(model, backend=backend)
    model.to_empty(device=device)  # once more, shared now: one uninitialized table per group
    assert storages(model) == 4
    with torch.no_grad():
        for (_, a), (_, value) in zip(rope_tensors(model), rope_tensors(reference)):
            a.copy_(value)
        for (_, a), (_, value) in zip(model.named_parameters(), reference.named_parameters()):
            a.copy_(value)
        torch.testing.assert_close(torch.compile(model, backend=backend)(tokens(device)), reference(tokens(device)),
                                   rtol=0, atol=0)
    assert storages(model) == 4
