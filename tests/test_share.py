"""Sharing without compiling: ``share(model)`` in eager and ``with sharing():`` while a model is built, through
the backend's store and its rules. Each test here failed before (neither existed)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.module import _global_buffer_registration_hooks

import rope_dedup
from rope_dedup import RopeDedupBackend, share, sharing
from rope_dedup.core.eligibility import SkipReason
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, homogeneous, local_global, rope_tensors, unique_storages
from rope_dedup.tensors import same_values

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def storages(*models: nn.Module) -> int:
    return unique_storages([t for m in models for _, t in rope_tensors(m)])[0]


def distinct_tables(model: nn.Module) -> int:
    """One storage per distinct table: share() sees every table, also those no forward reads (original_inv_freq)."""
    seen: list[torch.Tensor] = []
    for _, t in rope_tensors(model):
        if not any(u.dtype == t.dtype and u.shape == t.shape and same_values(u, t) for u in seen):
            seen.append(t)
    return len(seen)


def twins(specs: list[TableRecipe], **kwargs) -> tuple[nn.Module, nn.Module]:
    """A model and an unshared copy of it with the same weights."""
    torch.manual_seed(0)
    model = ToyDecoder(specs, **kwargs).eval()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("layout", ["cos_sin", "hf_halves", "titan_cos_sin", "complex", "stacked", "gptj", "inv_freq"])
def test_share_reaches_the_ideal_with_bitwise_outputs(layout: str) -> None:
    model, reference = twins(local_global(6, layout=layout))
    ideal = distinct_tables(model)
    report = share(model, backend=RopeDedupBackend("eager"))
    assert storages(model) == ideal < storages(reference)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=0)
    assert report.newly_shared and report.bytes_saved > 0


def test_a_second_share_changes_nothing_and_says_so() -> None:
    model = ToyDecoder(homogeneous(4)).eval()
    backend = RopeDedupBackend("eager")
    first = share(model, backend=backend)
    pointers = [t.data_ptr() for _, t in rope_tensors(model)]
    second = share(model, backend=backend)
    assert len(first.newly_shared) == 6 and second.newly_shared == []  # 4 cos + 4 sin: 3 + 3 join the first
    assert "shared nothing new" in str(second)
    assert [t.data_ptr() for _, t in rope_tensors(model)] == pointers


def test_persistent_buffers_only_on_request_and_a_dry_run_moves_nothing() -> None:
    class Persistent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            inv = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
            self.register_buffer("cos", torch.outer(torch.arange(64).float(), inv).cos())

    model = nn.ModuleList([Persistent() for _ in range(3)])
    report = share(model, backend=RopeDedupBackend("eager"))
    assert len({m.cos.data_ptr() for m in model}) == 3
    assert {s.kind for s in report.skipped} == {SkipReason.PERSISTENT}

    dry = share(model, backend=RopeDedupBackend("eager"), share_persistent=True, dry_run=True)
    assert len({m.cos.data_ptr() for m in model}) == 3 and len(dry.groups) == 1
    share(model, backend=RopeDedupBackend("eager"), share_persistent=True)
    assert len({m.cos.data_ptr() for m in model}) == 1


def test_share_then_compile_keeps_the_storages_and_one_report_covers_both() -> None:
    model, reference = twins(homogeneous(4))
    backend = RopeDedupBackend("eager")
    share(model, backend=backend)
    pointers = {t.untyped_storage().data_ptr() for _, t in rope_tensors(model)}
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(TOKENS)
        torch.testing.assert_close(out, reference(TOKENS), rtol=0, atol=0)
    assert {t.untyped_storage().data_ptr() for _, t in rope_tensors(model)} == pointers
    assert backend.graphs_compiled == 1 and len(backend.report.groups) == 2


def test_several_models_share_one_table_each_report_names_its_own() -> None:
    policy, ref_model, reward = (ToyDecoder(homogeneous(4)).eval() for _ in range(3))
    backend = RopeDedupBackend("eager")
    share(policy, ref_model, backend=backend)
    share(reward, backend=backend)
    assert storages(policy, ref_model, reward) == 2
    members = {m for g in backend.report_for(reward).groups for m in g.members}
    assert "layers.3.attention.rope.cos" in members


@pytest.mark.parametrize("filled, reason", [(1, SkipReason.NOT_ROPE), (4, SkipReason.FILLING)])
def test_a_cache_filled_on_demand_is_not_shared_and_outputs_stay_exact(filled: int, reason: SkipReason) -> None:
    """rotary-embedding-torch's pattern: rows written by the forward that needs them. With only row 0 written,
    every theta's cache holds the same values; later forwards fill the rest, per layer."""
    specs = local_global(4, layout="filled_cache", max_len=64)
    model, reference = twins(specs)
    short, long = TOKENS[:, :filled], torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(short), reference(short)
        report = share(model, backend=RopeDedupBackend("eager"))
        torch.testing.assert_close(model(long), reference(long), rtol=0, atol=0)
    skipped = {s.path: s for s in report.skipped}
    assert skipped["layers.0.attention.rope.filled_freqs"].kind is reason
    if reason is SkipReason.FILLING:
        assert "4 of 64 positions written" in skipped["layers.0.attention.rope.filled_freqs"].reason
    assert len({t.data_ptr() for name, t in rope_tensors(model) if name.endswith("filled_freqs")}) == 4


