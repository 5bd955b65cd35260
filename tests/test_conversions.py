"""Shared tables stay shared through every ``Module._apply``, and every tensor stays swappable.

Before (main 1fb04be): ``share(model)`` then ``model.to(torch.float64)`` gave every layer its own table again
(2 storages -> 12 for 6 layers; on a GPU, the flow build on CPU, share(), ``.to("cuda")`` put one copy per layer
on the device), and after one call compiled through rope_dedup ``torch.utils.swap_tensors`` refused every
parameter and buffer ("Cannot swap t1 because it has weakref associated with it"), so did ``.to()`` under
``set_swap_module_params_on_conversion(True)`` and any move of a DTensor model (tests/test_distributed.py).
"""

from __future__ import annotations

import copy
import weakref
from typing import Callable

import pytest
import torch
import torch.nn as nn

from rope_dedup import RopeDedupBackend, share, sharing
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, local_global, rope_tensors, unique_storages
from rope_dedup.tensors import same_values
from rope_dedup.tools.profile import allocator_peak

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def storages(model: nn.Module) -> int:
    return unique_storages([t for _, t in rope_tensors(model)])[0]


def distinct(model: nn.Module) -> int:
    seen: list[torch.Tensor] = []
    for _, t in rope_tensors(model):
        if not any(u.dtype == t.dtype and u.shape == t.shape and same_values(u, t) for u in seen):
            seen.append(t)
    return len(seen)


def twins(specs, **kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = ToyDecoder(specs, **kwargs).eval()
    return model, copy.deepcopy(model)


def re_init_in_place(model: nn.Module, specs) -> None:
    """init_weights after to_empty, writing into the tensors the module holds (torch.nn.init's way)."""
    torch.manual_seed(0)
    fresh = ToyDecoder(specs).to(next(model.parameters()).dtype)
    with torch.no_grad():
        for (_, a), (_, value) in zip([*model.named_parameters(), *model.named_buffers()],
                                      [*fresh.named_parameters(), *fresh.named_buffers()]):
            a.copy_(value)


@pytest.fixture
def swap_on_conversion():
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(False)


MOVES: dict[str, Callable[[nn.Module], object]] = {
    "to_float64": lambda m: m.to(torch.float64),
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "half_then_float": lambda m: m.half().float(),
    "bfloat16": lambda m: m.bfloat16(),
    "cpu": lambda m: m.cpu(),
    "to_empty_reinit": lambda m: (m.to_empty(device="cpu"), re_init_in_place(m, local_global(6))),
}


@pytest.mark.parametrize("swap", [False, True], ids=["assign", "swap"])
@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_move_after_share_keeps_one_table_per_group(move: str, swap: bool, request) -> None:
    if swap:
        request.getfixturevalue("swap_on_conversion")
    model, reference = twins(local_global(6))
    backend = RopeDedupBackend("eager")
    share(model, backend=backend)
    ideal = distinct(model)
    MOVES[move](model), MOVES[move](reference)
    assert storages(model) == ideal == distinct(reference) < storages(reference)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=0)
    report = backend.report_for(model)
    assert sorted(m for g in report.groups for m in g.members) == sorted(name for name, _ in rope_tensors(model))
    assert not report.departed  # moved, not freed
    assert {g.key.dtype for g in report.groups} == {t.dtype for _, t in rope_tensors(model)}
    assert share(model, backend=backend).newly_shared == []  # nothing left to share again


def test_a_build_under_sharing_stays_shared_through_half() -> None:
    backend = RopeDedupBackend("eager")
    torch.manual_seed(0)
    with sharing(backend=backend):
        model = ToyDecoder(homogeneous(6)).eval()
    model.half()
    assert storages(model) == 2
    assert {str(g.key.dtype) for g in backend.report.groups} == {"torch.float16"}


def test_to_empty_then_re_init_by_assignment_is_shared_again_by_the_next_compiled_call() -> None:
    """torchtitan's init_weights assigns new tables: the aliases to_empty left are freed, and run-time interning
    shares the new ones on the next call."""
    model, reference = twins(homogeneous(4))
    backend = RopeDedupBackend("eager")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(TOKENS)
        model.to_empty(device="cpu")
        assert storages(model) == 2  # one uninitialized table per group, never four
        for (name, t), (_, value) in zip(list(model.named_parameters()), list(reference.named_parameters())):
            t.copy_(value)
        for layer, twin in zip(model.layers, reference.layers):
            layer.attention.rope.cos = twin.attention.rope.cos.clone()
            layer.attention.rope.sin = twin.attention.rope.sin.clone()
        assert storages(model) == 8
        torch.testing.assert_close(compiled(TOKENS), reference(TOKENS), rtol=0, atol=0)
    assert storages(model) == 2


def test_a_move_of_one_model_leaves_another_models_tables_where_they_were() -> None:
    first, second = twins(homogeneous(3))
    backend = RopeDedupBackend("eager")
    share(first, second, backend=backend)
    assert unique_storages([t for m in (first, second) for _, t in rope_tensors(m)])[0] == 2
    first.double()
    assert storages(first) == 2 and storages(second) == 2
    assert {t.dtype for _, t in rope_tensors(second)} == {torch.float32}
    with torch.no_grad():
        torch.testing.assert_close(second(TOKENS), copy.deepcopy(second)(TOKENS), rtol=0, atol=0)


