"""Where a graph input came from: module path and origin, read from dynamo's (private) source objects.

Dynamo records on each placeholder a ``GraphArg`` whose ``source`` is a chain such as
``L['self']._modules['layers']._modules['0']._modules['rope']._buffers['cos']``. This is the only
module that touches that private API; everything else sees a :class:`InputOrigin`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, NamedTuple

import torch.fx

from rope_dedup.tensors import Origin

# Containers whose keys are the next component of a module path, not components themselves.
_CONTAINERS = {"_modules", "_buffers", "_parameters"}


@dataclass(frozen=True)
class InputOrigin:
    """``path`` like ``layers.3.rope.cos``; ``origin`` one of buffer, parameter, attribute, global, input.

    ``persistent`` is for buffers: whether the owning module saves it in its ``state_dict`` (None when
    the module could not be reached; callers treat that as persistent).
    """

    path: str
    origin: Origin
    persistent: bool | None = None
    owner: Any = None  # the module object holding a buffer or parameter, where it could be reached
    reach: Reach | None = None  # how to reach that module again from the frame the graph runs in


class Reach(NamedTuple):
    """The way from a frame's local (or global) to the module holding a buffer or parameter, and its name
    there. With regional compile one graph serves every block: replayed on the frame that calls the graph,
    it finds the module holding the tensor fed at run time (whose ``load_state_dict`` must be guarded)."""

    root: str
    is_global: bool
    steps: tuple[tuple[str, Any], ...]  # from the root to the owning module
    attr: str


def placeholder_origin(node: torch.fx.Node) -> InputOrigin:
    """Describe where a dynamo placeholder's value lives; falls back to the node name without a source."""
    return source_origin(getattr(node.meta.get("grapharg"), "source", None), node.name)


def attribute_origin(gm: torch.fx.GraphModule, target: str) -> InputOrigin | None:
    """Where a dynamo graph's ``get_attr`` tensor really lives, or None for a graph dynamo did not make.

    With inductor's ``freezing`` (and dynamo's ``install_free_tensors``) module state reaches the backend
    as attributes of the GraphModule, each registered there as a persistent buffer whatever the model
    said; ``gm._param_name_to_source`` keeps the source dynamo read it from, as placeholders do.
    """
    source = getattr(gm, "_param_name_to_source", None) or {}
    return source_origin(source[target], target) if source.get(target) is not None else None


def source_origin(source: Any, name: str) -> InputOrigin:
    """Describe the module state a dynamo source reads; ``name`` stands in where there is no source."""
    if source is None:
        return InputOrigin(name, Origin.INPUT)
    root, steps = _steps(source)
    attributes = [name for how, name in steps if how == "attr"]
    names = [str(name) for _, name in steps if name not in _CONTAINERS]
    global_name = getattr(root, "global_name", None)
    if global_name is not None:
        return InputOrigin(".".join([global_name, *names]), Origin.GLOBAL)
    if not attributes:  # a forward argument, possibly inside *args: an activation, not module state
        return InputOrigin(getattr(root, "local_name", None) or name, Origin.INPUT)
    if "_parameters" in attributes:
        reach = _reach(root, steps, "_parameters")
        return InputOrigin(".".join(names), Origin.PARAMETER, owner=_owner(reach), reach=reach)
    if "_buffers" in attributes:
        reach = _reach(root, steps, "_buffers")
        owner = _owner(reach)
        persistent = None if owner is None or reach is None else reach.attr not in owner._non_persistent_buffers_set
        return InputOrigin(".".join(names), Origin.BUFFER, persistent, owner, reach)
    return InputOrigin(".".join(names), Origin.ATTRIBUTE)


