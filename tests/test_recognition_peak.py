"""Recognition must not raise the peak: it runs while every layer's copy is still alive. Its transient is
measured with the CPU allocator as torch's profiler reports it (every allocation and free, in bytes),
and must stay within a quarter of the table, whatever the layout and dtype."""

from __future__ import annotations

import math

import pytest
import torch

from rope_dedup.tools.profile import allocator_peak
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table

LENGTH, DIM = 65536, 64  # a 16 MiB float32 table


def angles(length: int = LENGTH, dim: int = DIM) -> torch.Tensor:
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return torch.outer(torch.arange(length, dtype=torch.float32), inv)


TABLES = {
    "cos": lambda a: torch.cat([a, a], -1).cos(),
    "sin": lambda a: torch.cat([a, a], -1).sin(),
    "titan_cos_sin": lambda a: torch.cat([a.cos(), a.sin()], -1),
    "complex": lambda a: torch.polar(torch.ones_like(a), a),
    "stacked": lambda a: torch.stack([a.cos(), a.sin()], -1),
    "bfloat16": lambda a: torch.cat([a, a], -1).cos().bfloat16(),
    "float16_sin": lambda a: torch.cat([a, a], -1).sin().half(),
    "hf_4d": lambda a: torch.cat([a, a], -1).cos()[None, None],
    "lazy_cache": lambda a: torch.cat([torch.cat([a[:1000], a[:1000]], -1),
                                       torch.zeros(LENGTH - 1000, 2 * a.shape[1])]),
    "short": lambda a: torch.cat([a[:4096], a[:4096]], -1).cos(),
}


@pytest.mark.parametrize("layout", TABLES)
def test_recognition_allocates_at_most_a_quarter_of_the_table(layout: str) -> None:
    table = TABLES[layout](angles())
    recognize_rope_table(table)  # first-call work (kernels, thread pools) is not recognition's
    found = None

    def recognize() -> None:
        nonlocal found
        found = recognize_rope_table(table)

    peak = allocator_peak(recognize)
    table_bytes = table.numel() * table.element_size()
    assert isinstance(found, RopeTable), found
    assert peak <= table_bytes / 4, f"{layout}: {peak / 2**20:.2f} MiB for a {table_bytes / 2**20:.0f} MiB table"


def test_sixteen_mib_table_costs_at_most_four_mib() -> None:
    table = torch.cat([angles(), angles()], -1).cos()
    assert table.numel() * table.element_size() == 16 << 20
    recognize_rope_table(table)
    assert allocator_peak(lambda: recognize_rope_table(table)) <= 4 << 20


def test_the_meter_sees_a_whole_table_copy() -> None:
    """The meter would catch the copy recognition used to make: a float64 copy is twice a float32 table."""
    table = torch.cat([angles(), angles()], -1).cos()
    peak = allocator_peak(lambda: table.to(torch.float64).abs().max())
    assert math.isclose(peak, 2 * 2 * table.numel() * table.element_size(), rel_tol=0.01)


@pytest.mark.parametrize("layout", ["cos", "complex", "titan_cos_sin"])
def test_the_equality_check_compares_in_place(layout: str) -> None:
    """Sharing rests on exact equality, checked without a copy of either table."""
    from rope_dedup.tensors import same_values

    a, b = TABLES[layout](angles()), TABLES[layout](angles())
    assert same_values(a, b)
    assert allocator_peak(lambda: same_values(a, b)) == 0
