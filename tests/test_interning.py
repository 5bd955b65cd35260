"""The check before each call of a compiled graph, both ways it is made: asking the store tensor by tensor
(a block's few tables) and comparing marks taken when the inputs were last found shared (many tables).
Whatever changes the inputs between calls must be seen the same way by both: a table replaced, refilled
in place, swapped, freed with its model; and nothing is offered again while nothing changed.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import build, compile_model, rope_storages
from torch._dynamo.utils import counters
from rope_dedup.testing.toy_decoder import homogeneous, local_global

import rope_dedup.interning
from rope_dedup import RopeDedupBackend

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
SPECS = local_global(6, every=3, max_len=64)
IDEAL = 4  # cos and sin for each of two thetas


@pytest.fixture(params=["store", "marks"])
def way(request, monkeypatch) -> str:
    """Every graph checks its inputs this way, whatever its number of watched inputs."""
    monkeypatch.setattr(rope_dedup.interning, "_MARKS_FROM", 1 if request.param == "marks" else 10**9)
    return request.param


def interned() -> int:
    return counters["rope_dedup"]["interned_at_runtime"]


def regional(model: torch.nn.Module) -> torch.nn.Module:
    """Per block, torchtitan's way: one graph for every block, fed each block's tables at run time."""
    return compile_model(model, RopeDedupBackend("eager"), regional=True)


def run_against(model: torch.nn.Module, reference: torch.nn.Module, calls: int = 1) -> None:
    with torch.no_grad():
        for _ in range(calls):
            torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=0)


def settle(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Two calls: the first interns the blocks after the first; the second finds them all shared (and
    takes the marks it compares later)."""
    run_against(model, reference, calls=2)


def rope_of(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    block = model.layers[layer]
    return getattr(block, "_orig_mod", block).attention.rope


def test_nothing_is_offered_again_while_nothing_changes(way: str) -> None:
    model = regional(build(SPECS))
    settle(model, build(SPECS))
    seen = interned()
    for _ in range(3):
        model(TOKENS)
    assert interned() == seen and rope_storages(model) == IDEAL


@pytest.mark.parametrize("change", ["replaced", "refilled by .data", "swapped"])
def test_a_changed_table_is_shared_again_on_the_next_call(way: str, change: str) -> None:
    model, reference = regional(build(SPECS)), build(SPECS)
    settle(model, reference)
    seen = interned()
    rope = rope_of(model, 4)
    fresh = rope.cos.clone()  # equal content, memory of its own
    if change == "replaced":
        rope.cos = fresh
    elif change == "refilled by .data":
        rope.cos.data = fresh  # the same tensor, other memory
    else:
        torch.utils.swap_tensors(rope.cos, fresh)
    assert rope_storages(model) == IDEAL + 1
    run_against(model, reference)
    assert interned() == seen + 1 and rope_storages(model) == IDEAL


def test_two_shared_tables_swapped_with_each_other_still_move_as_one(way: str) -> None:
    """A swap of two members of one group leaves ids and memory as they were, and each tensor with the
    other's record: the check must see the records no longer match, or a move copies each on its own."""
    model, reference = regional(build(SPECS)), build(SPECS)
    settle(model, reference)
    torch.utils.swap_tensors(rope_of(model, 0).cos, rope_of(model, 1).cos)  # both local (theta 1e4)
    run_against(model, reference)
    model.to(torch.float64)
    reference.to(torch.float64)
    run_against(model, reference)
    assert rope_storages(model) == IDEAL


def test_a_table_with_other_values_is_left_apart(way: str) -> None:
    model, reference = regional(build(SPECS)), build(SPECS)
    settle(model, reference)
    for module in (model, reference):
        rope = rope_of(module, 4)
        rope.cos = rope.cos * 2  # not a RoPE table any more: never shared, outputs follow it
    run_against(model, reference)
    assert rope_storages(model) == IDEAL + 1


def test_a_model_built_again_after_its_twin_was_freed_is_shared(way: str) -> None:
    """The same sizes come from the same free lists: the new model's tensors may sit where the old ones
    did, at the same ids, and the blocks' graph is reused for them. Their storages are new, and the check
    must see that."""
    backend = RopeDedupBackend("eager")
    model = compile_model(build(SPECS), backend, regional=True)
    settle(model, build(SPECS))
    del model
    gc.collect()
    again = compile_model(build(SPECS), backend, regional=True)
    run_against(again, build(SPECS))
    assert rope_storages(again) == IDEAL


def test_a_whole_model_of_many_tables_compares_marks() -> None:
    """Two tables a layer over sixteen layers: the whole model's graph takes the marks way on its own."""
    model = build(homogeneous(16, max_len=64))
    compiled = torch.compile(model, backend=RopeDedupBackend("inductor"))
    with torch.no_grad():
        before = compiled(TOKENS)
        compiled(TOKENS)
        seen = interned()
        model.layers[7].attention.rope.sin = model.layers[7].attention.rope.sin.clone()
        torch.testing.assert_close(compiled(TOKENS), before, rtol=0, atol=0)  # the same graph, inputs equal
        compiled(TOKENS)
    assert interned() == seen + 1 and rope_storages(model) == 2
