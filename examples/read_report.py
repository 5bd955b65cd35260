"""Reading ``backend.report``: what was shared, what was skipped and why, and the bytes saved.

    python examples/read_report.py [--inner inductor|aot_eager|eager]

The model mixes plain cos/sin layers with a rotary-embedding-torch style layer whose cache is written
during forward: that one is state, not a constant, and the report says so.
"""

import argparse

import torch

from rope_dedup import RopeDedupBackend, SkipReason
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, homogeneous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor", help="backend rope_dedup hands the graph to")
    args = parser.parse_args()

    model = ToyDecoder(homogeneous(4, max_len=4096) + [TableRecipe(layout="lazy_cache", max_len=4096)]).eval()
    backend = RopeDedupBackend(inner=args.inner)
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randint(0, 64, (2, 16)))

    report = backend.report_for(model)  # members named by their path in `model`
    print(f"saved {report.bytes_saved / 1e6:.2f} MB ({report.bytes_before} -> {report.bytes_after} bytes)")
    for group in report.groups:
        print(f"shared: {group.key}: {len(group.members)} tables, {group.bytes_before} -> {group.bytes_after} bytes")
        for member in group.members:
            print(f"    {member}")
    rope_skips = [skip for skip in report.skipped if skip.kind is not SkipReason.TRAINABLE]
    for skip in rope_skips:
        print(f"skipped: {skip.path}: {skip.reason}")
    print(f"({len(report.skipped) - len(rope_skips)} trainable parameters skipped too; errors: {report.errors or 'none'})")
    print()
    print(report)  # the same, as a table


if __name__ == "__main__":
    main()
