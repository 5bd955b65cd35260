"""torch.export: drop duplicate RoPE tables from an ExportedProgram and measure the saved file.

    python examples/export_program.py [--layers 8] [--max-len 4096]

Every layer's cos/sin buffers are non-persistent, so the program carries them as constants: one copy
per layer before, one per distinct table after ``rope_dedup.dedup_exported``.
"""

import argparse
import os
import tempfile

import torch

from rope_dedup import dedup_exported
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous


def saved_bytes(ep: torch.export.ExportedProgram, directory: str, name: str) -> int:
    path = os.path.join(directory, name)
    torch.export.save(ep, path)
    return os.path.getsize(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=4096)
    args = parser.parse_args()

    model = ToyDecoder(homogeneous(args.layers, max_len=args.max_len)).eval()
    tokens = torch.randint(0, 64, (2, 16))
    ep = torch.export.export(model, (tokens,))
    deduped = dedup_exported(ep)
    report = deduped.graph_module.meta["rope_dedup_report"]

    with tempfile.TemporaryDirectory() as directory:
        before, after = saved_bytes(ep, directory, "before.pt2"), saved_bytes(deduped, directory, "after.pt2")
        reloaded = torch.export.load(os.path.join(directory, "after.pt2"))
    print(f"constants: {len(ep.constants)} -> {len(deduped.constants)}")
    print(f"RoPE bytes: {report.bytes_before / 1e6:.2f} MB -> {report.bytes_after / 1e6:.2f} MB")
    print(f"torch.export.save file: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB ({after / before:.2f}x)")
    with torch.no_grad():
        torch.testing.assert_close(reloaded.module()(tokens), model(tokens), rtol=0, atol=0)
    print("reloaded program equals eager")


if __name__ == "__main__":
    main()
