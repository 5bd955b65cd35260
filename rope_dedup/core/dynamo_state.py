"""What a dynamo compile keeps of the model's tensors after it ends, and letting it go.

While dynamo traces a frame, its fake-tensor converter maps each real tensor it fakes to an id, in a
``WeakIdKeyDictionary`` (a weak reference per parameter and buffer), and the tracing context maps tensors to
their symbolic context likewise. A weak reference to a tensor makes ``torch.utils.swap_tensors`` refuse it,
and ``Module._apply`` swaps (DTensor models, FSDP2's ``to_empty``, ``set_swap_module_params_on_conversion``).
Dynamo clears both at the end of a compile, but only for backends it knows by name (torch 2.13's
``invalidate_compile_context_weakrefs``, ``None`` by default); a backend instance such as
``RopeDedupBackend()`` is not one, and anything that keeps a fake tensor of the graph (an un-merged copy kept
for a fallback does) keeps them alive. So the backend asks, during its compile, to clear the same two maps
when dynamo's compile ends: :func:`release_tensor_refs_at_compile_end`. This module is the only one that
reaches into those private structures.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_lock = threading.Lock()
_pending: list[Any] = []  # tensor maps to clear once no compile is in flight


def release_tensor_refs_at_compile_end(gm: torch.fx.GraphModule) -> None:
    """Clear the running compile's maps from real tensors when dynamo's compile of this frame ends (guards
    built, code installed), as dynamo does for the backends it knows by name. Two fake modes hold them: the
    tracing context's (made for the backend) and the one dynamo traced with, which the graph's example values
    belong to. Nothing outside a compile."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return
    fake_modes = {id(mode): mode for mode in (getattr(context, "fake_mode", None), *_graph_fake_modes(gm))
                  if mode is not None}
    maps = [getattr(context, "tensor_to_context", None)]
    maps += [m for mode in fake_modes.values() for m in _describer_maps(mode)]
    handler = getattr(getattr(torch._dynamo, "callback", None), "callback_handler", None)
    if handler is None:  # a torch without compile callbacks: nothing to hang the clearing on
        return
    with _lock:
        # Registered where needed, not once: torch._dynamo.reset() clears the callbacks.
        if _at_compile_end not in handler.end_callbacks:
            handler.register_end_callback(_at_compile_end)
        _pending.extend(m for m in maps if m is not None)


def _graph_fake_modes(gm: torch.fx.GraphModule) -> list[Any]:
    return [mode for node in gm.graph.nodes if node.op == "placeholder"
            for mode in _fake_modes(node.meta.get("example_value"))]


def _fake_modes(value: Any) -> list[Any]:
    """The fake modes behind an example value: its own, or its inner tensors' for a subclass (a DTensor)."""
    if getattr(value, "fake_mode", None) is not None:
        return [value.fake_mode]
    if is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        return [mode for name in names for mode in _fake_modes(getattr(value, name))]
    return []


def _describer_maps(fake_mode: Any) -> tuple[Any, Any]:
    # getattr: private structures, as in torch 2.10 to 2.15; one that is not there holds nothing to clear.
    converter = getattr(fake_mode, "fake_tensor_converter", None)
    describer = getattr(getattr(converter, "meta_converter", None), "describer", None)
    return getattr(describer, "lookup_tensor", None), getattr(describer, "lookup_storage", None)


def _at_compile_end(args: Any) -> None:
    """Dynamo runs end callbacks when its last compile in flight (in any thread) ends: then every map asked
    for belongs to a finished compile."""
    with _lock:
        maps, _pending[:] = list(_pending), []
    for tensor_map in maps:
        tensor_map.clear()


def guard_replaced_input(node: torch.fx.Node, replacement: torch.Tensor) -> None:
    """Rebuild the guards of a graph input whose tensor the backend replaced while dynamo compiles (a table
    recomputed), on the replacement: dynamo built them on the tensor it traced (a weak reference), which the
    model no longer holds. For a traceable subclass, its type and flatten context too, as dynamo guards one it
    traces, so that a table of another recipe fails them. (Its inner tensors are no graph inputs of their own
    here: their shape, dtype and device follow from the table's and the context.)"""
    from functools import partial

    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.source import SubclassAttrListSource
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch.utils.weak import TensorWeakRef

    source = node.meta["grapharg"].source
    guards = InstructionTranslator.current_tx().output.guards
    guards.remove_guards_with_source(source)
    rebuilt = [source.make_guard(partial(GuardBuilder.TENSOR_MATCH, value=TensorWeakRef(replacement)))]
    if is_traceable_wrapper_subclass(replacement):
        rebuilt += [source.make_guard(GuardBuilder.TENSOR_SUBCLASS_METADATA_MATCH),
                    source.make_guard(GuardBuilder.TYPE_MATCH),
                    SubclassAttrListSource(source).make_guard(GuardBuilder.EQUALS_MATCH)]
    for guard in rebuilt:
        guards.add(guard)
