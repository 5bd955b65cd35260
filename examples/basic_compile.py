"""torch.compile with the rope_dedup backend: eight layers' identical RoPE tables end up in one storage.

    python examples/basic_compile.py [--inner inductor|aot_eager|eager]

``backend="rope_dedup"`` (registered on import) is the same backend with the inductor inner backend.
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
    count, nbytes = unique_storages(tables)
    print(f"before: {len(tables)} RoPE tensors in {count} storages, {nbytes / 1e6:.2f} MB")

    compiled = torch.compile(model, backend=RopeDedupBackend(inner=args.inner))
    with torch.no_grad():
        out = compiled(tokens)

    count, nbytes = unique_storages(tables)
    print(f"after:  {len(tables)} RoPE tensors in {count} storages, {nbytes / 1e6:.2f} MB")
    torch.testing.assert_close(out, expected)
    print("outputs equal eager")


if __name__ == "__main__":
    main()
