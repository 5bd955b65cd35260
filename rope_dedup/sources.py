"""Where a graph input came from: module path and kind, read from dynamo's (private) source objects.

Dynamo records on each placeholder a ``GraphArg`` whose ``source`` is a chain such as
``L['self']._modules['layers']._modules['0']._modules['rope']._buffers['cos']``. This is the only
module that touches that private API; everything else sees a :class:`InputOrigin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx

# Containers whose keys are the next component of a module path, not components themselves.
_CONTAINERS = {"_modules", "_buffers", "_parameters"}


@dataclass(frozen=True)
class InputOrigin:
    """``path`` like ``layers.3.rope.cos``; ``kind`` one of buffer, parameter, attribute, global, input.

    ``persistent`` is for buffers: whether the owning module saves it in its ``state_dict`` (None when
    the module could not be reached; callers treat that as persistent).
    """

    path: str
    kind: str
    persistent: bool | None = None


def placeholder_origin(node: torch.fx.Node) -> InputOrigin:
    """Describe where a dynamo placeholder's value lives; falls back to the node name without a source."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return InputOrigin(node.name, "input")
    names: list[str] = []
    containers: set[str] = set()
    attributes = 0
    root = source
    while True:
        member = getattr(root, "member", None)
        index = getattr(root, "index", None)
        if isinstance(member, str):
            attributes += 1
            if member in _CONTAINERS:
                containers.add(member)
            else:
                names.append(member)
        elif index is not None and not isinstance(index, (list, tuple)):
            names.append(str(index))
        base = getattr(root, "base", None)
        if base is None:
            break
        root = base
    global_name = getattr(root, "global_name", None)
    if global_name is not None:
        names.append(global_name)
        kind = "global"
    elif not attributes:  # a forward argument, possibly inside *args: an activation, not module state
        return InputOrigin(getattr(root, "local_name", None) or node.name, "input")
    elif "_parameters" in containers:
        kind = "parameter"
    elif "_buffers" in containers:
        return InputOrigin(".".join(reversed(names)), "buffer", _buffer_persistent(source))
    else:
        kind = "attribute"
    return InputOrigin(".".join(reversed(names)), kind)


def _buffer_persistent(source: Any) -> bool | None:
    """Whether the buffer ``source`` names is in its module's state_dict, from the module object itself.

    The module is reached by replaying the source chain on the frame dynamo is compiling (its locals
    and globals), which is the only place the owning module object can be found at compile time.
    """
    buffer = source
    while buffer is not None and getattr(getattr(buffer, "base", None), "member", None) != "_buffers":
        buffer = getattr(buffer, "base", None)
    if buffer is None:
        return None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        frame = InstructionTranslator.current_tx().output.root_tx
        module = _replay(buffer.base.base, frame.f_locals, frame.f_globals)
    except Exception:  # no frame being compiled, or a source kind this replay does not know
        return None
    non_persistent = getattr(module, "_non_persistent_buffers_set", None)
    return None if non_persistent is None else buffer.index not in non_persistent


def _replay(source: Any, f_locals: dict, f_globals: dict) -> Any:
    """The object a dynamo source names: its root local or global, then each attribute and item in turn."""
    base = getattr(source, "base", None)
    if base is None:
        if getattr(source, "local_name", None) is not None:
            return f_locals[source.local_name]
        return f_globals[source.global_name]
    value = _replay(base, f_locals, f_globals)
    if isinstance(getattr(source, "member", None), str):
        return getattr(value, source.member)
    if hasattr(source, "index"):
        return value[source.index]
    return value  # wrappers that only mark how dynamo treats the module (NNModuleSource and kin)