def test_meta_tables_are_skipped_with_a_reason_then_shared_after_init() -> None:
    with torch.device("meta"):
        model = ToyDecoder(homogeneous(4))
    backend = RopeDedupBackend("eager")
    report = share(model, backend=backend)
    assert not report.groups
    assert {s.reason for s in report.skipped if s.kind is SkipReason.META} == {SkipReason.META.value}
    assert "share after the tables are initialized" in SkipReason.META.value
    model.to_empty(device="cpu")
    with torch.no_grad():  # init_weights: every table filled in place with its values
        for (_, table), (_, value) in zip(rope_tensors(model), rope_tensors(ToyDecoder(homogeneous(4)))):
            table.copy_(value)
    share(model, backend=backend)
    assert storages(model) == 2


def test_bad_input() -> None:
    with pytest.raises(TypeError, match="share\\(\\) takes nn.Module objects, got str"):
        share("model")
    with pytest.raises(TypeError, match="at least one"):
        share()
    with pytest.raises(TypeError, match="unknown setting"):
        share(nn.Linear(2, 2), inner="eager")
    report = share(nn.Linear(2, 2), backend=RopeDedupBackend("eager"))
    assert not report.groups and "no RoPE table found" in str(report)


def test_sharing_shares_at_registration_and_leaves_other_buffers_alone() -> None:
    class Counters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(64, 8), persistent=False)
            self.register_buffer("scale", torch.ones(64, 8), persistent=False)

    hooks = len(_global_buffer_registration_hooks)
    with sharing(backend=RopeDedupBackend("eager")) as block:
        model = ToyDecoder(local_global(6)).eval()
        counters = nn.ModuleList([Counters() for _ in range(3)])
    assert len(_global_buffer_registration_hooks) == hooks
    assert storages(model) == distinct_tables(model) == 4
    assert len({c.steps.data_ptr() for c in counters}) == 3 and len({c.scale.data_ptr() for c in counters}) == 3
    assert len(block.report_for(model).groups) == 4


def test_sharing_gives_persistent_buffers_back_and_lists_unseen_attributes() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            angles = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
            self.register_buffer("saved", angles.cos())  # persistent
            self.table = angles.sin()  # a plain attribute: the hook never sees it

    with sharing(backend=RopeDedupBackend("eager")) as block:
        model = nn.ModuleList([Mixed() for _ in range(3)])
    assert len({m.saved.data_ptr() for m in model}) == 3
    skipped = {s.path: s.kind for s in block.report_for(model).skipped}
    assert skipped["0.table"] is SkipReason.UNSEEN_ATTRIBUTE
    assert skipped["0.saved"] is SkipReason.PERSISTENT


