"""Heterogeneous RoPE (Gemma-style local/global layers): each distinct table is kept once, never mixed.

    python examples/local_global.py [--inner inductor|aot_eager|eager]

Every third layer uses theta 1e6, the others 1e4: six layers share two cos/sin pairs, one per theta.
"""

import argparse

import torch

from rope_dedup import RopeDedupBackend
from rope_dedup.testing.toy_decoder import ToyDecoder, local_global, rope_tensors, unique_storages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor", help="backend rope_dedup hands the graph to")
    args = parser.parse_args()

    model = ToyDecoder(local_global(6, every=3, max_len=4096)).eval()
    tables = [tensor for _, tensor in rope_tensors(model)]
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        expected = model(tokens)

    backend = RopeDedupBackend(inner=args.inner)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(tokens)

    count, _ = unique_storages(tables)
    print(f"{len(tables)} RoPE tensors now in {count} storages")
    for group in backend.report.groups:
        print(f"  theta={group.key.theta:g} {group.key.layout}: {len(group.members)} layers share one table")
    torch.testing.assert_close(out, expected)


if __name__ == "__main__":
    main()
