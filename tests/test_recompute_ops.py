"""Every op torch declares, on a RoPE table and on its recomputed twin: a recomputed table must behave as the plain
table it replaces, or raise the project's clear error (one that names the table, the op and the way out).

As torch tests DTensor (test/distributed/tensor/test_dtensor_ops.py), each OpInfo of ``op_db`` runs on plain
tensors and on the subclass, sample by sample, and the two must agree: bitwise values (NaNs equal, -0.0 and 0.0
apart), dtype, shape, strides where torch defines them (dims longer than 1), the storage offset of a view of the
table, the conj and neg bits, the exception class, and where a write through each tensor result lands (both
tables compared after it). Gradients too, in eager: ``op(x * input)`` and ``op(input) * x``, x requiring grad.

Which samples a table takes: the first tensor input of the op's samples, error inputs and ``extra_samples`` (``input``,
or the first of a list of them), when it is float32 (a cos or sin table, alternating by sample) or complex64 (a
polar table), and 2-D (the table itself, and rows of a longer table read through ``table[1:1 + n]``) or 1-D (a
row, ``table[1]``). The op then sees a tensor of the sample's exact shape, so no op's meaning changes. Scalars
and inputs of 3 or more dims are not tables; they, and every other sample or run left out, are counted with
their reason in the summary pytest prints at the end. Variants: function, method, in-place (the table written)
and ``out=`` (the table, or its rows, as ``out``). Random ops run seeded alike on both sides.

What differs today is listed, strictly, in tests/recompute_ops_xfail.py. The fast suite runs ``FAST_OPS``;
``pytest -m slow`` runs all of ``op_db``. Machinery: tests/differential.py.
"""

from __future__ import annotations

import collections
import re
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

import differential
from differential import (
    CAUSES, CONJ_NEG, DEVICE, ERRORS, GRADS, LAYOUT, NEW_ERRORS, TABLE_NAME, VALUES, WRITES, Divergence, Outcome,
    Tally, Twins, first_tensor, outcome_differences, placements, run_gradients, run_variant, same_bits,
    snapshot, state_differences, tensor_differences, variants,
)
from recompute_ops_xfail import XFAIL

# -- exclusions: each op here gets the behaviour named instead (every op of op_db runs) ----------------------------

# Ops whose values (and so gradients through them) are not compared; their dtype, shape, strides, conj and neg
# bits, errors and where a write lands are.
VALUES_NOT_COMPARED = {
    "empty_like": "uninitialized memory",
    "new_empty": "uninitialized memory",
    "new_empty_strided": "uninitialized memory",
    # run twice on one plain table, LAPACK's gelsy gives other bits in about half the runs (rank-deficient input)
    "linalg.lstsq": "torch's own values vary from call to call",
    "linalg.lstsq.grad_oriented": "torch's own values vary from call to call",
    # an ill-conditioned complex table: torch's subclass path (see VALUES_CLOSE) gives another pseudo-inverse
    "linalg.pinv": "another LAPACK driver's pseudo-inverse of an ill-conditioned table",
    "pinverse": "another LAPACK driver's pseudo-inverse of an ill-conditioned table",
}

# Ops whose values are compared within LAPACK's float32 tolerance, not bit for bit: for any tensor subclass
# (DTensor's too) torch's composite takes its differentiable path, ``_linalg_svd``/``_linalg_eigh`` computing
# the vectors as well (``compute_uv=True``), another LAPACK driver with other last bits.
VALUES_CLOSE = {name: "torch takes its subclass path (singular or eigen vectors computed too): other last bits"
                for name in ("linalg.cond", "linalg.eigvalsh", "linalg.matrix_norm", "linalg.norm",
                             "linalg.norm.subgradients_at_zero", "linalg.svdvals", "norm.nuc")}

# The fast suite: a spread of op kinds (views, in-place, out=, reductions, indexing, elementwise, complex,
# linear algebra), within about 40 s on 2 cores.
FAST_OPS = [
    # views
    "T", "t", "transpose", "narrow", "select", "unsqueeze", "squeeze", "expand", "view", "as_strided", "unbind",
    "split", "__getitem__", "contiguous", "clone",
    # in place (and metadata changed in place)
    "fill", "zero_", "index_put", "resize_",
    # out= (and outputs of other shapes than the table's), reductions, indexing
    "mm", "cat", "amax", "sum", "sort", "index_select", "gather",
    # elementwise
    "add", "mul", "neg", "sin", "abs", "where",
    # complex
    "conj", "view_as_real", "real", "angle", "linalg.vecdot",
    # linear algebra
    "matmul", "linalg.svdvals",
]