def test_sharing_used_wrongly_fails_clearly_and_the_hook_goes_on_an_exception() -> None:
    hooks = len(_global_buffer_registration_hooks)
    block = sharing(backend=RopeDedupBackend("eager"))
    with pytest.raises(ValueError, match="boom"):
        with block:
            raise ValueError("boom")
    assert len(_global_buffer_registration_hooks) == hooks
    with pytest.raises(RuntimeError, match="already entered"):
        with block:
            pass
    with pytest.raises(RuntimeError, match="without being active"):
        block.__exit__(None, None, None)
    with sharing(backend=RopeDedupBackend("eager")):
        with pytest.raises(RuntimeError, match="do not nest"):
            with sharing(backend=RopeDedupBackend("eager")):
                pass
    assert len(_global_buffer_registration_hooks) == hooks


def test_the_public_names() -> None:
    assert rope_dedup.share is share and rope_dedup.sharing is sharing


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_failure_midway_leaves_nothing_half_shared(k: int, monkeypatch) -> None:
    """An exception at the k-th storage re-point: the tables before it are shared, the rest their own, and
    outputs are those of the unshared model."""
    import rope_dedup.core.store as store_module

    model, reference = twins(local_global(6))
    calls = {"n": 0}
    real = store_module._share_storage

    def failing(mine: torch.Tensor, canonical: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == k:
            raise MemoryError("injected")
        real(mine, canonical)

    monkeypatch.setattr(store_module, "_share_storage", failing)
    with pytest.raises(MemoryError, match="injected"):
        share(model, backend=RopeDedupBackend("eager"))
    for (_, table), (_, original) in zip(rope_tensors(model), rope_tensors(reference)):
        assert same_values(table, original)  # each table reads its own values, shared or not
    assert storages(model) == storages(reference) - (k - 1)
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=0)


MOVES = {
    "double": lambda m: m.to(torch.float64),
    "half": lambda m: m.half(),
    "cpu": lambda m: m.cpu(),
    "to_empty": lambda m: m.to_empty(device="cpu"),
}


@pytest.mark.parametrize("move", sorted(MOVES))
def test_moves_after_share_keep_outputs_exact_and_stay_shared(move: str) -> None:
    """A move converts one table per group (rope_dedup/core/moves.py): outputs stay those of the unshared model
    moved the same way, the tables stay at the ideal, and a second share() has nothing left to share."""
    model, reference = twins(local_global(4))
    backend = RopeDedupBackend("eager")
    share(model, backend=backend)
    MOVES[move](model), MOVES[move](reference)
    if move == "to_empty":  # init_weights: the same values into both
        with torch.no_grad():
            for (_, a), (_, b), (_, value) in zip(model.state_dict(keep_vars=True).items(),
                                                  reference.state_dict(keep_vars=True).items(),
                                                  ToyDecoder(local_global(4)).state_dict().items()):
                a.copy_(value), b.copy_(value)
            for (_, a), (_, b), (_, value) in zip(rope_tensors(model), rope_tensors(reference),
                                                  rope_tensors(ToyDecoder(local_global(4)))):
                a.copy_(value), b.copy_(value)
    tokens = TOKENS
    assert storages(model) == distinct_tables(model) == 4
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
        again = share(model, backend=backend)
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
    assert storages(model) == distinct_tables(model) == 4
    assert again.newly_shared == [] and not again.departed


def test_a_model_moved_to_meta_departs_and_its_tables_are_skipped() -> None:
    model = ToyDecoder(homogeneous(4)).eval()
    backend = RopeDedupBackend("eager")
    share(model, backend=backend)
    model.to("meta")
    report = share(model, backend=backend)
    assert not report.groups and not report.newly_shared
    assert {s.kind for s in report.skipped if "rope" in s.path} == {SkipReason.META}
    assert {d.path for d in report.departed} == {name for name, _ in rope_tensors(model)}
