"""Find graph values that are written in place, directly or through an alias; the package's one
definition of "may alias" and "writes".

A RoPE cache filled lazily in ``forward`` (lucidrains' rotary-embedding-torch) or updated by
``setitem`` is state, not a constant: sharing it would let one layer's write show up in another. A write
missed because the rule did not know an op aliases is silent corruption, so the rule lists what is known
to return fresh memory, never what returns views; any other op may return any of its tensor arguments or
a view of one:

- an aten ``OpOverload`` is fresh when its schema declares no aliasing output (bar the few that lie,
  ``_UNDECLARED_ALIASES``) and it has no CompositeImplicitAutograd kernel: those decompose into ops that
  may hand back the input whatever the schema says (``dropout`` in eval returns it, ``type_as`` to the
  same type returns self, ``einsum('ij->ji')`` a permuted view); only ``_FRESH_COMPOSITES`` are read
  and known fresh. An aliasing output aliases the arguments with alias info.
- a torch-level call (a torch function, a Tensor method, ``operator.*``) is fresh when every overload of
  the aten op it runs, by name, is. Dtype and device conversions return self when nothing changes, so
  they are fresh only where the traced values (``example_value``, ``val``) differ in dtype or device.
- anything else: builtins, user functions, higher-order ops, ops outside aten.

Values the trace shows hold no tensor (sizes, ints) alias nothing. Handing a value to a submodule, or to
a higher-order op whose body writes its inputs, counts as a write. :mod:`find_pure_nodes` builds on the
same rules.
"""

from __future__ import annotations

import functools
import inspect
import operator
import types
from typing import Any

import torch
import torch.fx

# CompositeImplicitAutograd ops read (torch 2.13) and found never to return an input or a view of one.
_FRESH_COMPOSITES = {
    "matmul",  # dot, mv, mm or bmm of views of the inputs: only the fresh product is reshaped
    "linear",  # addmm or matmul; the bias is added to that product
    "outer",  # self.reshape(-1, 1) * vec2
    "softmax", "log_softmax",  # _softmax / _log_softmax, after a dtype conversion when dtype= is given
    "layer_norm",  # native_layer_norm's first output
    "rms_norm",  # _fused_rms_norm, or x * rsqrt(mean(x * x) + eps) [* weight] cast back
    "scaled_dot_product_attention",  # a fused kernel's output, or the math path's final matmul
    "where",  # where(cond): nonzero; a scalar operand: where.self on a wrapped scalar, out of place
}

# aten ops that return an input, a view of one or a tensor it holds though their schemas declare no alias
# (found by running the aten ops on dense CPU tensors and jagged nested ones, torch 2.13).
_UNDECLARED_ALIASES = {
    "_unsafe_view", "unsafe_split", "unsafe_split_with_sizes", "lift", "dequantize", "set",
    "_nested_get_offsets", "_nested_get_lengths", "_nested_get_min_seqlen", "_nested_get_max_seqlen",
    "_test_parallel_materialize", "_foobar",
}

# operator.* functions on tensors, by the aten op they call (operator.getitem aliases: it is not here).
_OPERATOR_ATEN = {
    "add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "floordiv": "floor_divide",
    "mod": "remainder", "pow": "pow", "matmul": "matmul", "neg": "neg", "pos": "positive", "abs": "abs",
    "invert": "bitwise_not", "and_": "bitwise_and", "or_": "bitwise_or", "xor": "bitwise_xor",
    "lshift": "__lshift__", "rshift": "__rshift__", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le",
    "gt": "gt", "ge": "ge",
}

# Methods converting dtype or device: they return self when the target is what the tensor already is.
_CONVERSIONS = {
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "char", "byte",
    "bool", "cfloat", "cdouble", "cpu", "cuda",
}