# Samples op_db lacks, on a (5, 4) table (op_db's samples of these ops are of other ranks): the reads a table
# serves, of rows in bounds and past them (where torch raises), and its views, copies and splits.
def extra_samples(dtype: torch.dtype) -> dict[str, list[SampleInput]]:
    x = torch.zeros(5, 4, dtype=dtype, device=DEVICE)  # only its shape and dtype count: a table takes its place

    def positions(*p: int) -> torch.Tensor:
        return torch.tensor(p, dtype=torch.int64, device=DEVICE)

    def each(*args: tuple) -> list[SampleInput]:
        return [SampleInput(x, args=a) for a in args]

    return {
        "unsqueeze": each((0,), (1,), (2,), (-1,)),
        "squeeze": each((), (0,), (-1,)),
        "view": each(((1, 5, 4),), ((5, 1, 4),), ((20,),), ((-1, 2),)),
        "expand": each(((2, 5, 4),), ((-1, 4),)),
        "permute": each(((1, 0),), ((0, 1),)),
        "contiguous": each(()),
        "clone": each(()),
        "split": each((2,), (2, 1)),
        "chunk": each((2,), (2, 1)),
        "__getitem__": each(*((i,) for i in (
            1, -1, slice(1, 3), slice(None, None, 2), None, (Ellipsis, 1), (slice(None), slice(None, 2)),
            positions(0, 2), positions(-1), positions(1, 2).view(2, 1),
            5, -6, positions(0, 5), positions(-6), (slice(None), 4)))),
        "index_select": each((0, positions(0, 2)), (0, positions(5))),
        "select": each((0, 1), (0, -1), (1, 0), (0, 5), (0, -6)),
        "narrow": each((0, 1, 2), (0, 4, 2)),
        "take": each((positions(3, 19),), (positions(20),)),
        # shrinking or keeping the size: the memory a growing resize adds holds no defined values
        "resize_": each(((2, 4),), ((2, 10),)),
    }


DTYPES = (torch.float32, torch.complex64)


def op_id(op: OpInfo) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def unfit(x: torch.Tensor | None, dtype: torch.dtype) -> str | None:
    """Why a sample's first tensor input cannot be a table (None: it can)."""
    if x is None:
        return "no tensor input"
    if x.dtype != dtype:
        return f"first tensor input is {x.dtype}, not the sample's dtype"
    if not placements(x.shape):
        return f"first tensor input is {x.dim()}-D"
    return None


def samples(op: OpInfo, dtype: torch.dtype) -> Iterator[tuple[str, SampleInput]]:
    """The op's samples, its error inputs (where torch raises) and ``extra_samples``, each with a label."""
    device = str(DEVICE)  # OpInfo's sample functions take the device's name
    yield from ((f"sample {i}", s) for i, s in enumerate(op.sample_inputs(device, dtype, requires_grad=False)))
    if op.error_inputs_func is not None and dtype == torch.float32:  # error inputs take no dtype
        yield from ((f"error sample {i}", e.sample_input) for i, e in enumerate(op.error_inputs(device)))
    yield from ((f"extra sample {i}", s) for i, s in enumerate(extra_samples(dtype).get(op_id(op), ())))


