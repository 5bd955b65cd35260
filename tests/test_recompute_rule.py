"""A recomputed table behaves as the plain table it replaces, or raises an error that says so.

Each test holds a model converted by ``share(model, tables="recompute")`` against an unconverted twin with the
same weights, does one thing a user does to a table (train through it, read past its end, point it elsewhere,
write through a view, change its metadata in place, patch its checkpoint entry, hand it to a second module,
write it from a second thread, keep rows a compiled graph returned), and compares. The whole op surface is
proved by tests/test_recompute_ops.py; these are the uses met in the field, one test each.
"""

from __future__ import annotations

import copy
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rope_dedup
from rope_dedup.recompute import RecomputedTable
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous

pytestmark = pytest.mark.filterwarnings("ignore:rope_dedup. recomputed table:UserWarning")

TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def twins(layout: str = "cos_sin", layers: int = 1, **spec) -> tuple[nn.Module, nn.Module]:
    """(converted, plain) decoders with the same weights."""
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(layers, layout=layout, **spec)).eval()
    twin = copy.deepcopy(model)
    rope_dedup.share(model, tables="recompute")
    return model, twin


def rope(model: nn.Module, layer: int = 0) -> nn.Module:
    return model.layers[layer].attention.rope


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same values (bit for bit), shape, strides of dims longer than 1, and conj/neg bits."""
    strides = [(s, st) for s, st in zip(a.shape, a.stride()) if s > 1]
    return (a.shape == b.shape and a.dtype == b.dtype and a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg()
            and strides == [(s, st) for s, st in zip(b.shape, b.stride()) if s > 1]
            and torch.equal(a.resolve_conj().resolve_neg() * 1, b.resolve_conj().resolve_neg() * 1))


def table_values(table: torch.Tensor) -> torch.Tensor:
    return table.values() if isinstance(table, RecomputedTable) else table


# -- 1. training: the conj bit of rows, and every gradient ------------------------------------------------------

def test_rows_keep_the_conj_bit_and_eager_training_gets_the_plain_gradients():
    """The backward of ``x * freqs_cis[:T]`` multiplies by the rows' conjugate: rows that dropped the conj bit
    gave wrong gradients in eager (aot_eager traced through decompositions and was right)."""
    model, twin = twins("complex", layers=2)
    rows, plain = rope(model).freqs_cis[:5], rope(twin).freqs_cis[:5]
    assert same(rows.conj(), plain.conj()) and same(rows.conj().imag, plain.conj().imag)
    model.train(), twin.train()
    for m in (model, twin):
        m(TOKENS).square().mean().backward()
    for (name, got), (_, want) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(got.grad, want.grad), name


# -- 2. positions past the table raise, as they did -----------------------------------------------------------

READS_PAST_THE_END = {
    "index": lambda t, p: t[p],
    "index_select": lambda t, p: t.index_select(0, p),
    "embedding": lambda t, p: F.embedding(p, t),
}


@pytest.mark.parametrize("position", ["length", "below minus length", "negative"])
@pytest.mark.parametrize("read", READS_PAST_THE_END.values(), ids=READS_PAST_THE_END.keys())
def test_a_position_past_the_table_raises_index_error_as_the_plain_table_does(read, position):
    model, twin = twins()
    table, plain = rope(model).cos, rope(twin).cos
    at = {"length": len(plain), "below minus length": -len(plain) - 1, "negative": -1}[position]
    positions = torch.tensor([3, at])
    try:
        expected = read(plain, positions)
    except IndexError:
        with pytest.raises(IndexError, match="cos"):  # torch's message, and which table
            read(table, positions)
    else:
        assert torch.equal(read(table, positions), expected)  # -1 counts from the end where torch lets it


def test_select_past_the_table_raises_index_error():
    model, twin = twins()
    for index in (len(rope(twin).cos), -len(rope(twin).cos) - 1):
        with pytest.raises(IndexError):
            rope(twin).cos.select(0, index)
        with pytest.raises(IndexError, match="out of range"):
            rope(model).cos.select(0, index)


class Lookup(nn.Module):
    """Reads its table at the positions it is given: a model run past its configured context."""

    def __init__(self, length: int = 64) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
        self.register_buffer("cos", torch.outer(torch.arange(length, dtype=torch.float32), inv_freq).cos(),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.cos[positions] * 2


@pytest.mark.parametrize("door", ["share then compile", "backend", "dynamic"])
def test_a_compiled_read_past_the_table_fails_where_the_plain_compiled_model_fails(door):
    """The plain compiled model fails on a position past its table (inductor asserts on indirect indexing): the
    recomputed one has an assert in its graph that inductor keeps."""
    inside, outside = torch.tensor([1, 63]), torch.tensor([1, 64])
    torch._dynamo.reset()
    plain = torch.compile(Lookup(), backend="inductor", dynamic=door == "dynamic")
    expected = plain(inside)
    with pytest.raises(Exception):
        plain(outside)
    model = Lookup()
    if door == "backend":
        compiled = torch.compile(model, backend=rope_dedup.RopeDedupBackend(tables="recompute"))
    else:
        rope_dedup.share(model, tables="recompute")
        compiled = torch.compile(model, backend="inductor", dynamic=door == "dynamic")
    torch._dynamo.reset()
    torch.testing.assert_close(compiled(inside), expected)  # inductor's cos, not eager's: within its difference
    assert isinstance(model.cos, RecomputedTable)
    with pytest.raises(Exception, match="outside \\[-64, 64\\) of a RoPE table"):
        compiled(outside)


def test_an_exported_read_past_the_table_fails_as_the_exported_plain_table_does():
    positions = torch.tensor([1, 63])
    ep = torch.export.export(Lookup(), (positions,))
    recomputed = rope_dedup.dedup_exported(ep, tables="recompute")
    assert recomputed.graph_signature.input_specs[0].target.endswith("inv_freq")  # no table constant left
    assert torch.equal(recomputed.module()(positions), ep.module()(positions))
    with pytest.raises(IndexError):
        ep.module()(torch.tensor([1, 64]))
    with pytest.raises(Exception, match="outside \\[-64, 64\\) of a RoPE table"):
        recomputed.module()(torch.tensor([1, 64]))


# -- 3 to 5. what a table views: .data, set_, views that are not rows, metadata changed in place -----------------

REPOINTS = {
    ".data =": lambda t, new: setattr(t, "data", new),
    "set_": lambda t, new: t.set_(new),
}


@pytest.mark.parametrize("repoint", REPOINTS.values(), ids=REPOINTS.keys())
def test_pointing_a_table_at_other_memory_is_what_the_model_reads(repoint):
    model, twin = twins()
    for m in (model, twin):
        new = torch.full_like(rope(twin).cos[:20], 0.5)
        repoint(rope(m).cos, new)
        new.mul_(2)  # the table reads that memory now: a later write to it shows
    assert same(rope(model).cos[:20], rope(twin).cos[:20])
    assert torch.equal(model(TOKENS), twin(TOKENS))


WRITES_THROUGH_VIEWS = {
    "transpose": lambda t: t.T.mul_(2),
    "flat view": lambda t: t.view(-1)[:5].zero_(),
    "columns": lambda t: t[:, :4].zero_(),
    "diagonal": lambda t: t.diagonal().fill_(3.0),
    "unbind": lambda t: t.unbind(1)[2].add_(1),
    "as_strided": lambda t: t.as_strided((4, 2), (1, 8), 3).mul_(-1),
}


@pytest.mark.parametrize("write", WRITES_THROUGH_VIEWS.values(), ids=WRITES_THROUGH_VIEWS.keys())
def test_a_write_through_any_view_lands_in_the_table(write):
    model, twin = twins()
    for m in (model, twin):
        write(rope(m).cos)
    assert torch.equal(table_values(rope(model).cos), rope(twin).cos)
    assert torch.equal(model(TOKENS), twin(TOKENS))


METADATA_IN_PLACE = {
    "unsqueeze_": lambda t: t.unsqueeze_(1),
    "t_": lambda t: t.t_(),
    "transpose_": lambda t: t.transpose_(0, 1),
    "squeeze_ after unsqueeze_": lambda t: t.unsqueeze_(0).squeeze_(0),
    "resize_ smaller": lambda t: t.resize_(40, 8),
    "resize_ larger": lambda t: t.resize_(80, 8),
    "as_strided_": lambda t: t.as_strided_((32, 8), (16, 1)),
}


@pytest.mark.parametrize("change", METADATA_IN_PLACE.values(), ids=METADATA_IN_PLACE.keys())
def test_metadata_changed_in_place_is_what_the_table_is(change):
    model, twin = twins()
    table, plain = rope(model).cos, rope(twin).cos
    for t in (table, plain):
        assert change(t) is t
    assert (table.shape, table.stride(), table.storage_offset()) == (plain.shape, plain.stride(),
                                                                      plain.storage_offset())
    if plain.numel() > 64 * 8:  # the rows resize_ adds hold whatever memory held: compare the rows before
        table, plain = table[:64], plain[:64]
    assert same(table[:9], plain[:9]) and torch.equal(table_values(table), plain)


@pytest.mark.parametrize("change", ["resize_ smaller", "as_strided_"])
def test_a_model_reads_its_table_as_changed_in_place(change):
    model, twin = twins()
    for m in (model, twin):
        METADATA_IN_PLACE[change](rope(m).cos)
    assert torch.equal(model(TOKENS), twin(TOKENS))


def test_a_table_that_is_not_contiguous_keeps_its_strides_and_its_views_torchs():
    """HF's matmul route leaves a transposed table (strides (1, L)): its views, and the guards a compiled graph
    builds on it, see those strides."""
    model, twin = twins(route="matmul")
    table, plain = rope(model).cos, rope(twin).cos
    assert table.stride() == plain.stride() != (8, 1)
    for read in (lambda t: t[2:9], lambda t: t[3], lambda t: t[1:12:3], lambda t: t.T, lambda t: t[:, 1:3],
                 lambda t: t[4:10] * 2, lambda t: t[None]):
        assert same(read(table), read(plain))
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        plain[:4].view(-1)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        table[:4].view(-1)
    compiled = rope_dedup.RopeDedupBackend("eager", tables="recompute")
    torch._dynamo.reset()
    _, fresh = twins(route="matmul")
    assert torch.equal(torch.compile(fresh, backend=compiled)(TOKENS), twin(TOKENS))


# -- 6. state_dict entries are the table's memory ---------------------------------------------------------------

def test_a_write_through_a_state_dict_entry_reaches_the_model():
    """``sd[k].copy_(v)`` patches a checkpoint in place: torch's entries alias the buffers."""
    model, twin = twins(persistent=True, layers=2)
    key = "layers.1.attention.rope.cos"
    for m in (model, twin):
        entries = m.state_dict()
        assert type(entries[key]) is torch.Tensor  # a plain tensor: torch.save and safetensors write its values
        entries[key].copy_(entries[key] * 0.5)
        assert torch.equal(m.state_dict()[key], entries[key])  # entries alias each other, as torch's do
    assert torch.equal(table_values(rope(model, 1).cos), rope(twin, 1).cos)
    assert torch.equal(model(TOKENS), twin(TOKENS))
    assert rope(model, 0).cos.is_recomputed  # an entry written with the values it held changes nothing