# Value and schema types that hold no tensor, so nothing returned as one aliases a tensor.
_NO_TENSOR_VALUES = (int, float, bool, complex, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool,
                     torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNKNOWN = object()  # no traced value: may be anything
_NO_TENSOR_TYPES = (torch._C.IntType, torch._C.FloatType, torch._C.BoolType, torch._C.NumberType,
                    torch._C.ComplexType, torch._C.StringType, torch._C.NoneType, torch._C.SymIntType,
                    torch._C.SymBoolType, torch._C.DeviceObjType)


def op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    return getattr(target, "__name__", str(target))


def writes_first_arg(node: torch.fx.Node) -> str | None:
    """Return a description of the in-place op if ``node`` writes its first argument (or an ``out=``)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        for arg in schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                return str(target)
        return None
    name = op_name(node)
    if target is operator.setitem or name == "__setitem__":
        return "setitem"
    if name in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__", "__iand__", "__ior__"):
        return name
    if node.op == "call_function" and getattr(target, "__module__", None) == "_operator" and name.startswith("i"):
        return name  # operator.iadd, imul, ... (x += y on a tensor)
    if name.endswith("_") and not name.endswith("__"):
        return name
    if _inplace_requested(node):
        return f"{name}(inplace=True)"  # torch.nn.functional's activations and dropouts
    return None


def _inplace_requested(node: torch.fx.Node) -> bool:
    """``inplace=True`` given to a Python function that takes it (``F.relu``, ``F.dropout``, ...)."""
    signature = _signature(node.target) if isinstance(node.target, types.FunctionType) else None
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind(*node.args, **node.kwargs).arguments
    except TypeError:
        return True  # arguments that do not bind: assume the worst
    return bound.get("inplace", False) is not False  # True, or a value only known at run time


@functools.lru_cache(maxsize=None)
def _signature(function: types.FunctionType) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def writes(node: torch.fx.Node) -> str | None:
    """How ``node`` writes memory (an argument in place, or ``out=``), or None if it writes nothing."""
    if node.kwargs.get("out") is not None:
        return f"{op_name(node)}(out=...)"
    return writes_first_arg(node)


def find_mutations(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Map each node whose value is written in place (or through an alias of it) to how it is written."""
    result: dict[torch.fx.Node, str] = {}
    for node in gm.graph.nodes:
        for alias in aliases(node):
            reason = next((r for user in alias.users if (r := _write_by(user, alias)) is not None), None)
            if reason is not None:
                result[node] = reason if alias is node else f"{reason} on a view of it ({alias.name})"
                break
    return result


def _write_by(user: torch.fx.Node, value: torch.fx.Node) -> str | None:
    """How ``user`` writes ``value`` in particular, or None."""
    if user.op == "call_module":
        if value in user.all_input_nodes:
            return f"passed to submodule {user.target!r}, which the pass cannot inspect"
        return None
    if user.op not in ("call_function", "call_method"):
        return None
    if isinstance(user.target, torch._ops.HigherOrderOperator):
        return _hop_writes(user, value) if value in user.all_input_nodes else None
    out = user.kwargs.get("out")
    if out is value or (isinstance(out, (list, tuple)) and value in out):
        return f"{op_name(user)}(out=...)"
    first = user.args[0] if user.args else None
    if first is value or (isinstance(first, (list, tuple)) and value in first):  # _foreach_*_ take lists
        return writes_first_arg(user)
    if isinstance(user.target, torch._ops.OpOverload):
        for arg, actual in _schema_actuals(user, user.target):
            if value in actual and arg.alias_info is not None and arg.alias_info.is_write:
                return str(user.target)
    return None


def _hop_writes(user: torch.fx.Node, value: torch.fx.Node) -> str | None:
    """How a higher-order op may write ``value``, one of its operands: a body (a subgraph it runs) writes
    one of its inputs, or it has no body to read (``triton_kernel_wrapper_mutation``, ``with_effects``)."""
    owner = user.graph.owning_module
    bodies: dict[torch.fx.Node, torch.fx.GraphModule] = {}
    for node in user.all_input_nodes:
        body = getattr(owner, node.target, None) if node.op == "get_attr" and isinstance(node.target, str) else None
        if isinstance(body, torch.fx.GraphModule):
            bodies[node] = body
    if value in bodies:
        return None
    if not bodies:
        return f"passed to higher-order op {op_name(user)!r}, which the pass cannot inspect"
    if len(bodies) == 1:  # wrap, wrap_with_autocast, checkpoints: the operands after the body are its inputs
        (node, body), = bodies.items()
        operands = list(user.args[user.args.index(node) + 1:]) if node in user.args else []
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if operands and len(operands) == len(placeholders):
            written = find_mutations(body)
            how = next((written[p] for p, operand in zip(placeholders, operands) if operand is value and p in written),
                       None)
            return None if how is None else f"passed to higher-order op {op_name(user)!r}, whose body writes it ({how})"
    for body in bodies.values():  # operands not matched to the body's inputs: any input written may be this one
        input_write = next((how for node, how in find_mutations(body).items() if node.op == "placeholder"), None)
        if input_write is not None:
            return f"passed to higher-order op {op_name(user)!r}, whose body writes an input ({input_write})"
    return None


def aliases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and every value that may alias it, transitively."""
    seen = [node]
    stack = [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user not in seen and current in view_bases(user):
                seen.append(user)
                stack.append(user)
    return seen


def output_aliases(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Graph outputs and every node one of them may alias (what the caller receives)."""
    found: set[torch.fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n.op == "output" for n in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack += view_bases(node)
    return found


def view_bases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The values ``node`` may be a view of, or be itself (see the module docstring); [] if it is fresh."""
    if node.op not in ("call_function", "call_method") or not _may_hold_tensor(node):
        return []
    target = node.target
    if target is operator.setitem:  # returns None
        return []
    if isinstance(target, torch._ops.OpOverload) and node.kwargs.get("out") is None:
        bases = _overload_bases(node, target)
    elif _is_fresh(node):
        return []
    elif target is operator.getitem or _aten_name(node) in _CONVERSIONS:
        # A view of the indexed value (never of an index tensor); self or a copy (never ``other``).
        bases = [node.args[0]] if node.args and isinstance(node.args[0], torch.fx.Node) else []
    else:
        bases = node.all_input_nodes
    return [b for b in bases if _may_hold_tensor(b)]


def _overload_bases(node: torch.fx.Node, op: torch._ops.OpOverload) -> list[torch.fx.Node]:
    """The inputs an op's output may alias: for aten, those its schema marks with alias info (in any
    alias set: the conservative reading), all for a wildcard output or a composite not known fresh, none
    if it is fresh; for other namespaces, whose schemas were not checked, all."""
    schema = op._schema
    if op.namespace != "aten":
        return node.all_input_nodes if any(_type_may_hold_tensor(r.type) for r in schema.returns) else []
    returned = [r.alias_info for r in schema.returns if r.alias_info is not None]
    if not returned:
        return [] if _fresh_overload(op) else node.all_input_nodes
    if any("*" in info.before_set | info.after_set for info in returned):  # may alias anything it was given
        return node.all_input_nodes
    return [a for arg, actual in _schema_actuals(node, op) if arg.alias_info is not None for a in actual]


def _schema_actuals(node: torch.fx.Node, op: torch._ops.OpOverload) -> list[tuple[Any, list[torch.fx.Node]]]:
    """Each schema argument of ``op`` with the nodes ``node`` passes for it (a list flattened)."""
    pairs = []
    for i, arg in enumerate(op._schema.arguments):
        actual = node.args[i] if i < len(node.args) and not arg.kwarg_only else node.kwargs.get(arg.name)
        pairs.append((arg, [a for a in (actual if isinstance(actual, (list, tuple)) else [actual])
                            if isinstance(a, torch.fx.Node)]))
    return pairs


def _is_fresh(node: torch.fx.Node) -> bool:
    """Whether a call that is not an ``OpOverload`` (nor getitem) is known to return fresh memory."""
    if writes(node) is not None:  # an in-place op, out= or inplace=True returns what it wrote
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _fresh_packet(target)
    name = _aten_name(node)
    if name is None:
        return False
    if name in _CONVERSIONS:
        return _converts(node)
    return _fresh_aten(name)


def _aten_name(node: torch.fx.Node) -> str | None:
    """The aten op a torch-level call runs (by name), or None where the callee may do anything.

    Bindings generated from aten (``torch.*``, ``torch._C._nn.*``, Tensor methods written in C) call the
    op of their name. Of the Python-level ones, only ``torch.nn.functional`` and ``torch.functional`` are
    taken by name (the ones that map to a fresh op were read for torch 2.13: each returns what that op
    computes); Python Tensor methods are not (``Tensor.resize`` returns a view though ``aten::resize``
    is fresh), nor are builtins, user functions or higher-order ops.
    """
    target = node.target
    if isinstance(target, str):  # call_method
        method = getattr(torch.Tensor, target, None)
        return target if getattr(method, "__objclass__", None) is torch._C.TensorBase else None
    name = getattr(target, "__name__", None)
    module = getattr(target, "__module__", None) or ""
    if not isinstance(name, str):
        return None
    if module == "_operator":
        return _OPERATOR_ATEN.get(name)
    if getattr(target, "__objclass__", None) is torch._C.TensorBase:
        return name
    if isinstance(target, types.BuiltinFunctionType) and (module == "torch" or module.startswith("torch._C.")):
        return name
    if isinstance(target, types.FunctionType) and module in ("torch.nn.functional", "torch.functional"):
        return name
    return None


def _converts(node: torch.fx.Node) -> bool:
    """Whether a dtype/device conversion's traced output differs from its input in dtype or device."""
    if node.kwargs.get("copy"):
        return True
    source = node.args[0] if node.args else None
    if not isinstance(source, torch.fx.Node):
        return False
    before, after = _traced(source), _traced(node)
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
            and (before.dtype != after.dtype or before.device != after.device))


