"""Graph rewrites, installed as ``rope_dedup.passes``: each module one pass or analysis, named for its job.

- :mod:`find_rope_tables` lists the module state a graph reads (the candidates);
- :mod:`find_mutations` finds values written in place, directly or through views;
- :mod:`redirect_to_canonical` rewrites uses of duplicate table nodes to the canonical node;
- :mod:`dedup_rope` is the pass that ties them to the canonical store;
- :mod:`find_pure_nodes` finds the nodes safe to merge or to compute ahead of time;
- :mod:`merge_rope_subgraphs` merges identical RoPE computations in ``forward`` (CSE);
- :mod:`fold_rope_constants` folds constant-only RoPE computations into one shared table each.
"""
