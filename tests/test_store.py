"""The store decides without changing anything, then applies: plans per case, and a dry run moves nothing."""

from __future__ import annotations

import pytest
import torch

from rope_dedup.core.eligibility import SkipReason
from rope_dedup.core.store import Action, CanonicalStore


def table(theta: float = 1e4, length: int = 64, dim: int = 16) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    return torch.outer(torch.arange(length, dtype=torch.float32), freqs).cos()


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_decide_changes_nothing_and_apply_does_what_it_said() -> None:
    store = CanonicalStore()
    first, twin, other = table(), table(), table(theta=1e6)
    plans = [store.decide(t) for t in (first, twin, other)]
    assert [p.action for p in plans] == [Action.NEW] * 3  # nothing applied yet: no group to join
    assert store.snapshot() == [] and store.skipped == {}
    assert len({ptr(first), ptr(twin), ptr(other)}) == 3

    store.apply(plans[0], first, "a.cos")
    join = store.decide(twin)
    assert join.action is Action.JOIN and ptr(twin) != ptr(first)  # decided, not yet shared
    store.apply(join, twin, "b.cos")
    assert ptr(twin) == ptr(first)
    assert store.decide(twin).action is Action.KNOWN
    assert store.offer(other, name="c.cos").action is Action.NEW
    assert [len(live) for _, live, _ in store.snapshot()] == [2, 1]


@pytest.mark.parametrize("tensor, written, persistent, reason", [
    (torch.nn.Parameter(table()), None, False, SkipReason.TRAINABLE),
    (table().requires_grad_(), None, False, SkipReason.REQUIRES_GRAD),
    (table(), "setitem", False, SkipReason.WRITTEN),
    (table(), None, True, SkipReason.PERSISTENT),
    (torch.randn(64, 8), None, False, SkipReason.NOT_ROPE),
    (torch.empty(64, 8, device="meta"), None, False, SkipReason.META),
])
def test_every_skip_has_its_reason_kind(tensor, written, persistent, reason) -> None:
    store = CanonicalStore()
    plan = store.decide(tensor, written=written, persistent=persistent)
    assert plan.action is Action.SKIP and plan.refusal.reason is reason
    store.apply(plan, tensor, "t")
    assert store.skipped["t"] == plan.refusal
    assert plan.refusal.message.startswith(reason.value.split("{")[0])


def test_a_member_written_by_a_new_graph_is_released_first() -> None:
    store = CanonicalStore()
    first, twin = table(), table()
    store.offer(first, name="a.cos")
    store.offer(twin, name="b.cos")
    plan = store.decide(twin, written="setitem")
    assert plan.action is Action.SKIP and plan.release_first and plan.refusal.reason is SkipReason.WRITTEN
    assert ptr(twin) == ptr(first)
    store.apply(plan, twin, "b.cos")
    assert ptr(twin) != ptr(first) and torch.equal(twin, first)


def test_a_dry_run_records_the_same_groups_and_moves_no_storage() -> None:
    dry, real = CanonicalStore(dry_run=True), CanonicalStore()
    tables = {name: (table(), table()) for name in ("a.cos", "b.cos", "c.cos")}
    before = {name: ptr(pair[0]) for name, pair in tables.items()}
    for name, (for_dry, for_real) in tables.items():
        assert dry.offer(for_dry, name=name).action is real.offer(for_real, name=name).action
    assert {name: ptr(pair[0]) for name, pair in tables.items()} == before
    assert len({ptr(pair[1]) for pair in tables.values()}) == 1
    assert [[m.name for m in live] for _, live, _ in dry.snapshot()] == \
        [[m.name for m in live] for _, live, _ in real.snapshot()]
