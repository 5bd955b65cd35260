"""Applied precision under inductor: does the compiled graph rotate queries and keys as eager does?

A compile can change RoPE's numerics with no error: inductor fuses the rotary multiply-add and may keep it
in another precision than the graph's casts say (torchtitan #2575: a dropped downcast; a graph whose table
reaches the multiply in bf16). The eager run (:class:`~rope_dedup.audit.applied.TableCapture`'s interpreter)
names each rotation: ``y = x * cos + rotate(x) * sin`` (an add or sub of two multiplies by RoPE tables), or
``y = x * freqs_cis`` on complex values. A copy of the graph that also returns ``x``, ``rotate(x)`` and ``y``
of every rotation is compiled with inductor and run on the same inputs; the compiled ``y`` is compared with
the eager tables applied to the compiled ``x``, so that what differs upstream (a norm, a projection) cancels
and what remains is the rotation's own angle, per position and frequency.

A compiled rotation is a finding where it differs from eager's by more than ``max_angle_error`` and more than
the rounding of the values in their own dtype (a bf16 model's compiled rotation may round once where eager
rounds three times). A graph that writes its inputs in place is not run twice: it is listed as not checked,
as is one inductor cannot compile.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import torch
import torch.fx

_COMBINE = {operator.add: 1.0, operator.sub: -1.0, torch.add: 1.0, torch.sub: -1.0, "add": 1.0, "sub": -1.0}
_VIEWS = {operator.getitem, "view", "reshape", "narrow", "select", "__getitem__", "transpose", "permute", "unsqueeze"}


@dataclass(frozen=True)
class Rotation:
    """One rotation the eager run applied: ``y = x * table + sign * rotated * partner`` (complex: ``y = x * table``)."""

    layer: str
    source: str  # where the table came from, as the applied audit names it
    y: torch.fx.Node
    x: torch.fx.Node
    table: torch.Tensor  # the eager value multiplied into x (cos, or the complex table)
    rotated: torch.fx.Node | None = None  # the other multiply's tensor operand (rotate_half(x)); None: complex
    partner: torch.Tensor | None = None  # the table multiplied into it (sin)
    sign: float = 1.0
    positions: tuple[torch.Tensor, ...] = ()  # integer inputs the tables were computed from, nearest first


@dataclass(frozen=True)
class CompiledCheck:
    """How the compiled graph's rotation in one layer compares with eager's: the worst angle difference."""

    layer: str
    source: str
    angle: float | None  # largest angle difference from eager's rotation, radians; None: not checked
    position: int | None  # where (the table row's position)
    allowed: float  # the rounding of the values there, as an angle (the limit is at least max_angle_error)
    verdict: str  # "matches eager", "differs" (a finding) or "not checked"
    cause: str = ""  # a difference's cause, or why not checked
    fix: str = ""

    @property
    def differs(self) -> bool:
        return self.verdict == "differs"


def rotations(gm: torch.fx.GraphModule, multiplies: dict[torch.fx.Node, tuple[torch.fx.Node, Any]],
              is_rope: Callable[[Any], bool]) -> list[Rotation]:
    """The rotations in ``gm``: ``multiplies`` maps each multiply by a table-shaped operand to (the other
    operand, the applied candidate: layer, source, value, position ids); ``is_rope(candidate)`` says
    whether the operand is a RoPE table."""
    multiplies = {node: entry for node, entry in multiplies.items() if is_rope(entry[1])}
    found: list[Rotation] = []
    for node in gm.graph.nodes:
        sign = _COMBINE.get(node.target) if node.op in ("call_function", "call_method") else None
        if sign is not None and len(node.args) == 2 and all(a in multiplies for a in node.args):
            (x, first), (rotated, second) = multiplies[node.args[0]], multiplies[node.args[1]]
            found.append(Rotation(first.layer, first.source, node, x, first.value, rotated, second.value, sign,
                                  tuple(first.position_ids)))
        elif node in multiplies and multiplies[node][1].value.is_complex():
            x, candidate = multiplies[node]
            found.append(Rotation(candidate.layer, candidate.source, node, x, candidate.value,
                                  positions=tuple(candidate.position_ids)))
    return found


def writes_inputs(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph writes a placeholder (or a view of one) in place: running it twice would change state."""
    def state(node: Any) -> bool:
        for _ in range(8):
            if not isinstance(node, torch.fx.Node):
                return False
            if node.op in ("placeholder", "get_attr"):
                return True
            if node.target not in _VIEWS or not node.args:
                return False
            node = node.args[0]
        return False

    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        in_place = node.target is operator.setitem or (name.endswith("_") and not name.startswith("_"))
        if in_place and node.op in ("call_function", "call_method") and node.args and state(node.args[0]):
            return True
    return False


