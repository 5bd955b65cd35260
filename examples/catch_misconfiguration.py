"""Catch silent RoPE misconfiguration: one small model per bug class the field has shipped.

    python examples/catch_misconfiguration.py
    rope-dedup audit examples/catch_misconfiguration.py:theta_ignored --expect theta=5e5
    rope-dedup audit examples/catch_misconfiguration.py:llama3_dropped --expect config   # exit 1
    rope-dedup audit examples/catch_misconfiguration.py:llama3_correct --expect config   # exit 0
    rope-dedup audit examples/catch_misconfiguration.py:rope_unfilled_after_to_empty --static  # exit 1
    rope-dedup audit examples/catch_misconfiguration.py:theta_lost_in_rope_parameters --static --expect config

Each factory builds a tiny random-init model (nothing is downloaded) that carries the bug; called with
``fixed=True`` it builds the same model without it. None of these bugs raises an error: the model runs,
only its output is quietly worse, mostly at long positions. ``rope_dedup.explain(model, *inputs,
expect=...)`` compares the cos/sin each attention layer applies with what was asked for, and names the
layer and the field. The last two bugs are there before any forward: their factories return the model
alone, and ``rope_dedup.explain(model, expect=...)`` audits the tables it holds, statically, right
after init. :data:`CASES` lists each factory with its expectation and the field it must flag.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import rope_dedup
from rope_dedup import RopeSpec

SEQ = 16  # tokens of the example inputs: short, but float32 tables show every bug below within them


# -- hand-written: the configured theta never reaches the tables (gemma.cpp #986) --------------------------

class Attention(nn.Module):
    """Causal self-attention that rotates q and k by RoPE computed in forward from ``inv_freq``."""

    def __init__(self, hidden: int, heads: int, theta: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.register_buffer("inv_freq", 1.0 / theta ** exponents, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), self.inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rotate(t: torch.Tensor) -> torch.Tensor:
            first, second = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-second, first], -1) * sin

        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return y.transpose(1, 2).reshape(batch, seq, hidden)


class TinyDecoder(nn.Module):
    """Configured with ``rope_theta``; with ``read_theta=False`` its layers use the built-in 1e4 instead."""

    def __init__(self, rope_theta: float = 5e5, layers: int = 2, hidden: int = 32, heads: int = 2,
                 read_theta: bool = True) -> None:
        super().__init__()
        self.rope_theta = rope_theta
        theta = rope_theta if read_theta else 1e4  # the bug: the dense path never reads rope_theta
        self.embed = nn.Embedding(64, hidden)
        self.layers = nn.ModuleList(Attention(hidden, heads, theta) for _ in range(layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return x


def theta_ignored(fixed: bool = False) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Every layer runs at the built-in theta 1e4, whatever ``rope_theta`` says."""
    torch.manual_seed(0)
    return TinyDecoder(rope_theta=5e5, read_theta=fixed).eval(), (torch.randint(0, 64, (1, SEQ)),)


# -- transformers models, built tiny from configs --------------------------------------------------------

def _tiny(config_class: type, **settings: Any):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    return config_class(**{**common, **settings})


def _inputs(seq: int = SEQ) -> tuple[torch.Tensor]:
    return (torch.randint(3, 64, (1, seq)),)


def _llama(**settings: Any):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = _tiny(LlamaConfig, **settings)
    return LlamaForCausalLM(config).eval(), config


def _rotary_without(model, config, **changes: Any) -> None:
    """Rebuild the model-level rotary embedding from a copy of ``config`` with ``changes``: what a code path
    that reads the settings wrongly builds, while ``model.config`` keeps saying what was intended."""
    import copy

    wrong = copy.deepcopy(config)
    wrong.rope_parameters = {**config.rope_parameters, **changes}
    if changes.get("rope_type") == "default":
        wrong.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    model.model.rotary_emb = type(model.model.rotary_emb)(wrong)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def llama3_dropped(fixed: bool = False):
    """Llama 3.1: ``rope_scaling`` (llama3) is in the config but the rotary embedding ignores it (unsloth #6197)."""
    model, config = _llama(rope_parameters=dict(LLAMA3), max_position_embeddings=131072)
    if not fixed:
        _rotary_without(model, config, rope_type="default")
    return model, _inputs()


def scaling_factor_wrong(fixed: bool = False):
    """llama3 scaling with factor 8 where the checkpoint needs 32 (llama-models #241)."""
    model, config = _llama(rope_parameters=dict(LLAMA3), max_position_embeddings=131072)
    if not fixed:
        _rotary_without(model, config, factor=8.0)
    return model, _inputs()


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}


def yarn_attention_factor_dropped(fixed: bool = False):
    """YaRN frequencies right, but cos/sin not scaled by the attention factor 0.1 ln(4) + 1 (vLLM #48623)."""
    model, _ = _llama(rope_parameters=dict(YARN))
    if not fixed:
        model.model.rotary_emb.attention_scaling = 1.0
    return model, _inputs()


