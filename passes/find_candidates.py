"""List the module state a graph reads: the candidates the dedup pass examines.

Two graph forms reach the pass. Dynamo graphs (``torch.compile``) receive parameters, buffers, tensor
attributes and globals as placeholders, matched positionally with ``example_inputs`` (the very tensor
objects of the model). ``torch.fx.symbolic_trace`` graphs read them through ``get_attr`` nodes on the
GraphModule, and so do dynamo graphs under inductor's ``freezing``, where the source dynamo recorded
says what each really is. Plain forward arguments are activations, not state, and are not candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx

from rope_dedup.core.eligibility import in_state_dict
from rope_dedup.core.sources import InputOrigin, Reach, attribute_origin, placeholder_origin
from rope_dedup.tensors import Origin, local, memory_key, placement


@dataclass(frozen=True)
class Candidate:
    """A tensor the graph reads from module state, with the node that reads it."""

    node: torch.fx.Node
    tensor: torch.Tensor
    path: str
    origin: Origin
    input_index: int | None  # position in example_inputs for placeholders, None for get_attr
    persistent: bool = False  # saved in a state_dict: a parameter, or a persistent buffer (or one whose
    # module was not found)
    owner: torch.nn.Module | None = None  # the module holding it, where known: its load_state_dict is guarded
    reach: Reach | None = None  # how run-time interning finds the module holding another block's tensor here


def find_candidates(gm: torch.fx.GraphModule, example_inputs: Sequence | None = None) -> list[Candidate]:
    """Every placeholder fed from module state and every tensor ``get_attr``, in graph order."""
    candidates: list[Candidate] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is not None:
        for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if not isinstance(value, torch.Tensor):
                continue
            where = placeholder_origin(node)
            if where.origin is Origin.INPUT:
                continue
            candidates.append(_from_origin(node, value, where, index))
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        value = getattr(owner, attr, None)
        if not isinstance(value, torch.Tensor):
            continue
        where = attribute_origin(gm, node.target)  # type: ignore[assignment]
        if where is not None and where.origin is not Origin.INPUT:  # freezing: dynamo knows the real owner
            candidates.append(_from_origin(node, value, where, None))
            continue
        if attr in owner._parameters:
            origin = Origin.PARAMETER
        elif attr in owner._buffers:
            origin = Origin.BUFFER
        else:
            origin = Origin.ATTRIBUTE
        # symbolic_trace up to torch 2.13 registers every buffer it copies as persistent (the GraphModule's
        # state_dict has it); rope_dedup.symbolic_trace keeps the model's own choice.
        persistent = in_state_dict(origin, attr not in owner._non_persistent_buffers_set)
        candidates.append(Candidate(node, value, node.target, origin, None, persistent, owner))
    return candidates


def _from_origin(node: torch.fx.Node, value: torch.Tensor, where: InputOrigin, index: int | None) -> Candidate:
    """A candidate whose owner dynamo recorded (its source): path, origin and persistence come from there."""
    origin = Origin.PARAMETER if isinstance(value, torch.nn.Parameter) else where.origin
    return Candidate(node, value, where.path, origin, index, in_state_dict(origin, where.persistent), where.owner,
                     where.reach)


def duplicates_by_memory(kept: list[Candidate]) -> tuple[dict, list[tuple[int, ...]]]:
    """Nodes reading the very same memory (after sharing) -> the first such node in graph order."""
    first: dict[tuple, Candidate] = {}
    duplicates: dict[torch.fx.Node, torch.fx.Node] = {}
    merged: dict[tuple, list[int]] = {}
    for candidate in kept:
        t = candidate.tensor
        where = (memory_key(t), t.dtype, tuple(local(t).shape), tuple(local(t).stride()), placement(t))
        if where not in first:
            first[where] = candidate
            merged[where] = [candidate.input_index]  # type: ignore[list-item]
            continue
        canonical = first[where]
        if candidate.node is canonical.node:
            continue
        duplicates[candidate.node] = canonical.node
        merged[where].append(candidate.input_index)  # type: ignore[arg-type]
    groups = [tuple(g) for g in merged.values() if len(g) > 1 and None not in g]
    return duplicates, groups