def divergences(op: OpInfo, tally: Tally) -> dict[str, list[Divergence]]:
    """Every difference between the twins over ``op``'s samples, by variant."""
    found: dict[str, list[Divergence]] = collections.defaultdict(list)
    values = "" if op_id(op) in VALUES_NOT_COMPARED else "close" if op_id(op) in VALUES_CLOSE else "bits"
    if not values:
        tally.exclude(f"values not compared: {VALUES_NOT_COMPARED[op_id(op)]}")
    elif values == "close":
        tally.exclude(f"values compared within tolerance: {VALUES_CLOSE[op_id(op)]}")
    for dtype in DTYPES:
        if dtype not in op.supported_dtypes(DEVICE.type):
            tally.exclude(f"op does not support {dtype}")
            continue
        for i, (label, sample) in enumerate(samples(op, dtype)):
            x = first_tensor(sample)
            reason = unfit(x, dtype)
            if reason is not None:
                tally.exclude(reason)
                continue
            kind = "cos" if i % 2 == 0 else "sin"
            for placement in placements(x.shape):  # type: ignore[union-attr]
                tally.samples += 1
                where = f"{str(dtype)[6:]} {label} as {placement}"
                for variant in variants(op):
                    for cause, what in run_variant(op, sample, placement, variant, kind, tally, values):
                        found[variant].append(Divergence(cause, f"{variant}, {where}: {what}"))
                for variant, cause, what in run_gradients(op, sample, placement, kind, tally, values):
                    found[variant].append(Divergence(cause, f"{variant}, {where}: {what}"))
    return found


def check(op: OpInfo, record_property) -> None:
    """Run ``op`` on the twins; the variants that differ, and how, must be those ``XFAIL`` lists."""
    tally = Tally()
    found = divergences(op, tally)
    record_property("recompute_ops", summary(tally, found))
    observed = {variant: frozenset(d.cause for d in ds) for variant, ds in found.items() if ds}
    expected = {variant: causes for (name, variant), (causes, _) in XFAIL.items() if name == op_id(op)}
    lines = []
    for variant in sorted(set(observed) | set(expected)):
        if variant not in observed:
            lines.append(f"{op_id(op)} {variant}: no longer differs; remove its entry from recompute_ops_xfail.py")
        elif observed[variant] != expected.get(variant):
            lines.append(f"{op_id(op)} {variant} differs by {sorted(observed[variant])}, where "
                         f"recompute_ops_xfail.py expects {sorted(expected.get(variant, ()))}:")
            lines += [f"    {d}" for d in found[variant][:6]]
    assert not lines, "\n".join(lines)


def summary(tally: Tally, found: dict[str, list[Divergence]]) -> dict[str, int]:
    """The counts the end-of-run summary adds up across tests (tests/conftest.py)."""
    counts = {"ops run": int(tally.samples > 0), "ops no table fits (no sample run)": int(tally.samples == 0),
              "samples run": tally.samples, "variant runs": tally.calls, "clear errors (refusals)": tally.refused,
              "differences": sum(len(ds) for ds in found.values()),
              "(op, variant) pairs that differ": sum(1 for ds in found.values() if ds)}
    counts.update({f"excluded: {reason}": n for reason, n in tally.excluded.items()})
    return counts


_BY_ID = {op_id(op): op for op in op_db}


@pytest.mark.parametrize("name", FAST_OPS)
def test_op_on_recomputed_table(name, record_property):
    check(_BY_ID[name], record_property)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_BY_ID))
def test_every_op_on_recomputed_table(name, record_property):
    check(_BY_ID[name], record_property)


def test_the_lists_name_ops_that_exist():
    """A list entry that names no OpInfo would hide nothing and pass forever."""
    named = {name for name, _ in XFAIL} | set(FAST_OPS) | set(extra_samples(torch.float32))
    assert named <= set(_BY_ID), sorted(named - set(_BY_ID))
    assert set(VALUES_NOT_COMPARED) | set(VALUES_CLOSE) <= set(_BY_ID), \
        sorted(set(VALUES_NOT_COMPARED) | set(VALUES_CLOSE) - set(_BY_ID))
    assert all(causes and causes <= set(CAUSES) for causes, _ in XFAIL.values())
    assert {variant for _, variant in XFAIL} <= {*variants(_BY_ID["add"]), "grad_in", "grad_out"}


@pytest.mark.parametrize("name", ["add", "T", "__getitem__", "resize_", "linalg.vecdot"])
def test_a_plain_twin_differs_in_nothing(name, monkeypatch):
    """The control: with a plain copy in the recomputed table's place, the harness finds no difference, so
    the differences it reports are the recomputed table's. (Over all of op_db, only linalg.lstsq's values
    differed so: see VALUES_NOT_COMPARED.)"""
    monkeypatch.setattr(differential, "recomputed", lambda values: values.clone())
    tally = Tally()
    assert divergences(_BY_ID[name], tally) == {}
    assert tally.samples and tally.calls