def test_state_dict_entries_written_with_their_own_values_leave_the_table_recomputed():
    model, _ = twins(persistent=True)
    entries = model.state_dict()
    entries["layers.0.attention.rope.cos"].add_(0)
    assert rope(model).cos.is_recomputed and torch.equal(model(TOKENS), model(TOKENS))


# -- 7 and 8. every holder, and the builder's own reference ------------------------------------------------------

class Shares(nn.Module):
    """A model that hands its table to a second module, which registers the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Lookup(), nn.Module()
        self.second.register_buffer("cos", self.first.cos, persistent=False)


@pytest.mark.parametrize("door", ["share", "sharing"])
def test_holders_of_one_table_hold_one_table_after_converting(door):
    if door == "share":
        model = Shares()
        rope_dedup.share(model, tables="recompute")
    else:
        with rope_dedup.sharing(tables="recompute"):
            model = Shares()
    assert isinstance(model.first.cos, RecomputedTable) and model.second.cos is model.first.cos
    model.second.cos[:2].zero_()
    assert torch.equal(model.first.cos[:2], torch.zeros(2, 8))


class ScalesAfterRegistering(nn.Module):
    """A builder that scales its table through its own reference after registering it (YaRN's mscale, say)."""

    def __init__(self) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
        cos = torch.outer(torch.arange(512, dtype=torch.float32), inv_freq).cos()
        self.register_buffer("cos", cos, persistent=False)
        cos.mul_(1.25)
        cos[:, :2].zero_()


def test_a_builder_writing_its_own_reference_inside_sharing_reaches_the_table():
    with rope_dedup.sharing(tables="recompute") as block:
        model = ScalesAfterRegistering()
    plain = ScalesAfterRegistering()
    assert torch.equal(table_values(model.cos), plain.cos)
    kept = [s.reason for s in block.report_for(model).skipped if "builder's own reference" in s.reason]
    assert len(kept) == 1 and not block.report_for(model).recomputed


# -- 9. threads ----------------------------------------------------------------------------------------------

def test_threads_that_write_disjoint_rows_keep_every_write():
    for _ in range(10):
        model, twin = twins(max_len=4096)
        table = rope(model).cos
        go = threading.Barrier(4)

        def write(row: int) -> None:
            go.wait()
            table[row:row + 1].fill_(7.0)

        threads = [threading.Thread(target=write, args=(row,)) for row in (0, 1000, 2000, 3000)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert all(bool((table[row] == 7.0).all()) for row in (0, 1000, 2000, 3000))


# -- 10. rows a compiled graph returns are views of the table ------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_rows_a_compiled_graph_returns_see_a_later_eager_write(backend):
    model, twin = twins()
    for m in (model, twin):
        torch._dynamo.reset()
        table = rope(m).cos
        rows = torch.compile(lambda: table[2:6], backend=backend)()
        table.mul_(2)
        assert torch.equal(rows * 1, table_values(table)[2:6])


# -- 11. numpy, tolist, storage -------------------------------------------------------------------------------

def test_numpy_shares_memory_and_tolist_reads_values():
    model, twin = twins()
    table, plain = rope(model).cos, rope(twin).cos
    assert table[:3].tolist() == plain[:3].tolist() and table.tolist() == plain.tolist()
    for t in (table, plain):
        t.numpy()[0, :] = 5.0  # shares memory with the table, as torch's does: the table holds its values now
    assert np.array_equal(np.asarray(table), plain.numpy())
    assert not table.is_recomputed and float(table[0, 3]) == 5.0


def test_a_recomputed_table_holds_no_storage_until_written():
    model, _ = twins()
    table = rope(model).cos
    assert table.data_ptr() == 0  # documented: no bytes to point at
    with pytest.raises(RuntimeError, match="invalid python storage"):  # a placeholder of the table's size
        table.untyped_storage().data_ptr()
    assert table.untyped_storage().nbytes() == table.nbytes
    table[:1].mul_(1)
    assert table.materialized is not None and table.materialized.data_ptr() != 0


# -- a forward that writes its own table ----------------------------------------------------------------------

@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
def test_a_forward_that_writes_its_own_table_compiles_and_computes_what_eager_computes(regional):
    """Each block scales its own cos in place, then reads it: the trace that meets the write gives every block's
    table of that name its values (as the first eager call would), the frame breaks at the write, and later calls
    compile nothing more."""
    from helpers import WritesItsTable, compile_model
    from torch._dynamo.utils import counters

    model, twin = twins(layers=4)
    for m in (model, twin):
        for i, block in enumerate(m.layers):
            m.layers[i] = WritesItsTable(block)
    torch._dynamo.reset()
    counters.clear()
    compiled = compile_model(model, "aot_eager", regional)
    with torch.no_grad():
        assert torch.equal(compiled(TOKENS), twin(TOKENS))
        graphs = counters["stats"]["unique_graphs"]
        for _ in range(2):
            assert torch.equal(compiled(TOKENS), twin(TOKENS))
    assert counters["stats"]["unique_graphs"] == graphs
    written = [getattr(b, "_orig_mod", b).block.attention.rope.cos for b in model.layers]
    assert all(isinstance(t, RecomputedTable) and not t.is_recomputed for t in written)


# -- the rule's error, where a view no longer leads to its table --------------------------------------------------

def test_writing_rows_cut_off_from_their_table_says_how_to_write_tables():
    rows = RecomputedTable.__tensor_unflatten__({"rows": torch.ones(2, 4)}, ("rows", 0), None, None)
    with pytest.raises(RuntimeError, match=r"mul_ writes a view of a recomputed table .* rope_dedup.unshare"):
        rows.mul_(2)


def test_data_with_another_dtype_says_what_to_do():
    model, _ = twins()
    with pytest.raises(RuntimeError, match=r"cannot change its dtype or device in place; call rope_dedup.unshare"):
        rope(model).cos.data = torch.zeros(4, dtype=torch.float64)


def test_no_warning_for_what_reads_rows():
    model, twin = twins(layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(TOKENS), twin(TOKENS))
