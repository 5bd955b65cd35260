"""Shared tables whose storage dies: the store never reads, joins or hands out a canonical table whose storage
was freed or shrunk in place. Before, the second model below crashed the process (a segmentation fault in
the equality check), so it runs in a child process: the suite reports a crash instead of dying with it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


from rope_dedup.core.eligibility import SkipReason
from rope_dedup.core.store import CanonicalStore
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors

FREED_THEN_ANOTHER_MODEL = textwrap.dedent("""
    import torch
    from rope_dedup import RopeDedupBackend
    from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors

    backend = RopeDedupBackend("eager")
    tokens = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        first = ToyDecoder(homogeneous(4)).eval()
        torch.compile(first, backend=backend)(tokens)
        for _, table in rope_tensors(first):  # offloading / sleep mode: storages freed in place
            table.untyped_storage().resize_(0)
        torch.manual_seed(1)
        second = ToyDecoder(homogeneous(4)).eval()
        reference = ToyDecoder(homogeneous(4)).eval()
        reference.load_state_dict(second.state_dict())
        out = torch.compile(second, backend=backend)(tokens)
    torch.testing.assert_close(out, reference(tokens), rtol=0, atol=0)
    print(len({t.untyped_storage().data_ptr() for _, t in rope_tensors(second)}),
          sorted({name.rsplit(".", 1)[-1] for name in backend.store.departed}))
""")


def test_a_freed_canonical_is_dropped_and_the_next_equal_table_takes_its_place() -> None:
    child = subprocess.run([sys.executable, "-c", FREED_THEN_ANOTHER_MODEL], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-3000:]}"
    assert child.stdout.split(None, 1) == ["2", "['cos', 'sin']\n"]


def test_a_freed_table_offered_is_skipped_without_a_read() -> None:
    store = CanonicalStore()
    table = rope_tensors(ToyDecoder(homogeneous(1)))[0][1]
    table.untyped_storage().resize_(0)
    assert store.offer(table, name="cos").refusal.reason is SkipReason.FREED


def test_a_canonical_moved_to_meta_is_never_handed_out() -> None:
    store = CanonicalStore()
    first, second = ToyDecoder(homogeneous(2)), ToyDecoder(homogeneous(2))
    [store.offer(table, name=name) for name, table in rope_tensors(first)]  # no loop variable left holding one
    assert len({t.data_ptr() for _, t in rope_tensors(first)}) == 2
    first.to("meta")  # every module's table replaced by a meta one: the shared ones are collected
    assert {store.offer(t, name=name).action.name for name, t in rope_tensors(first)} == {"SKIP"}
    assert [store.offer(t, name=name).action.name for name, t in rope_tensors(second)] == ["NEW", "NEW", "JOIN", "JOIN"]
    assert set(store.departed) == {name for name, _ in rope_tensors(first)}


def test_a_storage_freed_in_place_stays_freed_when_the_store_looks_at_it() -> None:
    """The store reads a canonical table through a tensor it sets onto the storage; set_ grows a storage
    that is too small, so a look at a freed one (sleep mode) would have given it back its bytes, garbage."""
    store = CanonicalStore()
    first, second = ToyDecoder(homogeneous(1)), ToyDecoder(homogeneous(1))
    (_, table), (_, twin) = rope_tensors(first)[0], rope_tensors(second)[0]
    store.offer(table, name="a.cos")
    table.untyped_storage().resize_(0)
    assert store.offer(twin, name="b.cos").action.name == "NEW"  # the freed one is not compared, not joined
    assert table.untyped_storage().nbytes() == 0
    assert set(store.departed) == {"a.cos"}