def with_outputs(gm: torch.fx.GraphModule, extra: list[torch.fx.Node]) -> tuple[torch.fx.GraphModule, int]:
    """A copy of ``gm`` that also returns ``extra`` after its own outputs; (the copy, how many outputs it had)."""
    graph, mapping = torch.fx.Graph(), dict[torch.fx.Node, torch.fx.Node]()
    returned, _ = graph.graph_copy(gm.graph, mapping, return_output_node=True)  # type: ignore[misc]
    outputs = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    graph.output(tuple(outputs + [mapping[n] for n in extra]))
    return torch.fx.GraphModule(gm, graph), len(outputs)


def check_compiled(gm: torch.fx.GraphModule, example_inputs: Sequence, args: Sequence, found: list[Rotation],
                   max_angle_error: float, compiled: dict[int, Any]) -> list[CompiledCheck]:
    """Run ``gm`` compiled by inductor (with each rotation's operands and result returned) on ``args`` and compare
    each rotation with eager's. ``compiled`` caches the compiled copy per graph."""
    if writes_inputs(gm):
        return [_not_checked(r, "the graph writes its inputs in place: not run a second time") for r in found]
    nodes = [n for r in found for n in (r.x, r.rotated, r.y) if n is not None]
    entry: tuple[Callable[..., Any] | str, int] | None = compiled.get(id(gm))
    if entry is None:
        from torch._inductor.compile_fx import compile_fx

        copy, count = with_outputs(gm, nodes)
        try:
            entry = (cast(Callable[..., Any], compile_fx(copy, list(example_inputs))), count)
        except Exception as error:  # inductor cannot lower this graph: said, never hidden
            entry = (f"inductor could not compile the graph: {type(error).__name__}: {str(error).splitlines()[0][:120]}", count)
        compiled[id(gm)] = entry
    function, count = entry
    if isinstance(function, str):
        return [_not_checked(r, function) for r in found]
    with torch.no_grad():
        outputs = list(function(*args))
    values = dict(zip(nodes, outputs[count:]))
    return [_compare(r, values, max_angle_error) for r in found]


def _not_checked(rotation: Rotation, why: str) -> CompiledCheck:
    return CompiledCheck(rotation.layer, rotation.source, None, None, 0.0, "not checked", why)


