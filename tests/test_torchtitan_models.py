"""rope_dedup on torchtitan 0.3.0's llama3 and deepseek_v3 (tiny, random init; see tests/torchtitan_models.py).

Per-block compile the way torchtitan compiles (its own ``apply_compile``: each ``TransformerBlock`` compiled
in place with ``fullgraph=True``, one backend instance for all blocks; the trainer's order: build on meta,
compile, ``to_empty``, ``init_weights``), and whole-model compile. Each against the same compile without
the pass: RoPE storages before and after against the ideal (1), outputs bitwise equal, the same frames
compiled at the same calls (recompiles counted with ``CompileCounterWithBackend``).

Inner backend ``aot_eager``: torchtitan's language models attend with flex attention (``sdpa`` is refused
for them, ``varlen`` is CUDA/bf16 only), and on CPU torch 2.13's inductor cannot lower llama3's flex call:
the CPU flex template (``cpp_flex_attention_template.choose_flex_template``) unpacks the query's
underlying buffer as 4-D, but ComplexRoPE's query is ``view_as_real(...).flatten(3)``, a view of a 5-D
buffer -> ``LoweringException: too many values to unpack`` (pinned by
``test_cpu_inductor_cannot_lower_llama3_flex_attention``). deepseek_v3's query is a ``cat`` and lowers, but
its first call compiles for ~90 s on 2 CPU cores: that case is in the slow set.

Install (torchtitan is not in the ``test`` extra; the tests skip without it): see tests/torchtitan_models.py.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
from real_models import LAYERS, RealCase, unique_storages
from test_real_models import check_report
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torchtitan_models import build, import_torchtitan, init_weights, restore_torch

from rope_dedup import RopeDedupBackend

pytestmark = pytest.mark.filterwarnings(
    # deepseek_v3's MoE enters a bf16 autocast region on CPU with fp32 weights: torch warns once per call.
    "ignore:In CPU autocast, but the target dtype is not supported:UserWarning")

MODELS = ["llama3", "deepseek_v3"]
CALLS = 2  # the first compiles, the second must compile nothing (no lazily built tables here)
# Frames compiled per-block, from the block classes: llama3's two blocks are alike (one graph serves both);
# deepseek_v3's layer 0 is dense and layer 1 MoE, so the guard on ``self._modules['feed_forward']`` fails
# once and the MoE block gets its own graph.
PER_BLOCK_FRAMES = {"llama3": 1, "deepseek_v3": 2}


@pytest.fixture(scope="module")
def titan():
    from torch._subclasses.fake_tensor import FakeTensorMode

    original = FakeTensorMode.__init__
    yield import_torchtitan()
    restore_torch(original)


@pytest.fixture
def dynamo_flags():
    """torchtitan's ``apply_compile`` sets two dynamo flags process-wide (``capture_scalar_outputs`` for
    MoE's data-dependent dispatch): set them as it does, and give the old values back after the test."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


@dataclass
class Run:
    outputs: list[torch.Tensor]
    frames: list[int]  # frames compiled so far, after each call
    graphs: list[int]  # counters["stats"]["unique_graphs"] after each call
    storages: list[int]  # unique storages behind the RoPE tables after each call
    before: int  # ... before the first call


def calls(case: RealCase, model: Callable, counter: CompileCounterWithBackend, run: Run) -> None:
    with torch.no_grad():
        for _ in range(CALLS):
            run.outputs.append(model(*case.example_inputs))
            run.frames.append(counter.frame_count)
            run.graphs.append(counters["stats"]["unique_graphs"])
            run.storages.append(unique_storages(t for _, t in case.rope_tensors(case.model)))


def apply_compile(titan, model: torch.nn.Module, backend, monkeypatch) -> None:
    """torchtitan's own ``apply_compile`` with our backend. By name (``CompileConfig(backend="rope_dedup")``)
    it refuses any backend but inductor/aot_eager for flex models (see the test below), so the one function
    that picks the backend is patched to hand ours over; the rest (flags, ``block.compile(backend=...,
    fullgraph=True)`` per block) is torchtitan's code."""
    monkeypatch.setattr(titan.compile, "_maybe_regional_inductor_backend", lambda model, name: backend)
    titan.compile.apply_compile(model, compile_config=titan.config.CompileConfig(enable=True, backend="rope_dedup"),
                                parallel_dims=SimpleNamespace(tp_enabled=False))


def per_block_run(titan, name: str, backend_for: Callable, monkeypatch, inner: str = "aot_eager"):
    """Trainer order: build on meta, compile every block, ``to_empty`` + ``init_weights``, call; then
    ``to_empty`` + ``init_weights`` again (new per-module tables, same values) and call again."""
    counter = CompileCounterWithBackend(inner)
    backend = backend_for(counter)
    case = build(titan, name, on_meta=True)
    apply_compile(titan, case.model, backend, monkeypatch)
    runs = []
    for _ in range(2):
        case.model.to_empty(device="cpu")
        init_weights(case.model)
        case.model.eval()
        run = Run([], [], [], [], unique_storages(t for _, t in case.rope_tensors(case.model)))
        calls(case, case.model, counter, run)
        runs.append(run)
    return case, backend, runs