def partial_rotary_ignored(fixed: bool = False):
    """Phi with ``partial_rotary_factor`` 0.5, where the rotary path rotates the whole head (maxtext #4616)."""
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    config = _tiny(PhiConfig, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    model = PhiForCausalLM(config).eval()
    if not fixed:
        _rotary_without(model, config, partial_rotary_factor=1.0)
        for layer in model.model.layers:
            layer.self_attn.rotary_ndims = layer.self_attn.head_dim
    return model, _inputs()


def gemma3_local_global_swapped(fixed: bool = False):
    """Gemma 3: sliding layers get the global table and global layers the local one (llama.cpp #14367)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = _tiny(Gemma3TextConfig, num_key_value_heads=1, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"])
    model = Gemma3ForCausalLM(config).eval()
    if not fixed:
        rotary = model.model.rotary_emb
        local, global_ = rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq
        rotary.sliding_attention_inv_freq, rotary.full_attention_inv_freq = global_, local
    return model, _inputs()


def inv_freq_in_bf16(fixed: bool = False):
    """``model.to(torch.bfloat16)`` also rounds ``inv_freq`` to bfloat16 (transformers #29496).

    The tables are bfloat16 either way, so the tolerance is bfloat16's: the rounded frequencies show as the
    angles grow, here over 1024 positions.
    """
    model, config = _llama(max_position_embeddings=2048)
    model = model.to(torch.bfloat16)
    if fixed:  # keep the frequencies in float32, as the rotary embedding computed them
        rotary = model.model.rotary_emb
        rotary.inv_freq = rotary.compute_default_rope_parameters(config)[0]
        rotary.original_inv_freq = rotary.inv_freq.clone()  # what dynamic scaling resets to
    return model, _inputs(1024)


# -- before any forward: the static audit ------------------------------------------------------------------

def rope_unfilled_after_to_empty(fixed: bool = False) -> nn.Module:
    """Built on meta, ``to_empty`` on CPU, then an init loop that knows weights but not the RoPE buffers:
    they keep whatever memory ``to_empty`` handed out (torchtitan #4783, where transformers 5 made the
    re-init a no-op). Deterministic algorithms fill that memory with NaN here, so the example does not
    depend on what the allocator had; in a real run it is zeros or leftovers, flagged the same way.
    The fix calls transformers' own ``init_weights``, which recomputes ``inv_freq``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(_tiny(LlamaConfig))
    torch.use_deterministic_algorithms(True)  # and fill_uninitialized_memory, on by default: empty is NaN
    try:
        model.to_empty(device="cpu")
    finally:
        torch.use_deterministic_algorithms(False)
    if fixed:
        model.init_weights()
    else:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
                elif hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
                    nn.init.ones_(module.weight)  # the norms
    return model.eval()


def theta_lost_in_rope_parameters(fixed: bool = False) -> nn.Module:
    """Model code written for transformers 4 reads ``getattr(config, "rope_theta", 1e4)``; transformers 5
    moved theta into ``config.rope_parameters``, so the attribute is gone and every layer silently gets the
    default (DeepSpeed #8341, SpecForge #702). The fix reads ``rope_parameters``."""
    from transformers import LlamaConfig

    config = _tiny(LlamaConfig, hidden_size=32, num_attention_heads=2,
                   rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    theta = config.rope_parameters["rope_theta"] if fixed else getattr(config, "rope_theta", 1e4)
    torch.manual_seed(0)
    model = TinyDecoder(rope_theta=theta)
    model.config = config
    return model.eval()


def llama3_correct():
    """The Llama 3.1 model of :func:`llama3_dropped` without the bug: a factory for the command line."""
    return llama3_dropped(fixed=True)


Factory = Callable[..., "tuple[nn.Module, tuple]"]
# name -> (factory, expectation, (layer, field) pairs the buggy model must be flagged with)
CASES: dict[str, tuple[Factory, Any, list[tuple[str, str]]]] = {
    "theta_ignored": (theta_ignored, RopeSpec(theta=5e5), [("layers.0", "theta"), ("layers.1", "theta")]),
    "llama3_dropped": (llama3_dropped, "config", [("model.layers.0", "scaling"), ("model.layers.1", "scaling")]),
    "scaling_factor_wrong": (scaling_factor_wrong, "config",
                             [("model.layers.0", "scaling"), ("model.layers.1", "scaling")]),
    "yarn_attention_factor_dropped": (yarn_attention_factor_dropped, "config",
                                      [("model.layers.0", "attention_factor"), ("model.layers.1", "attention_factor")]),
    "partial_rotary_ignored": (partial_rotary_ignored, "config",
                               [("model.layers.0", "rotary_dim"), ("model.layers.1", "rotary_dim")]),
    "gemma3_local_global_swapped": (gemma3_local_global_swapped, "config",
                                    [("model.layers.0", "theta"), ("model.layers.1", "theta")]),
    "inv_freq_in_bf16": (inv_freq_in_bf16, "config",
                         [("model.layers.0", "frequency dtype"), ("model.layers.1", "frequency dtype")]),
    # Static: the factory returns the model alone.
    "rope_unfilled_after_to_empty": (rope_unfilled_after_to_empty, "config",
                                     [("model.rotary_emb", "content"), ("model.rotary_emb", "content")]),
    "theta_lost_in_rope_parameters": (theta_lost_in_rope_parameters, "config",
                                      [("layers.0", "theta"), ("layers.1", "theta")]),
}


def main() -> None:
    for name, (factory, expect, _) in CASES.items():
        for fixed in (False, True):
            built = factory(fixed=fixed)
            model, inputs = built if isinstance(built, tuple) else (built, ())  # no inputs: no forward
            explanation = rope_dedup.explain(model, *inputs, expect=expect)
            label = f"{name} ({'fixed' if fixed else 'bug'})"
            if not explanation.mismatches:
                print(f"{label}: every {'table holds' if explanation.static else 'layer applies'} the expected RoPE")
            for m in explanation.mismatches:
                print(f"{label}: {m.layer}: {m.field}: expected {m.expected}, found {m.found}")


if __name__ == "__main__":
    main()
