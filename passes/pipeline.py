"""The passes the backend runs over each graph, in order: the one place that says which and when.

1. ``dedup_rope`` (:mod:`dedup_rope`): offer every table the graph reads to the canonical store and
   point duplicate table nodes at one node per table;
2. ``merge_rope_subgraphs`` (:mod:`merge_rope_subgraphs`): merge identical table computations in
   ``forward``; they become identical only once every layer's table reads one node, hence after 1;
3. ``fold_rope_constants`` (:mod:`fold_rope_constants`): evaluate constant-only table computations
   once, at compile time.

The config enables 2 and 3 per inner backend (:meth:`RopeDedupConfig.computed_table_transforms`);
:func:`~rope_dedup.passes.pass_base.run_passes` runs what is enabled. Each pass is its module's ``rewrite``
and bears the module's name, which is also the name of the function that runs it alone.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx
from torch.fx.passes.infra.pass_manager import PassManager, this_before_that_pass_constraint

from rope_dedup.config import RopeDedupConfig
from rope_dedup.core.store import CanonicalStore
from rope_dedup.passes import dedup_rope, fold_rope_constants, merge_rope_subgraphs
from rope_dedup.passes.pass_base import GraphPass, PassContext, RopePassResult, run_passes

PASSES: tuple[GraphPass, ...] = tuple(GraphPass(module.rewrite)
                                     for module in (dedup_rope, merge_rope_subgraphs, fold_rope_constants))
CONSTRAINTS = [this_before_that_pass_constraint(GraphPass(dedup_rope.rewrite), GraphPass(merge_rope_subgraphs.rewrite))]  # type: ignore[arg-type]
# The declaration is checked once, where it is made; the passes a config enables keep its order.
PassManager(list(PASSES), CONSTRAINTS).validate_constraints()  # type: ignore[arg-type]


def enabled_passes(config: RopeDedupConfig) -> list[GraphPass]:
    """The declared passes ``config`` turns on, in declared order."""
    computed = config.computed_table_transforms()
    off = {merge_rope_subgraphs.rewrite: not computed.merge, fold_rope_constants.rewrite: not computed.fold}
    return [p for p in PASSES if not off.get(p.rewrite, False)]  # type: ignore[arg-type]


def run_pipeline(gm: torch.fx.GraphModule, example_inputs: Sequence | None, config: RopeDedupConfig,
                 store: CanonicalStore) -> RopePassResult:
    """Run the passes ``config`` enables over ``gm`` in place, offering tables to ``store``."""
    return run_passes(gm, example_inputs, enabled_passes(config), PassContext(store, config.redirects_inputs()))
