"""rope-dedup profile on a model of your own: a tiny random-init GPT-J from transformers.

    rope-dedup profile examples/profile_gptj.py:build [--regional transformer.h] [--train]
    python examples/profile_gptj.py [--inner inductor|aot_eager|eager] [--train] [--rounds 200]

Every ``GPTJAttention`` registers its own ``embed_positions`` table (cat(sin, cos), non-persistent), so
8 layers hold 8 identical tables. ``build`` follows the factory convention of ``rope-dedup profile`` and
``rope-dedup audit``: no arguments, returns ``(model, example_inputs)``. Needs transformers (the test
extra pins it).
"""

from __future__ import annotations

import argparse

import torch


def build() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=256, n_positions=16384, n_embd=128, n_layer=8, n_head=4, rotary_dim=32,
                        use_cache=False)
    return GPTJForCausalLM(config), (torch.randint(0, 256, (1, 64)),)


def main() -> int:
    from rope_dedup.tools.cli import main as cli

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", default="inductor", help="backend compared with, and used under rope_dedup")
    parser.add_argument("--train", action="store_true", help="forward, backward and AdamW steps")
    parser.add_argument("--rounds", type=int, default=200, help="rounds of the step-time comparison")
    args = parser.parse_args()
    return cli(["profile", f"{__file__}:build", "--regional", "transformer.h", "--inner", args.inner,
                "--steps", "3", "--step-seconds", "0.2", "--rounds", str(args.rounds),
                *(["--train"] if args.train else [])])


if __name__ == "__main__":
    raise SystemExit(main())
