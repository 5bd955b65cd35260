"""Graph rewrites, installed as ``rope_dedup.passes``: each module one pass or analysis, named for its job.
A pass module's ``rewrite(gm, example_inputs, context)`` is what the loop runs, and a function of the
module's name runs that pass alone.

- :mod:`pipeline` declares the passes the backend runs, in order, and :mod:`pass_base` the loop that
  runs them (lint, recompile and timing once per pass) and the result every pass returns;
- :mod:`dedup_rope` shares identical RoPE tables through the canonical store and rewrites their uses;
- :mod:`merge_rope_subgraphs` merges identical RoPE computations in ``forward`` (CSE);
- :mod:`fold_rope_constants` folds constant-only RoPE computations into one shared table each;
- :mod:`recompute_reads` gives an exported program's table reads the rows they read, computed from a
  frequency vector (``rope_dedup.dedup_exported(ep, tables="recompute")``, which shares as ``dedup_rope``
  does for a ``torch.export`` program);

and the analyses they use: :mod:`find_candidates` lists the module state a graph reads,
:mod:`find_mutations` finds values written in place (the package's rules for "may alias" and
"writes"), :mod:`find_pure_nodes` the nodes safe to merge or compute ahead of time, and
:mod:`redirect_to_canonical` points the uses of duplicate nodes at one node.
"""
