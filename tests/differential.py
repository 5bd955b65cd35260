"""The differential harness of tests/test_recompute_ops.py: a RoPE table and its recomputed twin, one op run on
each, and every way the two runs differ.

The recomputed table comes only through the public door, ``rope_dedup.share(holder, tables="recompute")``, and
its rows only through a view (``table[a:b]``, ``table[i]``), so the harness holds whatever the table's
implementation becomes. Values are read back by ``copy_`` into a plain tensor: the one read every tensor must
answer exactly. Each run gets fresh twins, since an op may write its input.
"""

from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.testing._internal.opinfo.core import OpInfo, SampleInput
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import rope_dedup

DEVICE = torch.device("cpu")
TABLE_NAME = "rope_table"  # the buffer's name: a clear error names it
WAY_OUT = ("rope_dedup.unshare", 'tables="share"')  # a clear error names one of them
SEED = 1234

# What differs, grouped by cause (the keys of the xfail list).
CONJ_NEG = "conj/neg bits"
LAYOUT = "strides/offset"
WRITES = "lost writes"
ERRORS = "lost errors"
NEW_ERRORS = "unclear errors"
VALUES = "wrong values"
GRADS = "wrong gradients"
CAUSES = {CONJ_NEG: "CONJ_NEG", LAYOUT: "LAYOUT", WRITES: "WRITES", ERRORS: "ERRORS", NEW_ERRORS: "NEW_ERRORS",
          VALUES: "VALUES", GRADS: "GRADS"}  # each cause, and its name here

# The op's input, taken from a table: the whole table, rows read through a slice, or one row read through select.
TABLE, ROWS, ROW = "table", "rows", "row"


@dataclass
class Divergence:
    cause: str
    where: str  # variant, placement and sample: enough to rerun it

    def __str__(self) -> str:
        return f"[{self.cause}] {self.where}"


@dataclass
class Tally:
    """What one op's run covered, for the summary: nothing is skipped without being counted here."""

    samples: int = 0  # samples whose input a table took, counted per placement
    calls: int = 0  # variant runs on both twins
    refused: int = 0  # runs where the recomputed twin raised the project's clear error
    excluded: dict[str, int] = field(default_factory=dict)  # reason -> samples or runs left out

    def exclude(self, reason: str) -> None:
        self.excluded[reason] = self.excluded.get(reason, 0) + 1


# -- the twins ---------------------------------------------------------------------------------------------------

