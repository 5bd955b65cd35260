"""The RoPE audit: which (theta, dim, length, ...) each layer's tables really carry, shares nothing.

    python examples/audit.py
    rope-dedup audit examples/audit.py:build

The model is configured for theta 5e5, but its last layer (think of an MTP layer built outside the
config) fell back to the default 1e4: no error anywhere, only worse output. The audit marks it.
"""

import torch

import rope_dedup
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, homogeneous


def build() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """The factory ``rope-dedup audit`` calls: (model, example_inputs)."""
    specs = homogeneous(5, theta=5e5, max_len=2048) + [TableRecipe(max_len=2048)]
    return ToyDecoder(specs).eval(), (torch.randint(0, 64, (1, 16)),)


if __name__ == "__main__":
    model, inputs = build()
    explanation = rope_dedup.explain(model, *inputs)
    print(explanation)
    for layer in explanation.odd_layers:
        print(f"check {layer.layer}: {'; '.join(layer.differs)}")
