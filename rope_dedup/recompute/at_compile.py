"""``RopeDedupBackend(tables="recompute")``: convert the model's tables while dynamo compiles its first graph.

Dynamo builds a graph's guards after the backend returns. A table replaced by a :class:`RecomputedTable` inside
the backend gets its guards rebuilt on the recomputed table (its type and recipe, as dynamo guards a subclass it
traces), so no call recompiles for it. The whole model is converted at once (the outermost module on the call
stack holding the compiled frame's modules): under regional compile every block then matches the first block's
guards. The graph itself was traced with the plain table; it is compiled with the recomputed one in that
input's place, which is what each call passes, so the inner backend traces the rows a read reads.

A table a graph receives as an argument (torchtitan passes ``freqs_cis`` to each block) or as a global is
guarded as the plain tensor it was: converting it would recompile that graph, so it is kept, with its reason. So
is a table the graph writes in place (a recomputed table cannot be written by a graph), and every table held
under the same name by a module of the same class (another block, whose graph would write it alike).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils.weak import WeakIdKeyDictionary

from rope_dedup.core.dynamo_state import guard_replaced_input
from rope_dedup.core.eligibility import Refusal, SkipReason
from rope_dedup.core.sources import compiling_modules, placeholder_origin
from rope_dedup.recompute.convert import Conversion, Converter, recompute_tables
from rope_dedup.tensors import Origin

_ARGUMENT = ("reaches a compiled graph as an argument or a global, guarded as the plain tensor it is: converting it "
             "would recompile; convert with rope_dedup.share(model, tables=\"recompute\") before compiling")
_WRITTEN = "written in place by a compiled graph ({how}): a graph cannot write a recomputed table"


class CompileTimeConverter:
    """One backend's conversions: one frequency vector per key across its graphs; the tables some graph took as a
    plain argument (never converted afterwards: that graph's guards would fail) and the (module class, name)
    some graph writes (never converted: a graph cannot write a recomputed table)."""

    def __init__(self) -> None:
        self._converter = Converter()
        self._plain_arguments = WeakIdKeyDictionary()  # tensor -> True
        self._written: dict[tuple[type, str], str] = {}  # (module class, name) a graph writes -> how

    def convert(self, gm: torch.fx.GraphModule, example_inputs: Sequence, written: Mapping[torch.fx.Node, str],
                dry_run: bool = False) -> tuple[list, Conversion]:
        """Convert the tables of the modules ``gm``'s frame runs in, but those ``written`` (placeholder -> how the
        graph writes it); the example inputs with each converted table input replaced by its
        :class:`RecomputedTable` (``gm``'s placeholders record it too)."""
        inputs = list(example_inputs)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        owners = []
        for node, value in zip(placeholders, inputs):
            if not isinstance(value, torch.Tensor):
                continue
            origin = placeholder_origin(node)
            if origin.origin in (Origin.INPUT, Origin.GLOBAL):
                self._plain_arguments[value] = True
            elif origin.owner is not None:
                owners.append(origin.owner)
                if node in written and origin.reach is not None:
                    self._written[(type(origin.owner), origin.reach.attr)] = written[node]
        try:
            conversion = recompute_tables(*compiling_modules(*owners), dry_run=dry_run, converter=self._converter,
                                          keep=self._keep)
        finally:
            self._converter.forget_tables()  # the replaced tables must be free to go
        fake_mode = detect_fake_mode(inputs)
        for index, (node, value) in enumerate(zip(placeholders, inputs)):
            replacement = conversion.replaced.get(id(value)) if isinstance(value, torch.Tensor) else None
            if replacement is None:
                continue
            inputs[index] = replacement
            guard_replaced_input(node, replacement)
            if fake_mode is not None:
                node.meta["example_value"] = fake_mode.from_tensor(replacement, static_shapes=True)
        return inputs, conversion

    def _keep(self, module: torch.nn.Module, name: str, table: torch.Tensor) -> Refusal | None:
        how = self._written.get((type(module), name))
        if how is not None:
            return Refusal(SkipReason.NOT_EXACT, _WRITTEN.format(how=how))
        return Refusal(SkipReason.NOT_EXACT, _ARGUMENT) if table in self._plain_arguments else None

    @property
    def vector_bytes(self) -> int:
        return self._converter.vector_bytes