def test_the_peak_of_a_move_holds_one_converted_table_per_group() -> None:
    """Allocator figures: the move's peak is the float64 weights plus one float64 table per group, and the
    bounded transient of recognizing each converted table once (at most 512 KiB here)."""
    specs = homogeneous(8, max_len=16384)
    model, reference = twins(specs)
    share(model, backend=RopeDedupBackend("eager"))  # a backend dropped at once: the tables stay tracked
    weights = sum(p.numel() * 8 for p in model.parameters())
    table = 16384 * 8 * 8  # (max_len, dim / 2) float64
    shared_peak = allocator_peak(lambda: model.to(torch.float64))
    plain_peak = allocator_peak(lambda: reference.to(torch.float64))
    assert shared_peak <= weights + 2 * table + (512 << 10)
    assert plain_peak >= weights + 16 * table
    assert storages(model) == 2


def test_build_on_cpu_share_then_to_cuda_puts_one_table_per_group_on_the_device(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("CUDA's allocator figures: ROPE_DEDUP_TEST_DEVICE=cuda")
    model, reference = twins(homogeneous(8, max_len=1 << 16))
    share(model, backend=RopeDedupBackend("eager"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model.to("cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table = (1 << 16) * 8 * 4
    assert torch.cuda.max_memory_allocated() - start <= weights + 2 * table + (1 << 20)
    assert storages(model) == 2
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS.cuda()).cpu(), reference(TOKENS), rtol=1e-5, atol=1e-5)


# --- swappable -------------------------------------------------------------------------------------

def compiled_whole(model: nn.Module, inner: str) -> None:
    with torch.no_grad():
        torch.compile(model, backend=RopeDedupBackend(inner))(TOKENS)


def compiled_per_block(model: nn.Module, inner: str) -> None:
    backend = RopeDedupBackend(inner)
    blocks = [torch.compile(block, backend=backend) for block in model.layers]
    with torch.no_grad():
        x = model.embed(TOKENS)
        for block in blocks:
            x = block(x)


DOORS: dict[str, Callable[[nn.Module], object]] = {
    "compile_eager": lambda m: compiled_whole(m, "eager"),
    "compile_aot_eager": lambda m: compiled_whole(m, "aot_eager"),
    "compile_inductor": lambda m: compiled_whole(m, "inductor"),
    "regional_inductor": lambda m: compiled_per_block(m, "inductor"),
    "share": lambda m: share(m, backend=RopeDedupBackend("eager")),
}


def every_tensor(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


# compile_inductor repeats regional_inductor and whole aot_eager in one 18 s cold compile: slow set.
@pytest.mark.parametrize("door", [pytest.param(d, marks=pytest.mark.slow) if d == "compile_inductor" else d
                                  for d in sorted(DOORS)])
def test_every_tensor_can_be_swapped_after(door: str) -> None:
    model, _ = twins(local_global(4) + homogeneous(2, layout="lazy_cache"))
    DOORS[door](model)
    for name, tensor in every_tensor(model):
        assert weakref.getweakrefs(tensor) == [], name
        twin = torch.zeros_like(tensor)
        torch.utils.swap_tensors(tensor, nn.Parameter(twin, tensor.requires_grad)
                                 if isinstance(tensor, nn.Parameter) else twin)
        assert not tensor.any(), name


def test_every_tensor_can_be_swapped_after_a_build_under_sharing() -> None:
    with sharing(backend=RopeDedupBackend("eager")):
        model = ToyDecoder(homogeneous(4)).eval()
    for name, tensor in every_tensor(model):
        assert weakref.getweakrefs(tensor) == [], name
        torch.utils.swap_tensors(tensor, tensor.clone() if not isinstance(tensor, nn.Parameter)
                                 else nn.Parameter(tensor.detach().clone()))


@pytest.mark.parametrize("door", sorted(DOORS))
def test_a_move_with_swap_on_conversion_after(door: str, swap_on_conversion) -> None:
    model, reference = twins(local_global(6))
    DOORS[door](model)
    model.to(torch.float64), reference.to(torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=0)
    assert storages(model) == distinct(reference)


def test_the_report_names_skipped_tensors_by_path_after_a_swap() -> None:
    """Skips are recorded by a path taken when each tensor is seen, and marks that hold no reference."""
    model, _ = twins(homogeneous(3, layout="lazy_cache"))
    backend = RopeDedupBackend("eager")
    blocks = [torch.compile(block, backend=backend) for block in model.layers]
    with torch.no_grad():
        x = model.embed(TOKENS)
        for block in blocks:
            x = block(x)
    skipped = {s.path for s in backend.report_for(model).skipped if "cached_freqs" in s.path}
    assert skipped == {f"layers.{i}.attention.rope.cached_freqs" for i in range(3)}
    for name, tensor in every_tensor(model):
        torch.utils.swap_tensors(tensor, tensor.clone() if not isinstance(tensor, nn.Parameter)
                                 else nn.Parameter(tensor.detach().clone()))
    assert {s.path for s in backend.report.skipped if "cached_freqs" in s.path} == {"attention.rope.cached_freqs"}
