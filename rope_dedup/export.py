"""Deduplicate RoPE tables in a ``torch.export`` ``ExportedProgram``.

An exported program lifts module state into graph inputs: non-persistent buffers and plain tensor
attributes arrive as ``BUFFER`` / ``CONSTANT_TENSOR`` inputs whose values live in ``ep.constants``,
persistent buffers as ``BUFFER`` inputs with values in ``ep.state_dict``. Identical RoPE tables are
grouped and verified exactly as the backend does (same store, same rules), then the graph is rewritten to
read one input per table. The duplicates are dropped from the signature and the constants; a persistent
buffer or frozen parameter (shared only with ``share_persistent=True``) keeps its ``state_dict`` key,
which then names the canonical tensor, so checkpoints keep their keys. The input program and the
model's tensors are untouched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
from typing import Any, Iterator

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, TensorArgument

from rope_dedup.tensors import Origin
from rope_dedup.core.eligibility import Refusal, SkipReason, in_state_dict
from rope_dedup.passes.find_mutations import find_mutations
from rope_dedup.passes.recompute_reads import recompute_reads
from rope_dedup.passes.redirect_to_canonical import redirect_to_canonical
from rope_dedup.core.report import DedupReport, Recomputed, Skip
from rope_dedup.recompute.convert import Converter
from rope_dedup.recompute.table import RecomputedTable
from rope_dedup.core.store import Action, CanonicalStore

log = logging.getLogger("rope_dedup")

_STATE_KINDS = {InputKind.PARAMETER: Origin.PARAMETER, InputKind.BUFFER: Origin.BUFFER,
                InputKind.CONSTANT_TENSOR: Origin.ATTRIBUTE}


def dedup_exported(ep: ExportedProgram, *, share_persistent: bool = False, tables: str = "share") -> ExportedProgram:
    """Return a program that reads one input per distinct RoPE table, with duplicates dropped.

    Every lifted parameter, buffer and constant tensor is offered to a :class:`CanonicalStore`: written
    ones (``BUFFER_MUTATION`` outputs or in-place ops), trainable parameters, persistent buffers and frozen
    parameters (unless ``share_persistent=True``) and non-RoPE tensors are skipped with the reason. The
    report is logged on the ``rope_dedup`` logger and kept in
    ``result.graph_module.meta["rope_dedup_report"]``.

    ``tables="recompute"`` then drops each remaining non-persistent table whose recipe reproduces it bit for bit
    and that the program reads only by rows: each read computes its rows from a frequency vector (one constant
    per key), so no table constant is left (``report.recomputed``); the others stay, with why.
    """
    if not isinstance(ep, ExportedProgram):
        raise TypeError(f"dedup_exported expects a torch.export.ExportedProgram, got {type(ep).__name__}")
    if tables not in ("share", "recompute"):
        raise ValueError(f"dedup_exported(tables=...) takes 'share' or 'recompute', got {tables!r}")
    with _quiet_pytree_deprecation():
        gm = copy.deepcopy(ep.graph_module)  # the caller's program stays as it was (it holds no tensors)
    placeholders = {node.name: node for node in gm.graph.nodes if node.op == "placeholder"}
    written = _written_inputs(ep, gm, placeholders)
    # Decide and group without aliasing: the tensors belong to the caller's model; duplicates are dropped.
    store = CanonicalStore(dry_run=True, share_persistent=share_persistent)
    offered: list[tuple[InputSpec, torch.Tensor]] = []
    for input_spec in ep.graph_signature.input_specs:
        tensor = _value(ep, input_spec)
        if input_spec.kind not in _STATE_KINDS or not isinstance(tensor, torch.Tensor):
            continue
        offer = store.offer(tensor, name=input_spec.target, written=written.get(input_spec.arg.name),
                            persistent=in_state_dict(_STATE_KINDS[input_spec.kind], input_spec.persistent))
        if offer.action is not Action.SKIP:
            offered.append((input_spec, tensor))

    keeper: dict[int, InputSpec] = {}  # id(group) -> the input that stays in use
    duplicates: dict[torch.fx.Node, torch.fx.Node] = {}
    aliased: dict[str, torch.Tensor] = {}  # persistent duplicates: state_dict key -> canonical tensor
    dropped: set[str] = set()  # input names removed from the signature
    for input_spec, tensor in offered:
        first = keeper.setdefault(id(store.group_of(tensor)), input_spec)
        if first is input_spec:
            continue
        duplicates[placeholders[input_spec.arg.name]] = placeholders[first.arg.name]
        if input_spec.target in ep.state_dict:  # a persistent buffer or frozen parameter: its key stays
            aliased[input_spec.target] = _value(ep, first)  # type: ignore[index]
        else:
            dropped.add(input_spec.arg.name)
    redirect_to_canonical(gm, duplicates)
    for name in dropped:
        gm.graph.erase_node(placeholders[name])
    input_specs = [s for s in ep.graph_signature.input_specs if s.arg.name not in dropped]
    vectors: dict[str, torch.Tensor] = {}
    recomputed: list[Recomputed] = []
    kept: list[Skip] = []
    if tables == "recompute":
        keepers = [(spec, _value(ep, spec)) for spec in keeper.values() if spec.target not in ep.state_dict]
        input_specs = _recompute(gm, placeholders, input_specs, keepers, vectors, recomputed, kept)
    gm.graph.lint()
    gm.recompile()

    signature = ExportGraphSignature(input_specs=input_specs, output_specs=list(ep.graph_signature.output_specs))
    kept_targets = {s.target for s in signature.input_specs}
    constants = {k: v for k, v in ep.constants.items() if k in kept_targets or not isinstance(v, torch.Tensor)}
    constants.update(vectors)
    state_dict = {**ep.state_dict, **aliased}
    with _quiet_pytree_deprecation():
        result = ExportedProgram(
            root=gm,
            graph=gm.graph,
            graph_signature=signature,
            state_dict=state_dict,
            range_constraints=copy.deepcopy(ep.range_constraints),
            module_call_graph=copy.deepcopy(ep.module_call_graph),
            example_inputs=ep.example_inputs,
            constants=constants,
            verifiers=ep.verifiers,
        )

    report = DedupReport.from_store(store)
    if tables == "recompute":
        held = sum(v.untyped_storage().nbytes() for v in {id(v): v for v in vectors.values()}.values())
        report = dataclasses.replace(report, recomputed=recomputed, recomputed_bytes=held,
                                     skipped=report.skipped + kept)
    result.graph_module.meta["rope_dedup_report"] = report
    log.info("rope_dedup: exported program: %d input(s) dropped, %d persistent buffer(s) aliased; %s",
             len(dropped), len(aliased), str(report).splitlines()[0])
    return result


def _recompute(gm: torch.fx.GraphModule, placeholders: dict[str, torch.fx.Node], input_specs: list[InputSpec],
               keepers: list[tuple[InputSpec, Any]], vectors: dict[str, torch.Tensor], recomputed: list[Recomputed],
               kept: list[Skip]) -> list[InputSpec]:
    """Replace each table input in ``keepers`` whose recipe is exact, and whose reads are all rows, by a vector
    input; returns the new input specs. Fills ``vectors`` (constant name -> vector), ``recomputed`` and ``kept``."""
    converter = Converter()
    vector_inputs: dict[int, torch.fx.Node] = {}  # id(vector) -> its placeholder: one input per distinct vector
    replaced: dict[str, InputSpec | None] = {}  # table input name -> the vector's spec, or None (input dropped)
    for spec, tensor in keepers:
        table, done, refusal = converter.convert(tensor, spec.target or spec.arg.name, _STATE_KINDS[spec.kind])
        if not isinstance(table, RecomputedTable) or done is None:
            if refusal is not None and refusal.reason is SkipReason.NOT_EXACT:
                kept.append(Skip(spec.target or spec.arg.name, refusal))
            continue
        node = placeholders[spec.arg.name]
        assert table.recipe is not None  # a table just converted: the whole table, computed from its recipe
        vector = vector_inputs.get(id(table.inv_freq))
        new = vector is None
        if new:
            with gm.graph.inserting_before(node):  # named as export names a lifted constant: c_<target>
                vector = gm.graph.placeholder("c_" + f"{spec.target}_inv_freq".replace(".", "_"))
            vector.meta["val"] = _fake_like(node, table.inv_freq)
        assert vector is not None
        why = recompute_reads(gm, node, vector, table.recipe, done.path)
        if why is not None:
            if new:
                gm.graph.erase_node(vector)
            kept.append(Skip(done.path, Refusal(SkipReason.NOT_EXACT, why)))
            continue
        gm.graph.erase_node(node)
        recomputed.append(done)
        if new:
            vector_inputs[id(table.inv_freq)] = vector
            target = f"{spec.target}_inv_freq"
            vectors[target] = table.inv_freq
            replaced[spec.arg.name] = InputSpec(kind=InputKind.CONSTANT_TENSOR, arg=TensorArgument(name=vector.name),
                                                target=target)
        else:
            replaced[spec.arg.name] = None
    specs = []
    for spec in input_specs:
        new_spec = replaced.get(spec.arg.name, spec)
        if new_spec is not None:
            specs.append(new_spec)
    return specs


def _fake_like(node: torch.fx.Node, tensor: torch.Tensor) -> Any:
    """A value for a new input's meta, in the fake mode of the program's own inputs."""
    mode = getattr(node.meta.get("val"), "fake_mode", None)
    return mode.from_tensor(tensor, static_shapes=True) if mode is not None else tensor


@contextlib.contextmanager
def _quiet_pytree_deprecation() -> Iterator[None]:
    """Deep-copying an exported program's pytree specs trips a deprecation warning raised within torch
    itself: not the user's to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
        yield


def _value(ep: ExportedProgram, input_spec: InputSpec) -> Any:
    if input_spec.kind == InputKind.PARAMETER or (input_spec.kind == InputKind.BUFFER and input_spec.persistent):
        return ep.state_dict.get(input_spec.target)
    if input_spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        return ep.constants.get(input_spec.target)
    return None


def _written_inputs(ep: ExportedProgram, gm: torch.fx.GraphModule,
                    placeholders: dict[str, torch.fx.Node]) -> dict[str, str]:
    """Input name -> how the program writes it: functional BUFFER_MUTATION outputs, or in-place ops."""
    by_target = {s.target: s.arg.name for s in ep.graph_signature.input_specs if s.target is not None}
    written = {by_target[s.target]: "updated by the program (BUFFER_MUTATION output)"
               for s in ep.graph_signature.output_specs
               if s.kind == OutputKind.BUFFER_MUTATION and s.target in by_target}
    for node, how in find_mutations(gm).items():
        if node.op == "placeholder" and node.name in placeholders:
            written.setdefault(node.name, how)
    return written
