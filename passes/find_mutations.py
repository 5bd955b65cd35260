"""Find graph values that are written in place, directly or through a view; the package's one
definition of "may alias" and "writes".

A RoPE cache filled lazily in ``forward`` (lucidrains' rotary-embedding-torch) or updated by
``setitem`` is state, not a constant: sharing it would let one layer's write show up in another.
The analysis is conservative: every op known to return a view (or possibly its input itself)
propagates aliasing, and handing a value to a submodule the pass cannot see into counts as a write.
:mod:`find_pure_nodes` builds on the same rules.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

# Ops that may return their input or a view of it (so a write to the result writes the input).
VIEW_NAMES = {
    "view", "view_as", "reshape", "reshape_as", "narrow", "select", "slice", "transpose", "t", "T", "mT",
    "permute", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided",
    "split", "split_with_sizes", "chunk", "unbind", "view_as_real", "view_as_complex", "real", "imag",
    "diagonal", "movedim", "moveaxis", "swapaxes", "swapdims", "contiguous", "detach", "to", "type",
    "type_as", "float", "double", "half", "bfloat16", "alias", "unfold", "__getitem__", "getitem",
    "_unsafe_view", "lift_fresh",
}


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
    return None


def writes(node: torch.fx.Node) -> str | None:
    """How ``node`` writes memory (an argument in place, or ``out=``), or None if it writes nothing."""
    if node.kwargs.get("out") is not None:
        return f"{op_name(node)}(out=...)"
    return writes_first_arg(node)


def find_mutations(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Map each node whose value is written in place (or through a view of it) to how it is written."""
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
        if value in user.args or value in user.kwargs.values():
            return f"passed to submodule {user.target!r}, which the pass cannot inspect"
        return None
    if user.op not in ("call_function", "call_method"):
        return None
    out = user.kwargs.get("out")
    if out is value or (isinstance(out, (list, tuple)) and value in out):
        return f"{op_name(user)}(out=...)"
    if user.args and user.args[0] is value:
        return writes_first_arg(user)
    if isinstance(user.target, torch._ops.OpOverload):
        schema = user.target._schema
        for arg, actual in zip(schema.arguments, user.args):
            if actual is value and arg.alias_info is not None and arg.alias_info.is_write:
                return str(user.target)
    return None


def aliases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """``node`` and every value that may alias it through view-like ops, transitively."""
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
    """Graph outputs and every node one of them may be a view of (what the caller receives)."""
    found: set[torch.fx.Node] = set()
    stack = [n for n in gm.graph.nodes if n.op == "output" for n in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack += view_bases(node)
    return found


def view_bases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The values ``node`` may be a view of (or be itself): its first argument's nodes, for a view-like op."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return []
    if op_name(node) not in VIEW_NAMES and not _is_view_overload(node):
        return []
    first = node.args[0]
    return [a for a in (first if isinstance(first, (list, tuple)) else [first]) if isinstance(a, torch.fx.Node)]


def _is_view_overload(node: torch.fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return any(a.alias_info is not None and not a.alias_info.is_write for a in target._schema.arguments[:1])
    return False
