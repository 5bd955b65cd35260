"""The precision survey of model libraries other than transformers: torchtitan's, torchtune's and litgpt's RoPE
tables, each built by the library's own code at a real model's settings (head dim, theta, scaling, context),
through the static precision audit against that model's RoPE (``explain(holder, expect=spec, precision=True)``).

    python tests/precision_libraries.py titan            # in the test venv (torchtitan 0.3.0)
    python tests/precision_libraries.py torchtune litgpt # in a venv that has them (docs/audit.md says how)

Only the rotary module (torchtitan, torchtune) or the model-level cos/sin (litgpt's ``build_rope_cache``) is
built: a table depends on nothing else, and a 128K-position table of an 8B model is the size it would be.
A line per table: library, model, table, dtype, positions, class, the worst angle difference from the
reference implementation, from float64 math, and the reference's own distance from float64.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, Iterator

import torch
import torch.nn as nn

from rope_dedup import RopeSpec, explain
from rope_dedup.audit.spec import Scaling

Case = tuple[str, str, Callable[[], nn.Module], RopeSpec]


def _llama3(factor: float = 8.0, original: int = 8192) -> Scaling:
    return Scaling("llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=original)


def _holder(**modules: nn.Module) -> nn.Module:
    holder = nn.Module()
    for name, module in modules.items():
        holder.add_module(name, module)
    return holder


def titan() -> Iterator[Case]:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import torchtitan_models

    common = torchtitan_models.import_torchtitan().common

    def rope(config) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            module = config.build()
            module._init_self_buffers()
            return _holder(rope=module)
        return build

    yield ("torchtitan 0.3.0", "llama3 8B (ComplexRoPE, llama scaling)",
           rope(common.ComplexRoPE.Config(dim=128, max_seq_len=131072, theta=500000, scaling="llama")),
           RopeSpec(500000, rotary_dim=128, scaling=_llama3()))
    yield ("torchtitan 0.3.0", "qwen3 (CosSinRoPE)", rope(common.CosSinRoPE.Config(dim=128, max_seq_len=40960, theta=1e6)),
           RopeSpec(1e6, rotary_dim=128))
    yield ("torchtitan 0.3.0", "deepseek_v3 (ComplexRoPE, YaRN x40)",
           rope(common.ComplexRoPE.Config(dim=64, max_seq_len=163840, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                          beta_fast=32.0, beta_slow=1.0, original_seq_len=4096)),
           RopeSpec(10000.0, rotary_dim=64, scaling=Scaling("yarn", factor=40.0, original_max_position_embeddings=4096),
                    attention_factor=1.0))


def torchtune() -> Iterator[Case]:
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import RotaryPositionalEmbeddings

    yield ("torchtune 0.6.1", "llama3.1 8B (Llama3ScaledRoPE)",
           lambda: _holder(rope=Llama3ScaledRoPE(128, max_seq_len=131072, base=500000)),
           RopeSpec(500000, rotary_dim=128, scaling=_llama3()))
    yield ("torchtune 0.6.1", "llama3 8B (RotaryPositionalEmbeddings)",
           lambda: _holder(rope=RotaryPositionalEmbeddings(128, max_seq_len=8192, base=500000)),
           RopeSpec(500000, rotary_dim=128))
    yield ("torchtune 0.6.1", "qwen2.5 7B (Qwen2RotaryPositionalEmbeddings)",
           lambda: _holder(rope=Qwen2RotaryPositionalEmbeddings(128, max_seq_len=32768, base=1e6)),
           RopeSpec(1e6, rotary_dim=128))


def litgpt() -> Iterator[Case]:
    from litgpt.config import Config
    from litgpt.model import build_rope_cache

    class GPT(nn.Module):  # the cos and sin litgpt's GPT registers, as build_rope_cache makes them
        def __init__(self, config) -> None:
            super().__init__()
            extra = None
            if config.rope_adjustments is not None:
                extra = {**config.rope_adjustments}
            cos, sin = build_rope_cache(config.block_size, config.rope_n_elem, torch.device("cpu"), base=config.rope_base,
                                        condense_ratio=config.rope_condense_ratio, extra_config=extra)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    settings = {"Llama-3.1-8B": _llama3(), "Qwen2.5-7B": None, "pythia-1b": None, "gemma-2-9b": None,
                "Mistral-7B-v0.1": None}
    for name, scaling in settings.items():
        config = Config.from_name(name)
        yield ("litgpt 0.5.13", f"{name} (build_rope_cache)", lambda config=config: GPT(config),
               RopeSpec(float(config.rope_base), rotary_dim=config.rope_n_elem, scaling=scaling))


LIBRARIES = {"titan": titan, "torchtune": torchtune, "litgpt": litgpt}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("libraries", nargs="+", choices=sorted(LIBRARIES))
    args = parser.parse_args(argv)
    logging.getLogger("rope_dedup").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    for library in args.libraries:
        for source, model, build, spec in LIBRARIES[library]():
            explanation = explain(build(), expect=spec, precision=True)
            for table in explanation.precision:
                figures = [f"{d.angle:.2g}" if d is not None else "-"
                           for d in (table.to_reference, table.to_float64, table.reference_to_float64)]
                print(" | ".join([source, model, table.source, str(table.dtype).removeprefix("torch."), str(table.length),
                                  table.verdict, *figures, table.cause or table.reference]), flush=True)
            for mismatch in explanation.mismatches:
                print(f"  finding: {mismatch.layer}: {mismatch.field}: {mismatch.found}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
