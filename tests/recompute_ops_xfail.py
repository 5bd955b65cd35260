"""What tests/test_recompute_ops.py finds today: each (op, variant) whose recomputed twin differs from the plain
table, with the causes that differ and the first difference seen (its dtype, sample and placement).

Strict: an entry that stops differing, or differs by another cause, fails its test, so the list shrinks as the
recomputed table comes to behave as the table it replaces; a new difference fails too. Variants: function,
method, inplace, out (the table as ``out=``), grad_in (``op(x * table)``), grad_out (``op(table) * x``).
``python tests/test_recompute_ops.py [op ...]`` rewrites it from a run (about 10 minutes for all of op_db).
"""

from differential import CONJ_NEG, ERRORS, GRADS, LAYOUT, NEW_ERRORS, VALUES, WRITES  # noqa: F401

XFAIL: dict[tuple[str, str], tuple[set[str], str]] = {

}
