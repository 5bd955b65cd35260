"""Caches that a graph fills and later graphs only read (rotary-embedding-torch): shared while read, each
given its own storage right before a graph that writes it runs, shared again once only readers run."""

from __future__ import annotations

import pytest
import torch
from real_models import RotaryStack, unique_storages
from torch._dynamo.utils import counters

from rope_dedup import RopeDedupBackend, RopeKey
from rope_dedup.tables.keys import infer_key
from rope_dedup.tables.recognize import NotRope, RopeTable, recognize_rope_table
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous

pytest.importorskip("rotary_embedding_torch")


def tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, 128, (1, seq), generator=torch.Generator().manual_seed(seq))


def caches(model: torch.nn.Module) -> list[torch.Tensor]:
    return [layer.rotary_emb.cached_freqs for layer in model.layers]


def steps(model: torch.nn.Module, backend, lengths) -> list[tuple[torch.Tensor, int]]:
    """(output, storages of the caches) after each call of ``model`` compiled with ``backend``."""
    compiled = torch.compile(model, backend=backend)
    out = []
    with torch.no_grad():
        for seq in lengths:
            out.append((compiled(tokens(seq)), unique_storages(caches(model))))
    return out


# Fill 8 rows, read them, grow to 16 (writes again), read 16: each call its own graph.
LENGTHS = (8, 8, 16, 16, 16)


# aot_eager repeats eager's decisions through a second tracer (a dozen graphs): slow set.
@pytest.mark.parametrize("inner", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_filled_then_read_caches_share_and_unshare_before_each_write(inner: str) -> None:
    torch.manual_seed(0)
    plain = steps(RotaryStack(layers=4).eval(), inner, LENGTHS)
    plain_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = RotaryStack(layers=4).eval()
    backend = RopeDedupBackend(inner)
    dedup = steps(model, backend, LENGTHS)
    for (got, storages), (want, plain_storages) in zip(dedup, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert plain_storages == 4
    # The filling graphs leave 4 storages; the reading graphs share one. Growing writes into each own storage.
    assert [storages for _, storages in dedup] == [4, 1, 4, 1, 1]
    assert counters["stats"]["unique_graphs"] == plain_graphs
    group = next(g for g in backend.report_for(model).groups if g.key.filled)
    assert group.key.filled == 16 and group.key.length == 256
    assert group.members == [f"layers.{i}.rotary_emb.cached_freqs" for i in range(4)]
    assert "filled=16/256" in str(backend.report)


def test_a_reading_graph_shares_again_after_a_writing_graph_ran(monkeypatch) -> None:
    """Regional compile: one writing graph and one reading graph serve every block, alternating."""
    torch.manual_seed(0)
    model = RotaryStack(layers=3).eval()
    reference = RotaryStack(layers=3).eval()
    reference.load_state_dict(model.state_dict())
    backend = RopeDedupBackend("eager")
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend=backend)
    with torch.no_grad():
        for seq in LENGTHS:
            torch.testing.assert_close(model(tokens(seq)), reference(tokens(seq)), rtol=0, atol=0)
    assert unique_storages(caches(model)) == 1
    assert all(torch.equal(c, caches(reference)[0]) for c in caches(model))


@pytest.mark.parametrize("make", [
    lambda angles: angles.repeat_interleave(2, -1),  # rotary-embedding-torch: interleaved angles
    lambda angles: torch.cat([angles.cos(), angles.cos()], -1),  # HF halves
    lambda angles: torch.polar(torch.ones_like(angles), angles),  # complex freqs_cis
])
def test_a_partly_filled_cache_is_recognized_with_its_fill(make) -> None:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32)
    full = make(torch.outer(torch.arange(1024, dtype=torch.float32), inv_freq))
    cache = torch.zeros_like(full)
    cache[:100] = full[:100]
    table = recognize_rope_table(cache)
    assert isinstance(table, RopeTable) and (table.filled, table.length) == (100, 1024)
    key = infer_key(table, cache)
    assert key == RopeKey(10000, 32, 1024, cache.dtype, cache.device, key.layout, None, filled=100)
    assert key.layout == infer_key(recognize_rope_table(full), full).layout
    assert recognize_rope_table(full).filled is None


def test_empty_and_non_rope_prefixes_are_not_filled_caches() -> None:
    assert recognize_rope_table(torch.zeros(64, 8)) == NotRope("all zeros after position 0: a cache not filled yet")
    table = ToyDecoder(homogeneous(1, max_len=64)).layers[0].attention.rope.cos.clone()
    table[40:] = 0
    table[20] = torch.randn(table.shape[1])  # a filled prefix must itself be a table
    assert isinstance(recognize_rope_table(table), NotRope)
