"""Rewrite every use of a duplicate table node to its canonical node."""

from __future__ import annotations

import torch.fx


def redirect_to_canonical(gm: torch.fx.GraphModule, duplicates: dict[torch.fx.Node, torch.fx.Node]) -> bool:
    """Point each duplicate's users at its canonical node; drop duplicate ``get_attr`` nodes left unused.

    Placeholders stay (a compiled graph's signature is fixed by its caller) but lose their users.
    Returns whether the graph changed; the caller lints and recompiles it.
    """
    modified = False
    for duplicate, canonical in duplicates.items():
        if duplicate.users:
            duplicate.replace_all_uses_with(canonical)
            modified = True
        if duplicate.op == "get_attr":
            gm.graph.erase_node(duplicate)
            modified = True
    return modified