def _compare(rotation: Rotation, values: dict[torch.fx.Node, torch.Tensor], max_angle_error: float) -> CompiledCheck:
    """The compiled rotation against eager's tables applied to the compiled operands, as an angle per element."""
    y = values[rotation.y]
    eps = torch.finfo(y.dtype.to_real()).eps
    if rotation.rotated is None:  # complex: the angle of y / (x * table) is the difference itself
        x, table = values[rotation.x].to(torch.complex128), rotation.table.to(torch.complex128)
        expected = x * table
        angle = torch.angle(y.to(torch.complex128) * expected.conj()).abs()
        angle = torch.where(expected.abs() > 0, angle, torch.zeros_like(angle))
        allowed = torch.full_like(angle, 4 * eps)
    else:
        x, rotated = values[rotation.x].to(torch.float64), values[rotation.rotated].to(torch.float64)
        cos, sin = rotation.table.to(torch.float64), rotation.partner.to(torch.float64)  # type: ignore[union-attr]
        rotated = rotated * rotation.sign
        residual = y.to(torch.float64) - (x * cos + rotated * sin)
        # d y / d angle, with cos' = -sin and sin' = cos: a value pins its angle to residual / slope, where the
        # slope is at least half of what the pair's norm and the amplitude allow.
        slope = (rotated * cos - x * sin).abs()
        scale = ((x * x + rotated * rotated) * (cos * cos + sin * sin)).sqrt()
        steep = slope >= scale / 2
        angle = torch.where(steep, residual.abs() / slope.clamp_min(1e-300), torch.zeros_like(slope))
        # Each of x * cos, rotated * sin and their sum may be rounded once more in eager than in the compiled
        # kernel, or the other way round: a few ulps of the values' dtype, as an angle.
        rounding = 2 * eps * ((x * cos).abs() + (rotated * sin).abs() + y.to(torch.float64).abs())
        allowed = torch.where(steep, rounding / slope.clamp_min(1e-300), torch.zeros_like(slope))
    if not angle.numel():
        return CompiledCheck(rotation.layer, rotation.source, 0.0, _position_of(rotation, angle.shape, 0), 0.0,
                             "matches eager")
    excess = (angle - allowed.clamp_min(max_angle_error)).reshape(-1)
    flat = int(excess.argmax())
    if float(excess[flat]) <= 0:  # within bounds: the worst angle, for information
        flat = int(angle.reshape(-1).argmax())
        return CompiledCheck(rotation.layer, rotation.source, float(angle.reshape(-1)[flat]),
                             _position_of(rotation, angle.shape, flat), float(allowed.reshape(-1)[flat]),
                             "matches eager")
    worst_angle, position = float(angle.reshape(-1)[flat]), _position_of(rotation, angle.shape, flat)
    cause = _cause(rotation, values)
    return CompiledCheck(rotation.layer, rotation.source, worst_angle, position, float(allowed.reshape(-1)[flat]),
                         "differs", cause,
                         "keep the cast: apply RoPE in float32 as eager does (cast q and k to float32 before the "
                         "multiply-add, back after it), or compile with TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1")


def _cause(rotation: Rotation, values: dict[torch.fx.Node, torch.Tensor]) -> str:
    """Whether the compiled rotation is eager's with its tables rounded to a half dtype: a cast the compile moved."""
    complex_ = rotation.rotated is None
    y = values[rotation.y].to(torch.complex128 if complex_ else torch.float64)
    x = values[rotation.x].to(torch.complex128 if complex_ else torch.float64)
    rotated = None if complex_ else values[rotation.rotated].to(torch.float64)  # type: ignore[index]
    tolerance = 4 * torch.finfo(torch.float64).eps + 2 * torch.finfo(values[rotation.y].dtype.to_real()).eps
    for half in (torch.bfloat16, torch.float16):
        name = str(half).removeprefix("torch.")
        if complex_:
            expected = x * torch.complex(rotation.table.real.to(half).double(), rotation.table.imag.to(half).double())
        else:
            expected = x * rotation.table.to(half).double() + rotation.sign * rotated * rotation.partner.to(half).double()  # type: ignore[union-attr,operator]
        scale = expected.abs().max().clamp_min(1e-30)
        if float((y - expected).abs().max() / scale) <= tolerance:
            return f"the compiled graph applies the table rounded to {name} where eager applies it unrounded"
    return "the compiled graph computes the rotation at another precision than eager (a cast dropped or moved)"


def _position_of(rotation: Rotation, shape: torch.Size, flat: int) -> int | None:
    """The position of the table row that element ``flat`` of a ``shape`` rotation was multiplied by: the row
    in the table operand (which broadcasts from the right), mapped through the integer inputs the table was
    computed from when one has a value per row."""
    if not shape:
        return None
    index = torch.unravel_index(torch.tensor(flat, device="cpu", dtype=torch.int64), shape)
    table = rotation.table
    own = [int(i) if size > 1 else 0 for i, size in zip(index[len(shape) - table.dim():], table.shape)]
    row = 0
    for i, size in zip(own[:-1], table.shape[:-1]):
        row = row * size + i
    rows = table[..., 0].numel()
    ids = next((ids for ids in rotation.positions if ids.numel() == rows), None)
    return int(ids.reshape(-1)[row]) if ids is not None else row
