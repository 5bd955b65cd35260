"""Regional compile (each block compiled on its own, as torchtitan does) with one shared backend.

    python examples/regional_compile.py [--inner inductor|aot_eager|eager]

Dynamo compiles the block graph once and feeds every other block's tables in at run time, so the
backend sees one layer's tables at compile time; the callable it returns shares the rest on first call.
Use one backend instance for all blocks: its canonical store is what the blocks share.
"""

import argparse

import torch

from rope_dedup import RopeDedupBackend
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors, unique_storages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor", help="backend rope_dedup hands the graph to")
    args = parser.parse_args()

    model = ToyDecoder(homogeneous(8, max_len=4096)).eval()
    tables = [tensor for _, tensor in rope_tensors(model)]
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        expected = model(tokens)

    backend = RopeDedupBackend(inner=args.inner)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend)
    with torch.no_grad():
        out = model(tokens)

    count, nbytes = unique_storages(tables)
    print(f"graphs compiled: {backend.graphs_compiled}; {len(tables)} RoPE tensors now in {count} storages "
          f"({nbytes / 1e6:.2f} MB)")
    torch.testing.assert_close(out, expected)
    print(backend.report_for(model))


if __name__ == "__main__":
    main()