@functools.lru_cache(maxsize=None)
def _fresh_aten(name: str) -> bool:
    try:
        return _fresh_packet(getattr(torch.ops.aten, name))
    except (AttributeError, RuntimeError):  # no aten op of that name
        return False


@functools.lru_cache(maxsize=None)
def _fresh_packet(packet: Any) -> bool:
    """Whether every overload of ``packet`` returns fresh memory; False if it is not an op. ``out=``
    overloads are left out: a call that passes ``out=`` is a write, never taken as fresh."""
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if not any(a.is_out for a in op._schema.arguments) and not _fresh_overload(op):
            return False
    return True


def _fresh_overload(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    if not any(_type_may_hold_tensor(r.type) for r in schema.returns):
        return True
    name = schema.name.removeprefix("aten::")
    if any(r.alias_info is not None for r in schema.returns) or name in _UNDECLARED_ALIASES:
        return False
    return not _composite_implicit(op.name()) or name in _FRESH_COMPOSITES


@functools.lru_cache(maxsize=None)
def _composite_implicit(qualname: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CompositeImplicitAutograd")
    except RuntimeError:  # a TorchScript builtin on lists or scalars (aten::mul.left_t): not a dispatcher op
        return False


def _type_may_hold_tensor(schema_type: Any) -> bool:
    if isinstance(schema_type, _NO_TENSOR_TYPES):
        return False
    if isinstance(schema_type, (torch._C.ListType, torch._C.OptionalType)):
        return _type_may_hold_tensor(schema_type.getElementType())
    if isinstance(schema_type, torch._C.TupleType):
        return any(_type_may_hold_tensor(t) for t in schema_type.elements())
    return True


def _traced(node: torch.fx.Node) -> Any:
    """The value a trace recorded for ``node`` (dynamo: ``example_value``, make_fx/export: ``val``), or
    ``_UNKNOWN``."""
    meta = node.meta
    return meta["example_value"] if "example_value" in meta else meta.get("val", _UNKNOWN)


def _may_hold_tensor(node: torch.fx.Node) -> bool:
    """False only where the trace shows ``node``'s value holds no tensor (a size, an int, a dtype)."""
    return _value_may_hold_tensor(_traced(node))


def _value_may_hold_tensor(value: Any) -> bool:
    if isinstance(value, (list, tuple, torch.Size)):
        return any(_value_may_hold_tensor(v) for v in value)
    return not isinstance(value, _NO_TENSOR_VALUES)
