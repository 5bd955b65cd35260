"""What recognizing one RoPE table costs in memory and time, per layout: the pass recognizes each distinct
table while every layer's copy is still alive, so its transient adds to the peak.

    python examples/bench_recognition_peak.py                 # 16 MiB tables (65536 positions, width 64)
    python examples/bench_recognition_peak.py --length 131072

Memory is the allocator's peak during recognition (torch's profiler records every allocation and free),
set beside the table's size and beside what a whole-table float64 copy, as recognition made before, costs.
Target: at most a quarter of the table (4 MiB for a 16 MiB float32 table).
"""

from __future__ import annotations

import argparse
import time

import torch

from rope_dedup.tools.profile import allocator_peak
from rope_dedup.tables.recognize import RopeTable, recognize_rope_table

TABLES = {  # layout -> table from the (length, width / 2) angles, as model code builds it
    "cos halves (HF)": lambda a: torch.cat([a, a], -1).cos(),
    "sin halves (HF)": lambda a: torch.cat([a, a], -1).sin(),
    "cos|sin (torchtitan)": lambda a: torch.cat([a.cos(), a.sin()], -1),
    "complex (freqs_cis)": lambda a: torch.polar(torch.ones_like(a), a),
    "stacked cos,sin": lambda a: torch.stack([a.cos(), a.sin()], -1),
    "cos halves bf16": lambda a: torch.cat([a, a], -1).cos().bfloat16(),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=65536)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    inv = 1.0 / 10000 ** (torch.arange(0, args.width, 2, dtype=torch.float32) / args.width)
    angles = torch.outer(torch.arange(args.length, dtype=torch.float32), inv)
    print(f"{'layout':<22}{'table':>10}{'peak':>10}{'÷ table':>9}{'f64 copy':>10}{'ms':>8}  target <= 1/4")
    for name, build in TABLES.items():
        table = build(angles)
        recognize_rope_table(table)  # first-call work (kernels, thread pools) is not recognition's
        started = time.perf_counter()
        found = recognize_rope_table(table)
        ms = (time.perf_counter() - started) * 1e3
        assert isinstance(found, RopeTable), (name, found)
        peak = allocator_peak(lambda: recognize_rope_table(table))
        size = table.numel() * table.element_size()
        copy = table.numel() * (16 if table.is_complex() else 8)
        print(f"{name:<22}{size / 2**20:>8.1f}Mi{peak / 2**20:>8.2f}Mi{peak / size:>9.1%}{copy / 2**20:>8.1f}Mi"
              f"{ms:>8.1f}  {'met' if peak <= size / 4 else 'NOT MET'}")


if __name__ == "__main__":
    main()
