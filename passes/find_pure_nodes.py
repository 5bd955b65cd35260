"""Find the nodes whose values are pure: safe to compute once for two identical nodes, or ahead of time.

Merging identical nodes (CSE) and evaluating nodes at compile time (constant folding) rest on one
promise: computing the value once, or earlier, gives the same value and changes nothing else. For a
``call_function`` / ``call_method`` node that holds when

- it has no side effect (``Node.is_impure``: setitem, asserts, global-state switches) and writes none
  of its arguments (an in-place method, ``out=``);
- it draws no random numbers (aten ops tagged ``nondeterministic_seeded``: rand, dropout, ...);
- nothing writes its memory, directly or through a view (:func:`find_mutations`): two merged values
  would see each other's writes; nor does anything write the memory it reads (two identical reads on
  either side of a write differ);
- it is not a graph output, nor a view that one is made of: the caller would receive aliased tensors
  (or, once folded, the same tensor on every call);
- it is not a submodule call or a higher-order op, whose bodies this analysis does not read.

Two identical nodes are one computation only under the same global state: each pure node also gets the
autocast regions and grad mode it runs under (dynamo records ``with torch.autocast(...)`` and
``torch.no_grad()`` as nodes), and any other side-effecting call starts a new epoch that nothing merges
across.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.fx

# The view and write rules are find_mutations' own: one definition of "may alias" and "writes" for the package.
from rope_dedup.passes.find_mutations import aliases, find_mutations, op_name, output_aliases, writes

# Side effects that change nothing a later node computes.
_HARMLESS_EFFECTS = {torch._assert, torch._check, torch._assert_async}


@dataclass(frozen=True)
class State:
    """The global state a node runs under: ``autocast`` regions entered (their arguments), grad mode
    (None: as the caller set it), and an epoch bumped by any other side effect."""

    autocast: tuple = ()
    grad: bool | None = None
    epoch: int = 0


def find_pure_nodes(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, State]:
    """Map every pure node of ``gm`` (see the module docstring) to the global state it runs under."""
    written = {alias for node in find_mutations(gm) for alias in aliases(node)}
    escaping = output_aliases(gm)
    pure: dict[torch.fx.Node, State] = {}
    state = State()
    autocast: list[tuple] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        target = node.target
        if target is torch.amp._enter_autocast:
            autocast.append(_normalize(node.args, lambda n: n))  # type: ignore[arg-type]
            state = State(tuple(autocast), state.grad, state.epoch)
            continue
        if target is torch.amp._exit_autocast:
            if autocast:
                autocast.pop()
            state = State(tuple(autocast), state.grad, state.epoch)
            continue
        if target is torch._C._set_grad_enabled:
            state = State(state.autocast, bool(node.args[0]) if node.args else None, state.epoch)
            continue
        if writes(node) is not None:
            continue
        if node.op == "call_function" and (isinstance(target, torch._ops.HigherOrderOperator) or node.is_impure()):
            if target not in _HARMLESS_EFFECTS:
                state = State(state.autocast, state.grad, state.epoch + 1)
            continue
        if _draws_random(node) or node in written or node in escaping:
            continue
        if any(i in written for i in node.all_input_nodes):  # reads memory that a write changes: not a value
            continue
        pure[node] = state
    return pure


def node_key(node: torch.fx.Node, state: State, rename: Callable[[torch.fx.Node], Any]) -> Hashable | None:
    """A key equal for two nodes exactly when they compute the same thing from the same inputs.

    ``rename`` maps each input node to its representative (itself, or the node it was merged with).
    Leaves are keyed with their type (``1``, ``1.0`` and ``True`` promote differently) and floats by
    ``repr`` (``0.0`` and ``-0.0`` differ). Returns None when an argument cannot be keyed.
    """
    try:
        return (node.op, _target_key(node.target), _normalize(node.args, rename),
                _normalize(dict(sorted(node.kwargs.items())), rename), state)
    except TypeError:
        return None


def _target_key(target: Any) -> Hashable:
    return target if isinstance(target, str) else ("callable", id(target))


def _normalize(value: Any, rename: Callable[[torch.fx.Node], Any]) -> Hashable:
    if isinstance(value, torch.fx.Node):
        return ("node", rename(value))
    if isinstance(value, (bool, int, float, complex, str)) or value is None or value is Ellipsis:
        return (type(value).__name__, repr(value))
    if isinstance(value, slice):
        return ("slice", _normalize(value.start, rename), _normalize(value.stop, rename),
                _normalize(value.step, rename))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_normalize(v, rename) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _normalize(v, rename)) for k, v in value.items()))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return ("torch", value)
    if isinstance(value, torch.Tensor):
        raise TypeError("tensor argument")  # identity would do, but a mutable constant is not worth the risk
    return ("object", id(value))  # the same object: the same argument (functions, enum members, ...)


def _draws_random(node: torch.fx.Node) -> bool:
    """aten ops tagged nondeterministic_seeded, found from the overload, or from the function's name."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if getattr(target, "_nondeterministic_seeded", False):
        return True
    return _aten_draws_random(op_name(node))


@functools.lru_cache(maxsize=None)
def _aten_draws_random(name: str) -> bool:
    """Whether an aten op of this name has a random overload (``torch.rand``, ``Tensor.bernoulli``, ...)."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())
