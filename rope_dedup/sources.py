"""Where a graph input came from: module path and kind, read from dynamo's (private) source objects.

Dynamo records on each placeholder a ``GraphArg`` whose ``source`` is a chain such as
``L['self']._modules['layers']._modules['0']._modules['rope']._buffers['cos']``. This is the only
module that touches that private API; everything else sees a :class:`InputOrigin`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

# Containers whose keys are the next component of a module path, not components themselves.
_CONTAINERS = {"_modules", "_buffers", "_parameters"}


@dataclass(frozen=True)
class InputOrigin:
    """``path`` like ``layers.3.rope.cos``; ``kind`` one of buffer, parameter, attribute, global, input."""

    path: str
    kind: str


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
        kind = "buffer"
    else:
        kind = "attribute"
    return InputOrigin(".".join(reversed(names)), kind)
