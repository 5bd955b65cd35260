"""Caches a model re-registers in ``forward`` when a sequence outgrows them (transformers 4.x's
``_set_cos_sin_cache``; dynamic NTK rebuilds the same way): shared again on the next compiled call that
reads them, and never dropped from the report without a word when no compiled graph sees them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from real_models import unique_storages
from torch._dynamo.utils import counters

from rope_dedup import RopeDedupBackend

CACHED = 32  # the cache's first length (transformers: max_position_embeddings)


class RegrowingRotary(nn.Module):
    """transformers 4.44's ``Qwen2RotaryEmbedding``: a longer sequence re-registers both caches."""

    def __init__(self, dim: int = 16, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(CACHED)

    def _set_cos_sin_cache(self, seq_len: int) -> None:
        self.max_seq_len_cached = seq_len
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.rotary_emb = RegrowingRotary()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary_emb(x.shape[1])
        h = self.proj(x)
        half = torch.cat((-h[..., 8:], h[..., :8]), dim=-1)
        return x + h * cos + half * sin


class Stack(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def cos_storages(model: Stack) -> int:
    return unique_storages([layer.rotary_emb.cos_cached for layer in model.layers])


def run(model: Stack, backend, lengths) -> list[tuple[torch.Tensor, int]]:
    """(output, storages of the cos caches) after each call of ``model`` compiled with ``backend``."""
    compiled = torch.compile(model, backend=backend)
    out = []
    with torch.no_grad():
        for seq in lengths:
            x = torch.randn(1, seq, 16, generator=torch.Generator().manual_seed(seq))
            out.append((compiled(x), cos_storages(model)))
    return out


def twins() -> tuple[Stack, Stack]:
    torch.manual_seed(0)
    model = Stack().eval()
    torch.manual_seed(0)
    return model, Stack().eval()


def test_cache_regrown_in_a_compiled_graph_is_shared_on_the_next_call() -> None:
    model, plain = twins()
    lengths = (16, 16, 48, 48, 64, 64)
    want = run(plain, "eager", lengths)
    plain_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    backend = RopeDedupBackend("eager")
    got = run(model, backend, lengths)
    for (out, _), (expected, plain_storages) in zip(got, want):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # Each regrow is a graph whose outputs dynamo registers as new per-layer buffers (4 copies until the
    # next call); the call after reads them as inputs and shares them.
    assert [storages for _, storages in got] == [1, 1, 4, 1, 4, 1]
    assert counters["stats"]["unique_graphs"] == plain_graphs
    report = backend.report_for(model)
    cos = [g for g in report.groups if g.members[0].endswith("cos_cached")]
    assert [(g.key.length, len(g.members)) for g in cos] == [(64, 4)]
    assert report.departed == []  # each freed table's path holds a shared replacement: nothing to tell


def test_cache_regrown_while_dynamo_runs_the_frame_eagerly_is_reported() -> None:
    model, plain = twins()
    backend = RopeDedupBackend("eager")
    # Past the recompile limit (transformers 4.x generate reaches it: its cache's token counter is a
    # static int) dynamo runs forward eagerly: the regrow and the reads happen where no backend sees them.
    with torch._dynamo.config.patch(recompile_limit=1):
        got = run(model, backend, (16, 48, 48))
    want = run(plain, "eager", (16, 48, 48))
    for (out, _), (expected, _) in zip(got, want):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert [storages for _, storages in got] == [1, 4, 4]
    report = backend.report_for(model)
    assert not report.groups
    replaced = {d.path: d for d in report.departed}
    assert sorted(replaced) == [f"layers.{i}.rotary_emb.{t}_cached" for i in range(4) for t in ("cos", "sin")]
    assert all(d.replaced and d.replacement_bytes == 48 * 16 * 4 and d.key.length == CACHED
               for d in replaced.values())
    text = str(report)
    assert "freed after sharing 8:" in text and "replaced by a tensor with its own storage (24.6 KB in all)" in text
    # Without the model the report cannot see the replacements, but still names what was freed.
    assert "freed: the owner dropped or replaced it" in str(backend.report)


@pytest.mark.parametrize("drop", [True, False])
def test_dropping_the_model_is_reported_as_freed(drop: bool) -> None:
    model, _ = twins()
    backend = RopeDedupBackend("eager")
    run(model, backend, (16,))
    assert len(backend.report.groups) == 2
    if drop:
        del model
    report = backend.report
    assert sorted(d.path for d in report.departed) == ([f"layers.{i}.rotary_emb.{t}_cached" for i in range(4)
                                                        for t in ("cos", "sin")] if drop else [])
    assert all(not d.replaced and d.times == 1 for d in report.departed)
