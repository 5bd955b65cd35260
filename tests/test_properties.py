"""Property-based tests: random decoders, and the promises that must hold for every one of them.

For each generated model: outputs identical to the same compile without the pass (bitwise, inductor
included); unique RoPE storages equal an ideal computed here from construction; caches written
on every call keep their own storage; caches filled by the first call and only read after it (partly
filled: the rest are zeros) are shared like any table; no extra graphs on repeated calls; every table
the graphs read is shared or skipped with a reason. A third path shares without compiling
(``rope_dedup.share`` after a forward): eager outputs bitwise equal to the unshared model, storages at the
ideal of share()'s rules. ``ROPE_DEDUP_PROPERTY_EXAMPLES`` sets the number of examples over the three
inner backends (default 100: 50 eager, 40 aot_eager, 10 inductor; the long run uses 500+), plus 3/10 of it
for share().
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import build, compile_model, unwrap
from torch._dynamo.utils import counters
from ideal import ideal_storages
from rope_dedup.toy_decoder import FILLED_LAYOUTS, LAYOUTS, SCALINGS, TableRecipe, rope_tensors

from rope_dedup import RopeDedupBackend, share
from rope_dedup.tensors import same_values

EXAMPLES = int(os.environ.get("ROPE_DEDUP_PROPERTY_EXAMPLES", "100"))
SEQ = 8


@st.composite
def rope_specs(draw) -> TableRecipe:
    return TableRecipe(
        layout=draw(st.sampled_from(LAYOUTS + FILLED_LAYOUTS)),
        theta=draw(st.sampled_from([1e4, 5e5, 1e6, 12345.0])),
        rotary_dim=draw(st.sampled_from([None, 8])),
        max_len=draw(st.sampled_from([16, 64])),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        scaling=draw(st.sampled_from(SCALINGS)),
        factor=draw(st.sampled_from([4.0, 8.0])),
    )


@st.composite
def decoders(draw, inner: str):
    distinct = draw(st.lists(rope_specs(), min_size=1, max_size=3))
    layers = draw(st.lists(st.sampled_from(distinct), min_size=1, max_size=5))
    return {
        "specs": layers,
        "graph_break": draw(st.booleans()),
        "regional": draw(st.booleans()),
        "inner": inner,
        "seed": draw(st.integers(0, 2**16)),
    }


def written(name: str) -> bool:
    return name.endswith("cached_freqs")


def read_by_forward(name: str) -> bool:
    return not name.endswith("original_inv_freq")


def moving_frequencies(tensor: torch.Tensor) -> int:
    """Distinct columns whose values change with position: fewer than 2 and no theta can be told from them.

    Short bf16/fp16 tables of a large theta round every slow column to its position-0 value."""
    if tensor.dim() == 1:
        return tensor.numel()  # inv_freq: no positions to move along
    x = torch.view_as_real(tensor) if tensor.is_complex() else tensor
    x = x.reshape([s for s in x.shape if s != 1]).flatten(1)
    moving = x[:, (x != x[0]).any(0)]
    return len({tuple(column.tolist()) for column in moving.T})


def keeps_every_promise(case) -> None:
    tokens = [torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(i)) for i in range(2)]

    torch._dynamo.reset()
    counters.clear()
    plain_model = build(case["specs"], case["seed"], case["graph_break"])
    plain = compile_model(plain_model, case["inner"], case["regional"])
    expected = [plain(t) for t in tokens]
    plain_graphs = counters["stats"]["unique_graphs"]
    # From the model run without the pass: filled caches hold their content only after a forward.
    ideal = ideal_storages(unwrap(plain_model), keeps_own=lambda t: moving_frequencies(t) < 2)

    torch._dynamo.reset()
    counters.clear()
    model = build(case["specs"], case["seed"], case["graph_break"])
    fills = {name: t.clone() for name, t in rope_tensors(model) if written(name)}
    backend = RopeDedupBackend(case["inner"])
    compiled = compile_model(model, backend, case["regional"])
    outputs = [compiled(t) for t in tokens]
    outputs.append(compiled(tokens[0]))
    model = unwrap(model)

    for got, want in zip(outputs, expected + expected[:1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == plain_graphs
    tables = rope_tensors(model)
    assert len({t.untyped_storage().data_ptr() for _, t in tables}) == ideal
    written_ptrs = [t.untyped_storage().data_ptr() for name, t in tables if written(name)]
    assert len(set(written_ptrs)) == len(written_ptrs)
    for name, t in tables:
        if written(name):
            assert t.shape == fills[name].shape  # filled in place by forward, never re-pointed

    report = backend.report_for(model)
    shared = {m for g in report.groups for m in g.members}
    skipped = {s.path: s.reason for s in report.skipped}
    for name, _ in tables:
        if read_by_forward(name):
            assert name in shared or name in skipped, name
    assert all(reason for reason in skipped.values())
    assert not report.errors


def filled_on_demand(name: str) -> bool:
    return name.endswith(("cached_freqs", "filled_freqs"))


def share_keeps_every_promise(case) -> None:
    """share() in eager: filled-on-demand caches (never full here: SEQ < max_len) and tables with fewer than
    two moving frequencies keep their own storage; every other distinct table is stored once, including
    ``original_inv_freq``, which no forward reads but share() sees."""
    tokens = [torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reference = build(case["specs"], case["seed"], case["graph_break"])
    model = build(case["specs"], case["seed"], case["graph_break"])
    with torch.no_grad():
        expected = [reference(tokens[0])]
        outputs = [model(tokens[0])]
        report = share(model, backend=RopeDedupBackend("eager"))
        expected.append(reference(tokens[1]))
        outputs.append(model(tokens[1]))
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    own, distinct = 0, []
    for name, t in rope_tensors(reference):
        if filled_on_demand(name) or moving_frequencies(t) < 2:
            own += 1
        elif not any(u.dtype == t.dtype and u.shape == t.shape and same_values(u, t) for u in distinct):
            distinct.append(t)
    assert len({t.untyped_storage().data_ptr() for _, t in rope_tensors(model)}) == own + len(distinct)
    shared = {m for g in report.groups for m in g.members}
    skipped = {s.path for s in report.skipped}
    assert all(name in shared or name in skipped for name, _ in rope_tensors(model))
    assert not report.errors


def random_decoders(inner: str, tenths: int):
    """A property test over ``tenths``/10 of the examples, all compiled with ``inner``."""
    @settings(max_examples=max(1, EXAMPLES * tenths // 10), deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(decoders(inner))
    def test(case) -> None:
        (share_keeps_every_promise if inner == "share" else keeps_every_promise)(case)
    return test


# One test per inner backend, so that pytest-xdist runs them side by side; inductor costs seconds per
# compile: a small share of the examples.
test_random_decoders_eager = random_decoders("eager", 5)
test_random_decoders_aot_eager = random_decoders("aot_eager", 4)
test_random_decoders_inductor = random_decoders("inductor", 1)
test_random_decoders_share = random_decoders("share", 3)
