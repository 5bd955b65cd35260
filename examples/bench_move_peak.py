"""The memory a move takes after ``share()``: one converted table per group, against one per layer unshared.

    python examples/bench_move_peak.py                                  # CPU: to(float64)
    python examples/bench_move_peak.py --device cuda                    # built on CPU, share(), .to("cuda")
    python examples/bench_move_peak.py --layers 32 --context 131072 --device cuda

Two copies of one toy decoder (one cos/sin table pair per layer) are built on CPU; one is shared with
``rope_dedup.share``; then each is moved the same way: ``.to(device)`` on CUDA (the flow most GPU users follow),
``.to(torch.float64)`` on CPU. The peak is what the move itself allocated at most, above what was allocated when
it began: ``torch.cuda.max_memory_allocated`` on CUDA, the allocator events of torch's profiler on CPU. The ideal
is the model's weights after the move plus one table per distinct key.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Callable

import torch

from rope_dedup import RopeDedupBackend, share
from rope_dedup.testing import toy_decoder as toy
from rope_dedup.tools.profile import allocator_peak


def move_peak(move: Callable[[], object], device: str) -> int:
    if device != "cuda":
        return allocator_peak(move)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    move()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda asked for, but CUDA is not available", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = toy.ToyDecoder(toy.homogeneous(args.layers, max_len=args.context), d_model=2 * args.head_dim, heads=2,
                           device="cpu").eval()
    unshared = copy.deepcopy(model)
    share(model, backend=RopeDedupBackend("eager"))
    target: dict = {"device": "cuda"} if args.device == "cuda" else {"dtype": torch.float64}
    figures = {}
    for name, which in (("unshared", unshared), ("shared", model)):
        figures[name] = move_peak(lambda: which.to(**target), args.device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table = args.context * args.head_dim // 2 * (4 if args.device == "cuda" else 8)
    ideal = weights + 2 * table
    storages = toy.unique_storages([t for _, t in toy.rope_tensors(model)])
    move = ".to('cuda')" if args.device == "cuda" else ".to(torch.float64)"
    print(f"{args.layers} layers, context {args.context}, head_dim {args.head_dim}: {move} after share()")
    print(f"  peak of the move, unshared: {figures['unshared'] / 2**20:9.1f} MiB")
    print(f"  peak of the move, shared:   {figures['shared'] / 2**20:9.1f} MiB  (ideal: weights + one table per "
          f"group = {ideal / 2**20:.1f} MiB; shared / ideal = {figures['shared'] / ideal:.3f})")
    print(f"  shared / unshared: {figures['shared'] / figures['unshared']:.3f}; RoPE storages after the move: "
          f"{storages[0]} ({storages[1] / 2**20:.1f} MiB)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**vars(args), **figures, "ideal": ideal, "storages_after": storages[0]}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
