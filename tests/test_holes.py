"""The holes of issue 39: a second store, reloads into tables shared at run time, and the class around them
(weak pointers read under threads, refusals never revisited, -0.0 equal to +0.0, pointers of two devices).
Each case compares with the same model without rope_dedup, under ``aot_eager``."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch
from helpers import WritesItsTable

import rope_dedup
from rope_dedup import RopeDedupBackend
from rope_dedup.core.eligibility import SkipReason
from rope_dedup.core.store import CanonicalStore
from rope_dedup.interning import InterningCallable
from rope_dedup.core.sources import WatchedInput
from rope_dedup.tensors import TensorMark, same_values
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, homogeneous, rope_tensors, unique_storages

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def storages(model: torch.nn.Module) -> int:
    return unique_storages([t for _, t in rope_tensors(model)])[0]


def writing_model() -> ToyDecoder:
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(4, max_len=64))
    for i, block in enumerate(model.layers):
        model.layers[i] = WritesItsTable(block)
    return model


def regional(model: ToyDecoder, backend) -> ToyDecoder:
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend)
    return model


def test_a_second_store_does_not_let_a_write_reach_what_share_shared() -> None:
    """share() shares with the default store; a graph of another backend that writes one table must give
    it its own storage first, in the store that shared it."""
    ours, plain = writing_model(), writing_model()
    rope_dedup.share(ours)
    assert storages(ours) == 2
    regional(ours, RopeDedupBackend(inner="aot_eager"))
    regional(plain, "aot_eager")
    for _ in range(3):
        torch.testing.assert_close(ours(TOKENS), plain(TOKENS), rtol=0, atol=0)
    cos = [t for name, t in rope_tensors(ours) if name.endswith("cos")]
    assert len({t.untyped_storage().data_ptr() for t in cos}) == len(cos)  # each written cos on its own


def test_unshare_asks_every_store() -> None:
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(4, max_len=64))
    rope_dedup.share(model, backend=RopeDedupBackend())
    assert storages(model) == 2
    released = rope_dedup.unshare(model)  # no backend named: the one that shared is found all the same
    assert len(released) == 8 and storages(model) == 8
    rope_dedup.share(model)
    assert storages(model) == 8  # never shared again, by any store
    with pytest.warns(DeprecationWarning):
        rope_dedup.unshare(model, rope_dedup.rope_dedup_backend)


def persistent_decoder(theta3: float | None = None) -> ToyDecoder:
    torch.manual_seed(0)
    return ToyDecoder([TableRecipe(max_len=64, persistent=True,
                                   theta=theta3 if theta3 is not None and i == 3 else 1e4) for i in range(6)])


def test_a_reload_into_tables_shared_at_run_time_keeps_the_checkpoint(caplog) -> None:
    model = regional(persistent_decoder(), RopeDedupBackend(inner="aot_eager", share_persistent=True))
    model(TOKENS)
    assert storages(model) == 2  # blocks 1-5 joined at run time
    checkpoint = persistent_decoder(theta3=1e6).state_dict()
    plain = persistent_decoder()
    plain.load_state_dict(checkpoint)
    with caplog.at_level(logging.INFO, logger="rope_dedup"):
        model.load_state_dict({k: checkpoint[k.replace("_orig_mod.", "")] for k in model.state_dict()}, strict=True)
    assert torch.equal(model.layers[3]._orig_mod.attention.rope.cos, checkpoint["layers.3.attention.rope.cos"])
    torch.testing.assert_close(model(TOKENS), plain(TOKENS), rtol=0, atol=0)
    assert storages(model) == 4  # block 3's own pair, the others still one pair
    assert "layers.3._orig_mod.attention.rope.cos" in caplog.text


def test_a_saved_table_whose_module_cannot_be_found_is_not_shared() -> None:
    """A run-time offer of a persistent table whose owning module no frame leads to is refused, not shared
    unguarded."""
    store = CanonicalStore(share_persistent=True)
    tables = [t for _, t in rope_tensors(persistent_decoder())]
    callable_ = InterningCallable(lambda *args: None, store, {0: WatchedInput("rope.cos", None, True, None)}, [])
    for table in tables[::2]:
        callable_(table)
    assert unique_storages(tables[::2])[0] == 6
    assert store.skipped["rope.cos"].reason is SkipReason.UNGUARDED


def test_bitwise_equality_tells_minus_zero_from_zero() -> None:
    a = torch.outer(torch.arange(16.0), torch.ones(4)).sin()  # row 0 is +0.0
    b = a.clone()
    b[0] = -0.0
    assert torch.equal(a, b) and not same_values(a, b)
    assert same_values(torch.view_as_complex(torch.stack([a, a], -1)), torch.view_as_complex(torch.stack([a, a], -1)))
    store = CanonicalStore()
    tables = [torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, 16, 2) / 16)).sin() for _ in range(2)]
    tables[1][0] = -0.0
    for i, table in enumerate(tables):
        store.offer(table, name=f"l{i}.sin")
    assert unique_storages(tables)[0] == 2  # never merged


def test_a_refusal_for_content_is_revisited_once_the_tensor_is_written() -> None:
    """A cache refused while it is zeros is offered again once filled in place (zeros first, the table
    later), not remembered as refused forever."""
    store = CanonicalStore()
    callable_ = InterningCallable(lambda *args: None, store, {0: WatchedInput("rope.cos", None, False)}, [])
    filled = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, 16, 2) / 16)).cos()
    canonical, late = filled.clone(), torch.zeros(64, 8)
    callable_(canonical)
    callable_(late)
    assert store.skipped["rope.cos#1"].reason is SkipReason.NOT_ROPE if "rope.cos#1" in store.skipped else True
    late.copy_(filled)
    callable_(late)
    assert late.untyped_storage().data_ptr() == canonical.untyped_storage().data_ptr()
    mark = TensorMark(late)  # a mark for identity alone does not care about writes (unshare's exclusions)
    late.mul_(1)
    assert mark.matches(late)


def test_the_store_maps_memory_by_device_and_address() -> None:
    """Addresses of two devices may coincide (a host and a device allocator's; every meta tensor's is 0): the
    store's map from memory to group, and the pass's grouping of nodes by memory, hold the device too."""
    from rope_dedup.tensors import memory_key

    store = CanonicalStore()
    table = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, 16, 2) / 16)).cos()
    store.offer(table, name="a.cos")
    store.offer(table.clone(), name="b.cos")
    assert list(store._ptrs) == [(table.device, table.data_ptr())]
    assert memory_key(torch.empty(3, device="meta")) != memory_key(torch.empty(0))  # both at address 0


def test_threads_report_while_others_intern() -> None:
    """Reports built while other threads intern (regional compile, new blocks on every call) never see a
    dict change size under them."""
    backend = RopeDedupBackend(inner="eager")
    errors: list[BaseException] = []
    stop = threading.Event()

    def intern() -> None:
        try:
            for seed in range(12):
                torch.manual_seed(seed)
                model = regional(ToyDecoder(homogeneous(6, max_len=64)).eval(), backend)
                with torch.no_grad():
                    model(TOKENS)
        except BaseException as error:
            errors.append(error)
        finally:
            stop.set()

    def report() -> None:
        try:
            while not stop.is_set():
                str(backend.report)
                backend.store.departed
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=intern), threading.Thread(target=report), threading.Thread(target=report)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    assert not errors, errors
