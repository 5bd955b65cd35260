"""No table at all: RoPE rows computed where they are read (``share(model, tables="recompute")``).

``recipe`` finds how a table was computed, bit for bit; ``table`` is the tensor subclass that computes the
rows a read reads; ``convert`` puts one in each table's place.
"""

from rope_dedup.recompute.convert import Conversion, recompute_tables, restore_values, values_in_place
from rope_dedup.recompute.recipe import Recipe, find_recipe
from rope_dedup.recompute.table import RecomputedTable

__all__ = ["Conversion", "Recipe", "RecomputedTable", "find_recipe", "recompute_tables", "restore_values", "values_in_place"]