def reset() -> None:
    torch._dynamo.reset()
    counters.clear()


def check_against_plain(got: list[Run], want: list[Run], frames: int | None) -> None:
    for mine, plain in zip(got, want):
        for a, b in zip(mine.outputs, plain.outputs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # bitwise vs the compile without the pass
        assert mine.frames == plain.frames and mine.graphs == plain.graphs  # same compiles, same calls
        assert plain.before == LAYERS and plain.storages == [LAYERS] * CALLS  # one table per layer
        assert mine.before == LAYERS and mine.storages == [1] * CALLS  # the ideal from the first call on
    if frames is not None:
        assert got[-1].frames[-1] == frames


@pytest.mark.parametrize("name", MODELS)
def test_per_block_compile_as_torchtitan_does(titan, name: str, monkeypatch, dynamo_flags) -> None:
    _, _, plain = per_block_run(titan, name, lambda counter: counter, monkeypatch)
    reset()
    case, backend, got = per_block_run(titan, name, RopeDedupBackend, monkeypatch)
    check_against_plain(got, plain, PER_BLOCK_FRAMES[name])
    check_report(case, backend.report_for(case.model), share_persistent=False)
    # No freqs_cis is passed in: each block's own buffer is a graph input. Where one graph serves both
    # blocks (llama3) block 1's table is first seen when it runs, so interning does the sharing; after
    # the re-init every block's new table is interned at run time.
    interned = counters["rope_dedup"]["interned_at_runtime"]
    assert interned == {"llama3": 1 + LAYERS, "deepseek_v3": LAYERS}[name]
    # The report counts the tables alive now: the first round's are garbage, but on deepseek_v3 dynamo's
    # tracing state (a SideEffects object) keeps them in reference cycles until a collection.
    gc.collect()
    assert backend.report.bytes_after * LAYERS == backend.report.bytes_before


@pytest.mark.parametrize("name", MODELS)
def test_whole_model_compile(titan, name: str, dynamo_flags) -> None:
    def whole_run(backend_for: Callable) -> tuple[RealCase, object, Run]:
        counter = CompileCounterWithBackend("aot_eager")
        backend = backend_for(counter)
        case = build(titan, name)
        run = Run([], [], [], [], unique_storages(t for _, t in case.rope_tensors(case.model)))
        calls(case, torch.compile(case.model, backend=backend), counter, run)
        return case, backend, run

    _, _, plain = whole_run(lambda counter: counter)
    reset()
    case, backend, got = whole_run(RopeDedupBackend)
    check_against_plain([got], [plain], None)
    assert got.frames[-1] == got.frames[0]  # nothing recompiles after the first call
    check_report(case, backend.report_for(case.model), share_persistent=False)


def test_backend_by_name_is_refused_for_flex_models(titan, dynamo_flags) -> None:
    """torchtitan 0.3.0's ``--compile.backend rope_dedup`` cannot be used with its language models: they
    attend with flex attention, and ``_maybe_regional_inductor_backend`` accepts only ``inductor`` and
    ``aot_eager`` for those. Compile the blocks with ``RopeDedupBackend("aot_eager")`` (as above) instead."""
    case = build(titan, "llama3", on_meta=True)
    config = titan.config.CompileConfig(enable=True, backend="rope_dedup")
    with pytest.raises(ValueError, match="neither 'inductor' nor 'aot_eager'"):
        titan.compile.apply_compile(case.model, compile_config=config, parallel_dims=SimpleNamespace(tp_enabled=False))


@pytest.mark.slow  # ~10 s on 2 CPU cores; a check on torch, not on rope_dedup
def test_cpu_inductor_cannot_lower_llama3_flex_attention(titan, dynamo_flags) -> None:
    """Why the tests above use aot_eager: inductor alone, without rope_dedup, fails on llama3 on CPU."""
    case = build(titan, "llama3")
    for block in case.model.layers.values():
        block.compile(backend="inductor", fullgraph=True)
    with pytest.raises(Exception, match="too many values to unpack"), torch.no_grad():
        case.model(*case.example_inputs)


@pytest.mark.slow  # ~2.5 min on 2 CPU cores: each run compiles two MLA graphs (dense, MoE) with inductor
def test_deepseek_v3_per_block_inductor(titan, monkeypatch, dynamo_flags) -> None:
    """deepseek_v3's flex query is a ``cat`` (a 4-D buffer), which CPU inductor lowers. Outputs close to
    inductor alone, not bitwise: the rewritten graph may fuse differently (see README)."""
    _, _, plain = per_block_run(titan, "deepseek_v3", lambda counter: counter, monkeypatch, inner="inductor")
    reset()
    case, backend, got = per_block_run(titan, "deepseek_v3", RopeDedupBackend, monkeypatch, inner="inductor")
    for mine, want in zip(got, plain):
        for a, b in zip(mine.outputs, want.outputs):
            torch.testing.assert_close(a, b)
        assert mine.frames == want.frames and mine.graphs == want.graphs
        assert (mine.before, mine.storages) == (LAYERS, [1] * CALLS)
    check_report(case, backend.report_for(case.model), share_persistent=False)
