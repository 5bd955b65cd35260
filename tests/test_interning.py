"""The check before each call of a compiled graph, for a block's few tables (regional compile) and a whole
model's many. Whatever changes the inputs between calls must be seen: a table replaced, refilled in place,
swapped, a plain attribute swapped, a model freed and built again; a settled graph that only reads asks the
store nothing; graphs that write or merge their tables check on every call.
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import WritesItsTable, build, compile_model, rope_storages
from torch._dynamo.utils import counters
from rope_dedup.testing.toy_decoder import homogeneous, local_global

import rope_dedup
from rope_dedup import RopeDedupBackend
from rope_dedup.interning import InterningCallable

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
SPECS = local_global(18, every=3, max_len=64)  # whole: 36 tables
IDEAL = 4  # cos and sin for each of two thetas


@pytest.fixture(params=["regional", "whole"])
def way(request) -> str:
    """How the model is compiled: per block (one graph fed every block's tables) or whole (one graph
    reading every table: more than 32)."""
    return request.param


# Whole-model compiles of 36 tables take 9 to 21 s each on 2 cold cores. These tests keep their regional case
# in the fast suite and their whole case in the slow set, where the other whole cases here stay fast.
WHOLE_SLOW = pytest.mark.parametrize("way", ["regional", pytest.param("whole", marks=pytest.mark.slow)])


def interned() -> int:
    return counters["rope_dedup"]["interned_at_runtime"]


def compiled(model: torch.nn.Module, way: str, backend: RopeDedupBackend | None = None) -> torch.nn.Module:
    return compile_model(model, backend or RopeDedupBackend("eager"), regional=way == "regional")


def run_against(model: torch.nn.Module, reference: torch.nn.Module, calls: int = 1) -> None:
    with torch.no_grad():
        for _ in range(calls):
            torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=0)


def settle(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Two calls: the first interns the blocks after the first; the second finds them all shared."""
    run_against(model, reference, calls=2)


@pytest.fixture
def narrow_schedule(monkeypatch) -> None:
    """A widest schedule of 8 rounds, not 64: what waits longest is found the same way, in 8x fewer calls."""
    monkeypatch.setattr(rope_dedup.interning, "_WIDEST", 8)


