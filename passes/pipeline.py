"""The passes the backend runs over each graph, in order: the one place that says which and when.

1. ``dedup_rope`` (:mod:`dedup_rope`): offer every table the graph reads to the canonical store and
   point duplicate table nodes at one node per table;
2. ``merge_rope_subgraphs`` (:mod:`merge_rope_subgraphs`): merge identical table computations in
   ``forward``; they become identical only once every layer's table reads one node, hence after 1;
3. ``fold_rope_constants`` (:mod:`fold_rope_constants`): evaluate constant-only table computations
   once, at compile time.

The config enables 2 and 3 per inner backend (:meth:`RopeDedupConfig.computed_table_transforms`);
:func:`~rope_dedup.passes.pass_base.run_passes` runs what is enabled.
"""

from __future__ import annotations

from typing import Sequence

import torch.fx
from torch.fx.passes.infra.pass_manager import PassManager, this_before_that_pass_constraint

from rope_dedup.config import RopeDedupConfig
from rope_dedup.passes.dedup_rope import DEDUP_ROPE
from rope_dedup.passes.fold_rope_constants import FOLD_ROPE_CONSTANTS
from rope_dedup.passes.merge_rope_subgraphs import MERGE_ROPE_SUBGRAPHS
from rope_dedup.passes.pass_base import GraphPass, PassContext, RopePassResult, run_passes
from rope_dedup.core.store import CanonicalStore

PASSES: tuple[GraphPass, ...] = (DEDUP_ROPE, MERGE_ROPE_SUBGRAPHS, FOLD_ROPE_CONSTANTS)
CONSTRAINTS = [this_before_that_pass_constraint(DEDUP_ROPE, MERGE_ROPE_SUBGRAPHS)]


def enabled_passes(config: RopeDedupConfig) -> list[GraphPass]:
    """The declared passes ``config`` turns on, in declared order (checked against the constraints)."""
    computed = config.computed_table_transforms()
    off = {MERGE_ROPE_SUBGRAPHS.name: not computed.merge, FOLD_ROPE_CONSTANTS.name: not computed.fold}
    passes = [p for p in PASSES if not off.get(p.name, False)]
    PassManager(passes, CONSTRAINTS).validate_constraints()
    return passes


def run_pipeline(gm: torch.fx.GraphModule, example_inputs: Sequence | None, config: RopeDedupConfig,
                 store: CanonicalStore) -> RopePassResult:
    """Run the passes ``config`` enables over ``gm`` in place, offering tables to ``store``."""
    return run_passes(gm, example_inputs, enabled_passes(config), PassContext(store, config.redirects_inputs()))