def _steps(source: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """The root source and the ("attr" | "item", name) steps from it to ``source``.

    ``module.__dict__['_buffers']`` (how dynamo reaches a module that assigns attributes in forward) is
    read as the attribute ``_buffers``; wrappers that only mark how dynamo treats a module are dropped.
    """
    steps: list[tuple[str, Any]] = []
    node = source
    while getattr(node, "base", None) is not None:
        member, index = getattr(node, "member", None), getattr(node, "index", None)
        if isinstance(member, str):
            steps.append(("attr", member))
        elif index is not None and not isinstance(index, (list, tuple)):
            steps.append(("item", index))
        node = node.base
    steps.reverse()
    folded: list[tuple[str, Any]] = []
    for step in steps:
        if folded and folded[-1] == ("attr", "__dict__") and step[0] == "item" and isinstance(step[1], str):
            folded[-1] = ("attr", step[1])
        else:
            folded.append(step)
    return node, folded


def _reach(root: Any, steps: list[tuple[str, Any]], container: str) -> Reach | None:
    """The :class:`Reach` of the tensor the steps name in ``container`` (``_buffers``, ``_parameters``), or
    None for a source that does not start at a frame's local or global, or names no tensor after it."""
    at = steps.index(("attr", container))
    name = getattr(root, "local_name", None)
    is_global = name is None
    if is_global:
        name = getattr(root, "global_name", None)
    if at + 1 >= len(steps) or not isinstance(name, str) or not isinstance(steps[at + 1][1], str):
        return None
    return Reach(name, is_global, tuple(steps[:at]), steps[at + 1][1])


def _owner(reach: Reach | None) -> Any:
    """The module holding the tensor ``reach`` names, on the frame dynamo is compiling, or None.

    It tells whether a buffer is in its module's state_dict, and where to guard ``load_state_dict``. The
    frame being compiled is the only place the owning module object can be found at compile time.
    """
    if reach is None:
        return None
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        frame = InstructionTranslator.current_tx().output.root_tx
        return _module_at(frame.f_globals if reach.is_global else frame.f_locals, reach)
    except Exception:  # no frame being compiled
        return None


def _module_at(namespace: Any, reach: Reach) -> torch.nn.Module | None:
    try:
        module = namespace[reach.root]
        for how, name in reach.steps:
            module = getattr(module, name) if how == "attr" else module[name]
    except Exception:  # a source this replay does not know
        return None
    return module if isinstance(module, torch.nn.Module) else None


# Frames between a compiled graph's caller (the frame dynamo transformed: its locals are the model's) and
# the store's run-time offer: dynamo's disable wrapper, the interning callable's own few, with room to spare.
_FRAMES_UP = 16


def find_owner(reach: Reach, tensor: Any) -> tuple[torch.nn.Module, str] | None:
    """The module holding this very ``tensor`` under ``reach.attr``, found by replaying ``reach`` on the frames
    that called this one: the frame that runs a compiled graph holds the locals dynamo compiled it from
    (``self``: this block, under regional compile). None when no frame leads to a module holding it."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES_UP):
        if frame is None:
            break
        namespace = frame.f_globals if reach.is_global else frame.f_locals
        if reach.root in namespace:
            module = _module_at(namespace, reach)
            if module is not None and _holds(module, reach.attr, tensor):
                return module, reach.attr
        frame = frame.f_back
    return None


def compiling_modules(*also: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules the frame dynamo is compiling runs in (its locals, and ``also``), each widened to the
    outermost module on the call stack that contains it: under regional compile a block is compiled while the
    model's own ``forward`` runs eagerly above it, and the model holds every block's tables. None contains
    another. Empty outside a compile."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        frame_locals = InstructionTranslator.current_tx().output.root_tx.f_locals
    except Exception:  # no frame being compiled
        return []
    inner = [_unwrapped(v) for v in [*frame_locals.values(), *also] if isinstance(v, torch.nn.Module)]
    outer: dict[int, torch.nn.Module] = {}
    caller: FrameType | None = sys._getframe(1)
    while caller is not None:
        module = caller.f_locals.get("self")
        if isinstance(module, torch.nn.Module):
            module = _unwrapped(module)
            contained = {id(m) for m in module.modules()}
            for m in inner:
                if id(m) in contained:
                    outer[id(m)] = module  # walking outwards: the last one found is the outermost
        caller = caller.f_back
    widened = list({id(outer.get(id(m), m)): outer.get(id(m), m) for m in inner}.values())
    return [m for m in widened if not any(other is not m and any(x is m for x in other.modules()) for other in widened)]


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The model a ``torch.compile`` wrapper (``OptimizedModule``) stands for, so that paths do not start with
    ``_orig_mod``."""
    orig = getattr(module, "_orig_mod", None)
    return orig if isinstance(orig, torch.nn.Module) else module


def _holds(module: torch.nn.Module, attr: str, tensor: Any) -> bool:
    return module._buffers.get(attr) is tensor or module._parameters.get(attr) is tensor


def declare_constant_source(gm: torch.fx.GraphModule, attribute: str) -> None:
    """Record that a buffer a pass added to a dynamo graph (a folded table) comes from no user object.

    Dynamo graphs map each state tensor they own to its source, and aot_autograd asserts that every
    buffer has one: a ``ConstantSource`` says "made here"."""
    sources = getattr(gm, "_param_name_to_source", None)
    if isinstance(sources, dict):
        from torch._dynamo.source import ConstantSource

        sources[attribute] = ConstantSource(attribute)


def module_path(node: torch.fx.Node) -> str:
    """``model.layers.0.self_attn`` from dynamo's ``nn_module_stack`` (``L['model'].model.layers[0]...``):
    relative to the frame's root local (:func:`module_root`)."""
    path = _innermost_module(node)
    if path is None:
        return ""
    path = re.sub(r"^[LG]\['[^']*'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def module_root(node: torch.fx.Node) -> str | None:
    """The frame local :func:`module_path` starts from (``model``; ``self`` in a frame dynamo began inside a
    module after a graph break), or None when the node ran in no module."""
    path = _innermost_module(node)
    found = re.match(r"^L\['([^']*)'\]", path) if path is not None else None
    return found.group(1) if found else None


def _innermost_module(node: torch.fx.Node) -> str | None:
    """The innermost module of ``nn_module_stack`` that the compiled frame reaches from its locals (the model's
    own tree), or the innermost of all when none does. A module reached through a global is no layer of the
    model: the ``kernels`` hub (a dependency of transformers 5.25) turns each model file's
    ``apply_rotary_pos_emb`` into a module-level ``nn.Module``, and taking it would credit every layer's RoPE
    to it."""
    stack = [str(entry[0]) for entry in (node.meta.get("nn_module_stack") or {}).values()]
    local = [path for path in stack if path.startswith("L[")]
    return (local or stack)[-1] if stack else None


def source_root(node: torch.fx.Node) -> str | None:
    """The frame local a placeholder's source starts from (``self`` for ``L['self']._modules['q_proj']...``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return None
    root, _ = _steps(source)
    return getattr(root, "local_name", None)


class WatchedInput(NamedTuple):
    """How to offer another tensor fed to the same graph input: what the store was told at compile time,
    and how to find the module holding it (None: a global, an attribute, a graph without sources)."""

    path: str
    written: str | None
    persistent: bool
    reach: Reach | None = None