def settle_fully(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Calls until every graph skips the widest schedule: what is checked next waits longest there."""
    run_against(model, reference, calls=4 * rope_dedup.interning._WIDEST)


def rope_of(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    model = getattr(model, "_orig_mod", model)
    block = model.layers[layer]
    return getattr(block, "_orig_mod", block).attention.rope


@WHOLE_SLOW
def test_nothing_is_offered_again_while_nothing_changes(way: str) -> None:
    model = compiled(build(SPECS), way)
    settle(model, build(SPECS))
    seen = interned()
    for _ in range(3):
        model(TOKENS)
    assert interned() == seen and rope_storages(model) == IDEAL


def calls_until_shared(model: torch.nn.Module, reference: torch.nn.Module, ideal: int) -> int:
    """Steps (one call of each block) until the model's tables are down to ``ideal`` again, outputs checked
    on each; fails past the widest schedule."""
    for step in range(1, 2 * rope_dedup.interning._WIDEST + 2):
        run_against(model, reference)
        if rope_storages(model) == ideal:
            return step
    raise AssertionError(f"not shared again within {step} steps")


def test_a_buffer_replaced_is_shared_again_on_the_next_call(way: str, narrow_schedule) -> None:
    """Assigning a buffer goes through torch's registration hook: every graph looks at its next call."""
    model, reference = compiled(build(SPECS), way), build(SPECS)
    settle_fully(model, reference)
    seen = interned()
    rope = rope_of(model, 4)
    rope.cos = rope.cos.clone()  # equal content, memory of its own
    assert rope_storages(model) == IDEAL + 1
    run_against(model, reference)
    assert interned() == seen + 1 and rope_storages(model) == IDEAL


@pytest.mark.parametrize("change", ["refilled by .data", "swapped", "plain attribute"])
def test_memory_changed_unseen_by_hooks_is_shared_within_the_widest_schedule(way: str, change: str,
                                                                            narrow_schedule) -> None:
    """``.data =`` and ``swap_tensors`` keep the tensor object, and a plain attribute (GPT-J's embed_positions)
    has no registration hook: no epoch moves, and the next sweep finds them, at most ``_WIDEST`` rounds on."""
    specs = homogeneous(18, max_len=64, layout="gptj") if change == "plain attribute" else SPECS
    model, reference = compiled(build(specs), way), build(specs)
    settle_fully(model, reference)
    ideal = rope_storages(model)
    seen = interned()
    rope = rope_of(model, 4)
    name = "embed_positions" if change == "plain attribute" else "cos"
    fresh = getattr(rope, name).clone()
    if change == "refilled by .data":
        rope.cos.data = fresh  # the same tensor, other memory
    elif change == "swapped":
        torch.utils.swap_tensors(rope.cos, fresh)
    else:
        rope.embed_positions = fresh
    assert rope_storages(model) == ideal + 1
    assert calls_until_shared(model, reference, ideal) <= rope_dedup.interning._WIDEST + 1
    assert interned() == seen + 1


@WHOLE_SLOW
def test_two_shared_tables_swapped_with_each_other_still_move_as_one(way: str) -> None:
    """A swap of two members of one group leaves ids and memory as they were, and each tensor with the
    other's record: the check must see the records no longer match, or a move copies each on its own."""
    model, reference = compiled(build(SPECS), way), build(SPECS)
    settle(model, reference)
    torch.utils.swap_tensors(rope_of(model, 0).cos, rope_of(model, 1).cos)  # both local (theta 1e4)
    run_against(model, reference)
    model.to(torch.float64)
    reference.to(torch.float64)
    run_against(model, reference)
    assert rope_storages(model) == IDEAL


def test_a_table_with_other_values_is_left_apart(way: str) -> None:
    model, reference = compiled(build(SPECS), way), build(SPECS)
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
    model = compiled(build(SPECS), way, backend)
    settle(model, build(SPECS))
    del model
    gc.collect()
    again = compiled(build(SPECS), way, backend)
    run_against(again, build(SPECS))
    assert rope_storages(again) == IDEAL




@WHOLE_SLOW
def test_a_settled_graph_that_only_reads_looks_on_few_calls(way: str, monkeypatch) -> None:
    """Sweeps at 2, 4, ... 64 rounds apart: over 200 steps, a few percent of the calls look at all. Whole
    under inductor, whose graphs read their tables apart (other inner backends merge them, and graphs with
    merged inputs look at every call)."""
    model = compiled(build(SPECS), way, RopeDedupBackend("inductor" if way == "whole" else "eager"))
    with torch.no_grad():  # settles (inductor's outputs are not eager's, bit for bit)
        model(TOKENS)
        model(TOKENS)
    looks = []
    for callable_ in [found for found in gc.get_objects() if type(found) is InterningCallable]:
        monkeypatch.setattr(callable_, "_unshared",  # the look: which watched inputs the store does not know
                            lambda *a, _unshared=callable_._unshared: looks.append(1) or _unshared(*a))
    with torch.no_grad():
        for _ in range(200):
            model(TOKENS)
    calls = 200 * (len(SPECS) if way == "regional" else 1)  # whole: one graph call a step
    assert 0 < len(looks) <= calls // 16, (len(looks), calls)


@pytest.mark.slow  # 17 s; test_holes.py keeps a graph that writes after share() (per block) in the fast suite
def test_a_whole_graph_that_writes_a_table_checks_every_call() -> None:
    """Many tables, one written: each call gives it its own storage again if share() shared it since."""
    def writing() -> torch.nn.Module:
        model = build(homogeneous(18, max_len=64))
        model.layers[3] = WritesItsTable(model.layers[3])
        return model

    ours, plain = writing(), writing()
    ours_compiled = torch.compile(ours, backend=RopeDedupBackend("aot_eager"))
    plain_compiled = torch.compile(plain, backend="aot_eager")
    with torch.no_grad():
        for _ in range(3):
            rope_dedup.share(ours)  # shares the written cos with the others between calls
            torch.testing.assert_close(ours_compiled(TOKENS), plain_compiled(TOKENS), rtol=0, atol=0)


@pytest.mark.slow  # 21 s; test_backend.py's test_replaced_table_falls_back_to_unmerged_graph keeps the fallback
def test_a_whole_graph_with_merged_tables_checks_every_call() -> None:
    """Merged inputs (an inner backend other than inductor) are compared on every call, settled or not: a
    table replaced by other values runs the graph without the merge."""
    model, reference = compiled(build(SPECS), "whole"), build(SPECS)
    settle(model, reference)
    fallbacks = counters["rope_dedup"]["fallbacks"]
    for module in (model, reference):
        rope = rope_of(module, 4)
        rope.cos.data = rope.cos * 2  # in place of its memory: no registration hook sees it
    run_against(model, reference, calls=2)
    assert counters["rope_dedup"]["fallbacks"] == fallbacks + 1


def test_the_registration_hook_moves_the_epoch_without_a_graph_break() -> None:
    """transformers 4.x re-registers its caches inside forward: dynamo traces the hook that moves the epoch
    (a lock there would break the graph), and the move happens when the compiled forward runs."""
    from torch._dynamo.testing import CompileCounter

    from rope_dedup.core.store import EPOCH

    class Regrows(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.ones(4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > self.cache.shape[0]:
                self.register_buffer("cache", torch.ones(x.shape[0]), persistent=False)
            return x * self.cache[: x.shape[0]]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(Regrows(), backend=CompileCounter())
    compiled(torch.randn(2))
    before = EPOCH.now
    compiled(torch.randn(8))
    assert EPOCH.now > before
    assert not counters["graph_break"]