def table_values(length: int, n: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    """A RoPE table as a model computes it: cos or sin of positions times frequencies, or their complex polar."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * n, 2, dtype=torch.int64, device=DEVICE).float() / (2 * n)))
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=DEVICE), inv_freq)
    if dtype.is_complex:
        return torch.polar(torch.ones_like(angles, dtype=torch.float32, device=DEVICE), angles)
    return angles.cos() if kind == "cos" else angles.sin()


class _Holder(nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer(TABLE_NAME, table, persistent=False)


def recomputed(values: torch.Tensor) -> torch.Tensor | str:
    """The recomputed twin of ``values`` (a copy of them converted), or why ``share()`` kept a plain table."""
    holder = _Holder(values.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if rope_dedup.share(holder, tables="recompute").recomputed:
            return getattr(holder, TABLE_NAME)
        # Again with a store of its own: the default store's report also lists earlier holders' skips.
        report = rope_dedup.share(_Holder(values.clone()), backend=rope_dedup.RopeDedupBackend(), tables="recompute")
    reasons = [s.reason for s in report.skipped] + [f"taken for {g.key.layout}, shared" for g in report.groups]
    kind = "complex" if values.is_complex() else "float"
    reason = re.sub(r"\(\d+, \d+\)", "(L, n)", reasons[0])  # the summary counts samples by reason, not by shape
    return f"share() kept a {kind} table of {values.shape[1]} column(s): {reason}"


@dataclass
class Twins:
    """The plain table and its recomputed twin, and the op's input taken from each in the same way."""

    plain_base: torch.Tensor
    rec_base: torch.Tensor
    plain: torch.Tensor
    rec: torch.Tensor

    def __post_init__(self) -> None:
        # What each held: a resize that grows a tensor adds uninitialized memory, which no comparison reads.
        self.numel = {"table": self.plain_base.numel(), "input": self.plain.numel()}


def placements(shape: torch.Size) -> list[str]:
    """Where a table can stand for an input of ``shape``: a 2-D input is the table or rows of a longer one,
    a 1-D input a row of one. The op sees a tensor of the sample's very shape either way."""
    return [TABLE, ROWS] if len(shape) == 2 else [ROW] if len(shape) == 1 else []


def make_twins(shape: torch.Size, dtype: torch.dtype, placement: str, kind: str) -> Twins | str:
    """Fresh twins whose ``placement`` has ``shape``, or why there are none."""
    n = shape[-1]
    if n == 0:
        return "no table has 0 frequencies"
    if placement == TABLE and shape[0] < 2:
        return "a table has at least 2 positions (the first dim longer than 1 counts them)"
    length = shape[0] if placement == TABLE else shape[0] + 2 if placement == ROWS else 3
    plain = table_values(length, n, dtype, kind)
    rec = recomputed(plain)
    if isinstance(rec, str):
        return rec
    take = {TABLE: lambda t: t, ROWS: lambda t: t[1:shape[0] + 1], ROW: lambda t: t[1]}[placement]
    return Twins(plain, rec, take(plain), take(rec))


# -- running an op -----------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None


def call(fn: Callable[[], Any]) -> Outcome:
    """``fn()``, seeded (random ops draw the same numbers on both sides), its warnings kept quiet."""
    torch.default_generator.manual_seed(SEED)  # the CPU's: torch.manual_seed also seeds every other device, slowly
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return Outcome(fn())
        except Exception as error:  # noqa: BLE001: the exception class is what is compared
            return Outcome(error=error)


def first_tensor(sample: SampleInput) -> torch.Tensor | None:
    """The sample's first tensor input: ``input`` itself, or the first of a list of tensors (``cat``)."""
    x = sample.input
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        x = x[0]
    return x if isinstance(x, torch.Tensor) else None


def with_input(sample: SampleInput, x: torch.Tensor) -> Any:
    """The sample's input with ``x`` in its first tensor's place."""
    if isinstance(sample.input, torch.Tensor):
        return x
    return type(sample.input)([x, *sample.input[1:]])


def invoke(fn: Callable[..., Any], sample: SampleInput, x: Any, **extra: Any) -> Any:
    """``fn`` on a private copy of the sample (an op may write its arguments) with ``x`` as its first tensor."""
    own = copy.deepcopy(sample)
    return fn(with_input(own, x), *own.args, **{**own.kwargs, **extra})


def variants(op: OpInfo) -> dict[str, Callable[..., Any]]:
    """The variants an OpInfo declares; ``out`` is the function, given ``out=`` (see ``arguments``)."""
    found = {"function": op.op, "method": op.method_variant, "inplace": op.inplace_variant,
             "out": op.op if op.supports_out else None}
    return {name: fn for name, fn in found.items() if fn is not None}


def arguments(variant: str, sample: SampleInput, expected: Outcome, table: torch.Tensor
              ) -> tuple[Any, dict[str, Any], list[Any]]:
    """One side's input, extra keyword arguments, and the objects a result may be (the input, or the out=
    tensors). ``out=`` is the table in the first output's place (fresh plain tensors in the others'), and the
    sample's own input stays the input."""
    if variant != "out":
        return table, {}, [table]
    out: Any = table
    if isinstance(expected.value, tuple) and expected.value and all(isinstance(v, torch.Tensor)
                                                                   for v in expected.value):
        out = (table, *[torch.empty_like(v, device=v.device, dtype=v.dtype) for v in expected.value[1:]])
    own_input = first_tensor(sample).clone()  # type: ignore[union-attr]
    return own_input, {"out": out}, list(out) if isinstance(out, tuple) else [out]


class _Names(TorchDispatchMode):
    """The aten ops a call dispatches: a clear error may name any of them."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def op_names(op: OpInfo, plain_call: Callable[[], Any]) -> set[str]:
    """Names a clear error may give the op: the OpInfo's, and every aten op the plain call dispatches."""
    recorder = _Names()
    with recorder:
        call(plain_call)
    names = {op.name, op.name.rpartition(".")[2], op.aten_name or op.name} | recorder.names
    return {n.rstrip("_") for n in names if n.strip("_")}


def is_clear_error(error: BaseException, names: set[str]) -> bool:
    """The project's clear error: it names the table, the op and the way out."""
    text = str(error)
    return TABLE_NAME in text and any(w in text for w in WAY_OUT) and any(n in text for n in names)


# -- comparing ---------------------------------------------------------------------------------------------------

def read(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain strided tensor (conj and neg bits resolved), by ``copy_``."""
    if t.layout != torch.strided:
        t = t.to_dense()
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _as_bits(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``t``'s bits (an integer view) and where it is NaN; -0.0 and 0.0 differ, NaNs are equal."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        return t, None
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(ints), t.isnan()


def agree(a: torch.Tensor, b: torch.Tensor, values: str) -> bool:
    """Values compared as ``values`` says: "bits", or "close" (within LAPACK's float32 tolerance), for the ops whose
    other path torch itself takes for any tensor subclass (``VALUES_CLOSE``)."""
    if values == "close":
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            torch.isclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True).all())
    return same_bits(a, b)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    (a_bits, a_nan), (b_bits, b_nan) = _as_bits(a), _as_bits(b)
    equal = a_bits == b_bits
    if a_nan is not None and b_nan is not None:
        equal |= a_nan & b_nan
    return bool(equal.all())


def _shares(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether plain ``t`` is a view of plain ``base`` (the same storage)."""
    return (t.layout == torch.strided and base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            and t.untyped_storage().nbytes() > 0)


def tensor_differences(p: torch.Tensor, r: torch.Tensor, plain_base: torch.Tensor, values: str
                       ) -> list[tuple[str, str]]:
    """How recomputed result ``r`` differs from plain result ``p``."""
    if (p.dtype, p.shape, p.layout) != (r.dtype, r.shape, r.layout):
        return [(VALUES, f"{p.dtype} {tuple(p.shape)} {p.layout} vs {r.dtype} {tuple(r.shape)} {r.layout}")]
    found = []
    if (p.is_conj(), p.is_neg()) != (r.is_conj(), r.is_neg()):
        found.append((CONJ_NEG, f"is_conj/is_neg {p.is_conj()}/{p.is_neg()} vs {r.is_conj()}/{r.is_neg()}"))
    if p.layout == torch.strided:
        # torch defines a stride only where the dim is longer than 1
        p_strides = [s for s, n in zip(p.stride(), p.shape) if n > 1]
        r_strides = [s for s, n in zip(r.stride(), r.shape) if n > 1]
        if p_strides != r_strides:
            found.append((LAYOUT, f"strides {p.stride()} vs {r.stride()}"))
        if _shares(p, plain_base) and p.storage_offset() != r.storage_offset():
            found.append((LAYOUT, f"storage_offset {p.storage_offset()} vs {r.storage_offset()}"))
    if p.requires_grad != r.requires_grad:
        found.append((VALUES, f"requires_grad {p.requires_grad} vs {r.requires_grad}"))
    if values:
        got = call(lambda: read(r))
        if got.error is not None:
            found.append((NEW_ERRORS, f"reading it raises {type(got.error).__name__} ({str(got.error)[:80]!r})"))
        elif not agree(read(p), got.value, values):
            found.append((VALUES, "values differ"))
    return found


def _same_leaf(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, complex) and (a != a):
        return bool(b != b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001: an object that cannot say is not equal
        return False


def outcome_differences(plain: Outcome, rec: Outcome, tw: Twins, names: Callable[[], set[str]],
                        values: str, identities: list[Any]) -> tuple[list[tuple[str, str]], bool]:
    """How the recomputed run differs from the plain one, and whether it refused with the clear error.
    ``identities`` pairs objects a result may be (the input, the out= tensors): a result is one of them on
    one side exactly when it is on the other."""
    if rec.error is not None and is_clear_error(rec.error, names()):
        return [], True
    if plain.error is not None or rec.error is not None:
        if rec.error is None:
            return [(ERRORS, f"torch raises {type(plain.error).__name__} ({str(plain.error)[:80]!r}), "
                             f"the twin returns")], False
        if plain.error is None or type(plain.error) is not type(rec.error):
            torch_did = "returns" if plain.error is None else f"raises {type(plain.error).__name__}"
            return [(NEW_ERRORS, f"torch {torch_did}, the twin raises {type(rec.error).__name__} "
                                 f"({str(rec.error)[:120]!r})")], False
        return [], False
    p_leaves, p_spec = tree_flatten(plain.value)
    r_leaves, r_spec = tree_flatten(rec.value)
    if p_spec != r_spec:
        return [(VALUES, f"output structure {p_spec} vs {r_spec}")], False
    found = []
    for i, (p, r) in enumerate(zip(p_leaves, r_leaves)):
        if isinstance(p, torch.Tensor) != isinstance(r, torch.Tensor):
            found.append((VALUES, f"output {i}: {type(p).__name__} vs {type(r).__name__}"))
        elif isinstance(p, torch.Tensor):
            found += [(cause, f"output {i}: {what}") for cause, what in tensor_differences(p, r, tw.plain_base, values)]
            p_is = [p is obj for obj, _ in identities]
            r_is = [r is obj for _, obj in identities]
            if p_is != r_is:
                found.append((VALUES, f"output {i} is the input/out= object: {p_is} vs {r_is}"))
        elif not _same_leaf(p, r):
            found.append((VALUES, f"output {i}: {p!r:.60} vs {r!r:.60}"))
    return found, False


def snapshot(tw: Twins) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain table and input as they are now: what a twin that refuses the next op must still hold."""
    return tw.plain_base.clone(), tw.plain.clone()


def state_differences(tw: Twins, before: tuple[torch.Tensor, torch.Tensor] | None = None, values: str = "bits"
                      ) -> list[tuple[str, str]]:
    """Whether the two tables, and the inputs taken from them, still hold the same values and shapes: a write
    (or a metadata change) that landed on one side only. ``before``: the twin refused, and holds what it held.
    ``values``: how the op's values compare (an out= write puts them in the table)."""
    found = []
    p_base, p_input = before or (tw.plain_base, tw.plain)
    for what, p, r in (("table", p_base, tw.rec_base), ("input", p_input, tw.rec)):
        if p.shape != r.shape or p.dtype != r.dtype:
            found.append((WRITES, f"{what} is {p.dtype} {tuple(p.shape)} vs {r.dtype} {tuple(r.shape)}"))
            continue
        got = call(lambda: read(r))
        if got.error is not None:
            found.append((NEW_ERRORS, f"reading the recomputed {what} raises {type(got.error).__name__}"))
        elif values and not agree(read(p).flatten()[:tw.numel[what]], got.value.flatten()[:tw.numel[what]], values):
            found.append((WRITES, f"{what} values differ"))
    return found


def write_into(t: torch.Tensor) -> torch.Tensor:
    """A write that shows where it lands (every element changes)."""
    return t.logical_not_() if t.dtype == torch.bool else t.add_(1)


def result_tensors(outcome: Outcome) -> list[tuple[int, torch.Tensor]]:
    leaves, _ = tree_flatten(outcome.value)
    return [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]


def _leaf(outcome: Outcome, i: int) -> Any:
    return tree_flatten(outcome.value)[0][i]


# -- one run -----------------------------------------------------------------------------------------------------

def run_variant(op: OpInfo, sample: SampleInput, placement: str, variant: str, kind: str, tally: Tally,
                values: str = "bits") -> Iterator[tuple[str, str]]:
    """Run ``variant`` of ``op`` on fresh twins with the table at ``placement``; yield (cause, what) for each
    difference: the call, the tables after it, then a write through each tensor result."""
    x = first_tensor(sample)
    tw = make_twins(x.shape, x.dtype, placement, kind)  # type: ignore[union-attr]
    if isinstance(tw, str):
        tally.exclude(tw)
        return
    fn = variants(op)[variant]
    # the outputs out= stands for, from a run on a copy of the sample's input
    expected = call(lambda: invoke(op.op, sample, x.clone())) if variant == "out" else Outcome()  # type: ignore
    p_in, p_extra, p_objects = arguments(variant, sample, expected, tw.plain)
    r_in, r_extra, r_objects = arguments(variant, sample, expected, tw.rec)
    before = snapshot(tw)
    plain = call(lambda: invoke(fn, sample, p_in, **p_extra))
    rec = call(lambda: invoke(fn, sample, r_in, **r_extra))
    tally.calls += 1

    def names() -> set[str]:  # the plain call again on fresh twins, recorded: only when the twin raised
        again = make_twins(x.shape, x.dtype, placement, kind)  # type: ignore[union-attr]
        table = again.plain if isinstance(again, Twins) else tw.plain
        a_in, a_extra, _ = arguments(variant, sample, expected, table)
        return op_names(op, lambda: invoke(fn, sample, a_in, **a_extra))

    found, refused = outcome_differences(plain, rec, tw, names, values, list(zip(p_objects, r_objects)))
    tally.refused += refused
    yield from found
    yield from state_differences(tw, before if refused else None, values)
    if refused or plain.error is not None or rec.error is not None or found:
        return
    for i, p in result_tensors(plain):
        r = _leaf(rec, i)
        before = snapshot(tw)
        p_wrote, r_wrote = call(lambda: write_into(p)), call(lambda: write_into(r))
        written, refused = outcome_differences(p_wrote, r_wrote, tw, names, values, [(p, r)])
        tally.refused += refused
        yield from ((WRITES if c == VALUES else c, f"write into output {i}: {w}") for c, w in written)
        yield from ((c, f"after a write into output {i}: {w}")
                    for c, w in state_differences(tw, before if refused else None, values))
        if refused:
            return  # the twins parted ways here, as they may: later writes would compare nothing
        if values and p_wrote.error is None and r_wrote.error is None:
            yield from ((WRITES if c == VALUES else c, f"output {i} after a write into it: {w}")
                        for c, w in tensor_differences(p, r, tw.plain_base, values))


def run_gradients(op: OpInfo, sample: SampleInput, placement: str, kind: str, tally: Tally, values: str = "bits"
                  ) -> Iterator[tuple[str, str, str]]:
    """Gradients through the twins, in eager: ``op(x * input)`` (if the op has a backward) and
    ``op(input) * x``, each to a weighted scalar loss; yield (variant, cause, what) for each difference."""
    if not values:
        tally.exclude("gradients: the op's values are undefined")
        return
    x = first_tensor(sample)
    backward = op.supports_autograd and x.dtype in op.supported_backward_dtypes(DEVICE.type)  # type: ignore[union-attr]
    checks = (("grad_in", _grad_in), ("grad_out", _grad_out)) if backward else (("grad_out", _grad_out),)
    if not backward:
        tally.exclude("grad_in: the op has no backward for this dtype")
    for variant, check in checks:
        tw = make_twins(x.shape, x.dtype, placement, kind)  # type: ignore[union-attr]
        if isinstance(tw, str):
            tally.exclude(tw)
            continue
        tally.calls += 1
        for cause, what in check(op, sample, tw, tally, values):
            yield variant, cause, what


def _weights(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(SEED))


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A scalar that every element of ``outputs`` moves, with its own weight."""
    terms = [(o * _weights(o.shape, o.dtype)) for o in outputs]
    return torch.stack([(t.real if t.is_complex() else t).sum() for t in terms]).sum()


def _float_outputs(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _grad_differences(op: OpInfo, sample: SampleInput, plain: Outcome, rec: Outcome, xs: tuple[torch.Tensor, ...],
                      tw: Twins, tally: Tally, values: str) -> Iterator[tuple[str, str]]:
    names = lambda: op_names(op, lambda: invoke(op.op, sample, tw.plain))  # noqa: E731
    found, refused = outcome_differences(plain, rec, tw, names, values, [])
    tally.refused += refused
    yield from ((GRADS if c == VALUES else c, f"loss: {w}") for c, w in found)
    if refused or found or plain.error is not None:
        return
    p_grad, r_grad = (x.grad for x in xs)
    if (p_grad is None) != (r_grad is None):
        yield GRADS, f"x.grad is {'None' if p_grad is None else 'set'} vs {'None' if r_grad is None else 'set'}"
    elif p_grad is not None and not agree(read(p_grad), read(r_grad), values):  # type: ignore[arg-type]
        yield GRADS, "x.grad differs"


def _grad_in(op: OpInfo, sample: SampleInput, tw: Twins, tally: Tally, values: str) -> Iterator[tuple[str, str]]:
    """x (requires grad) times the input, then the op, then the loss: x.grad reads the table's values as the
    backward of a product sees them (their conjugate, for complex tables)."""
    xs = tuple(_weights(tw.plain.shape, tw.plain.dtype).requires_grad_() for _ in range(2))

    def forward_backward(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        outputs = [t for t in _float_outputs(sample.output_process_fn_grad(invoke(op.op, sample, x * table)))
                   if t.requires_grad]
        if not outputs:
            raise _NoGradient
        loss = _loss(outputs)
        loss.backward()
        return loss.detach()

    plain = call(lambda: forward_backward(xs[0], tw.plain))
    if isinstance(plain.error, _NoGradient):
        tally.exclude("grad_in: no output requires grad")
        return
    rec = call(lambda: forward_backward(xs[1], tw.rec))
    yield from _grad_differences(op, sample, plain, rec, xs, tw, tally, values)


def _grad_out(op: OpInfo, sample: SampleInput, tw: Twins, tally: Tally, values: str) -> Iterator[tuple[str, str]]:
    """The op on the input, then times x (requires grad), then the loss: x.grad reads the op's first float or
    complex output as autograd sees it (its conj and neg bits included)."""
    # x takes the shape of the op's output: a probe on a copy finds it, and leaves the twins as they were
    probe = call(lambda: _float_outputs(invoke(op.op, sample, tw.plain.clone())))
    if probe.error is not None or not probe.value:
        tally.exclude("grad_out: the op gives no float or complex output")
        return
    xs = tuple(_weights(probe.value[0].shape, probe.value[0].dtype).requires_grad_() for _ in range(2))

    def forward_backward(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        loss = _loss([_float_outputs(invoke(op.op, sample, table))[0] * x])
        loss.backward()
        return loss.detach()

    plain = call(lambda: forward_backward(xs[0], tw.plain))
    rec = call(lambda: forward_backward(xs[1], tw.rec))
    yield from _grad_differences(op, sample, plain, rec, xs, tw, tally, values)


class _NoGradient(Exception):
    """The op's outputs hold nothing to differentiate."""