def test_the_comparisons_see_each_difference():
    """The harness can fail: each comparison tells apart what it claims to (plain tensors on both sides)."""
    zeros = torch.zeros(3, dtype=torch.float32, device=DEVICE)
    nan = torch.full((3,), float("nan"), dtype=torch.float32, device=DEVICE)
    assert not same_bits(zeros, -zeros) and same_bits(nan, nan.clone()) and not same_bits(zeros, zeros.double())
    angles = torch.arange(6, dtype=torch.float32, device=DEVICE).view(2, 3)
    table = torch.polar(torch.ones_like(angles, dtype=torch.float32, device=DEVICE), angles)

    def causes(p: torch.Tensor, r: torch.Tensor) -> set[str]:
        return {cause for cause, _ in tensor_differences(p, r, table, values=True)}

    assert causes(table.conj(), table.conj().resolve_conj()) == {CONJ_NEG}
    assert causes(table.conj(), table.conj().resolve_conj().conj().conj()) == {CONJ_NEG}  # values equal, bit not
    assert causes(table.t(), table.t().contiguous()) == {LAYOUT}
    assert causes(table[1:], table[1:].clone()) == {LAYOUT}  # a view of the table, at another offset
    assert causes(table[:1], table[:1].clone()) == set()  # offsets agree; a copy has its own storage
    assert causes(table, table.flip(0).flip(0).clone().add(0)) == set()
    assert causes(table, table * 1j) == {VALUES}
    rows = Twins(table, table.clone(), table[1:], table.clone()[1:])
    none = lambda: set()  # noqa: E731
    lost, _ = outcome_differences(Outcome(error=IndexError("out of range")), Outcome(0), rows, none, True, [])
    assert [cause for cause, _ in lost] == [ERRORS]
    clear = RuntimeError(f"{TABLE_NAME}: index_select cannot ...; call rope_dedup.unshare(model) first")
    assert outcome_differences(Outcome(0), Outcome(error=clear), rows, lambda: {"index_select"}, True, []) == ([], True)
    assert outcome_differences(Outcome(0), Outcome(error=clear), rows, lambda: {"gather"}, True, [])[1] is False
    assert state_differences(rows) == []
    before = snapshot(rows)
    rows.plain.add_(1)  # torch wrote; a twin that refused holds what it held
    assert state_differences(rows, before) == []
    assert {cause for cause, _ in state_differences(rows)} == {WRITES}


GRAVEST_FIRST = [GRADS, ERRORS, WRITES, VALUES, CONJ_NEG, NEW_ERRORS, LAYOUT]


def xfail_module(ops: list[str]) -> str:
    """The text of tests/recompute_ops_xfail.py with what the code under test earns today over ``ops`` (the
    entries of other ops kept)."""
    entries = {key: value for key, value in XFAIL.items() if key[0] not in ops}
    for name in ops:
        start = time.perf_counter()
        for variant, ds in divergences(_BY_ID[name], Tally()).items():
            if ds:  # the first difference of the gravest cause, without the variant and the error's message
                first = min(ds, key=lambda d: GRAVEST_FIRST.index(d.cause)).where.partition(", ")[2]
                entries[name, variant] = ({d.cause for d in ds}, re.sub(r" \(['\"].*['\"]\)", "", first))
        print(f"{name}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    lines = [f"    {key!r}: ({{{', '.join(CAUSES[c] for c in sorted(causes))}}}, {what!r}),"
             for key, (causes, what) in sorted(entries.items())]
    head = Path(__file__).with_name("recompute_ops_xfail.py").read_text().partition("XFAIL: ")[0]
    return head + "XFAIL: dict[tuple[str, str], tuple[set[str], str]] = {\n" + "\n".join(lines) + "\n}\n"


if __name__ == "__main__":  # rewrite tests/recompute_ops_xfail.py from a run over the ops named (default: all)
    text = xfail_module(sys.argv[1:] or sorted(_BY_ID))
    Path(__file__).with_name("recompute_ops_xfail.py").write_text(text)
