"""Real models from real libraries, built tiny from random-init configs: a registry for the tests.

Each entry of :data:`REAL_MODELS` is a factory that imports its library (``pytest.importorskip``, so a
missing library skips the test instead of failing it), seeds the RNG, builds the model from a small
config (``LAYERS`` = 2 layers, hidden 32-64, 256 positions; nothing is downloaded) and returns a
:class:`RealCase`. Calling a factory twice gives two models with identical weights and tables, so a
test can compile one with the pass and one without and compare outputs bitwise.

Expected outcomes are stated here from how each library builds its tables (its source, pinned version
in pyproject's ``test`` extra), never from what rope_dedup reports:

- ``ideal_storages``: unique storages behind ``rope_tensors(model)`` after ideal dedup under the default
  policy (persistent buffers keep their own storage), once the model has been called a few times.
- ``ideal_storages_share_persistent``: the same with ``RopeDedupBackend(share_persistent=True)``.
- ``expected_skips``: table name -> a substring of the reason the report must give for keeping it apart
  (default policy). Tables neither here nor in ``unread`` must end up shared in a report group.
- ``unread``: tables that ``forward`` never reads (HF's ``original_inv_freq``): no graph sees them, so the
  report does not mention them and they keep their storage.

Models covered (each factory's docstring says where its per-layer tables come from), ``LAYERS`` each:

- ``transformers-gptj``, ``transformers-codegen`` (transformers): per-attention ``embed_positions``
  cat(sin, cos) non-persistent buffer.
- ``transformers-recurrentgemma`` (transformers): per-attention ``rotary_emb.inv_freq`` (non-persistent),
  plus an ``original_inv_freq`` copy forward never reads.
- ``fair-esm-esm2`` (fair-esm): per-attention persistent ``inv_freq`` and lazily assigned cos/sin caches.
- ``rotary-embedding-torch``: attention layers each owning the library's ``RotaryEmbedding``: a frozen
  ``freqs`` parameter and a ``cached_freqs`` buffer written in place by forward.

Checked and left out because nothing is duplicated per layer in transformers 5.23.0: Llama and Gemma3
(one rotary module at model level, cos/sin computed in forward from its inv_freq; Gemma3's computes
local and global tables by layer type) and HF's ESM (one model-level ``rotary_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

Tables = Callable[[nn.Module], "list[tuple[str, torch.Tensor]]"]

LAYERS = 2  # every model: enough for one duplicate per table, and whole-model compiles stay fast
TOKENS = (2, 16)  # batch, sequence of the example inputs

PERSISTENT = "in the state_dict"  # start of rope_dedup.core.eligibility.SkipReason.PERSISTENT


@dataclass
class RealCase:
    """One tiny real model and what ideal RoPE dedup must leave of its tables.

    ``model`` is in eval mode; ``example_inputs`` is the positional-argument tuple for ``model(*args)``;
    ``output`` picks the tensor to compare out of whatever the model returns (logits). ``blocks`` returns
    the ``nn.ModuleList`` of layers for regional (per-block) compile, or is None when the library's
    structure does not allow it. ``rope_tensors(model)`` lists ``(full name, tensor)`` for every RoPE
    table the model holds at the time of the call (lazy caches appear once forward has filled them);
    pass the unwrapped model (no ``_orig_mod``) so names are stable.
    """

    name: str
    library: str  # "dist==version" of the library the model comes from
    model: nn.Module
    example_inputs: tuple
    ideal_storages: int
    rope_tensors: Tables
    ideal_storages_share_persistent: int | None = None  # None: same as ideal_storages
    expected_skips: dict[str, str] = field(default_factory=dict)
    unread: frozenset[str] = frozenset()
    blocks: Callable[[nn.Module], nn.ModuleList] | None = None
    output: Callable[[Any], torch.Tensor] = lambda out: out
    notes: str = ""

    def ideal(self, share_persistent: bool = False) -> int:
        if share_persistent and self.ideal_storages_share_persistent is not None:
            return self.ideal_storages_share_persistent
        return self.ideal_storages

    def skips(self, share_persistent: bool = False) -> dict[str, str]:
        """Expected skip reasons under the given policy (persistent buffers are shared when opted in)."""
        if not share_persistent:
            return dict(self.expected_skips)
        return {name: reason for name, reason in self.expected_skips.items() if reason != PERSISTENT}


def unique_storages(tensors) -> int:
    """Distinct storages behind ``tensors`` (by ``untyped_storage().data_ptr()``)."""
    return len({t.untyped_storage().data_ptr() for t in tensors})


def distinct_contents(tensors) -> int:
    """How many distinct tables (dtype, shape and values all equal) ``tensors`` hold."""
    distinct: list[torch.Tensor] = []
    for tensor in tensors:
        if not any(t.dtype == tensor.dtype and t.shape == tensor.shape and torch.equal(t, tensor) for t in distinct):
            distinct.append(tensor)
    return len(distinct)


def _named(model: nn.Module, attrs: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    """(full name, tensor) of every buffer, parameter and plain tensor attribute named one of ``attrs``."""
    found = []
    for prefix, module in model.named_modules():
        state = {**module._parameters, **module._buffers,
                 **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        for attr, tensor in state.items():
            if tensor is not None and attr in attrs:
                found.append((f"{prefix}.{attr}" if prefix else attr, tensor))
    return sorted(found, key=lambda item: item[0])


def _pin(distribution: str) -> str:
    return f"{distribution}=={version(distribution)}"


def _quiet_transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()  # tiny vocab vs default bos/eos ids: a warning per build
    return transformers


# -- transformers -------------------------------------------------------------------------------------

def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, TOKENS, generator=torch.Generator().manual_seed(1))


def _embed_positions_case(name: str, config_class: str, model_class: str, **config) -> RealCase:
    """GPT-J and CodeGen: each attention layer holds ``embed_positions``, the same cat(sin, cos) table."""
    transformers = _quiet_transformers()
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(vocab_size=128, n_positions=256, n_embd=64, n_layer=LAYERS,
                                                 n_head=4, rotary_dim=8, use_cache=False, **config)
    model = getattr(transformers, model_class)(config).eval()
    tables = lambda m: _named(m, ("embed_positions",))
    return RealCase(name, _pin("transformers"), model,
                    (_tokens(128),), ideal_storages=distinct_contents(t for _, t in tables(model)),
                    rope_tensors=tables, blocks=lambda m: m.transformer.h, output=lambda out: out.logits)


def gptj() -> RealCase:
    """GPT-J: every ``GPTJAttention`` registers ``embed_positions`` = cat(sin, cos) ``(n_positions,
    rotary_dim)``, non-persistent, from the same ``create_sinusoidal_positions``: one per layer -> 1 (2 -> 1)."""
    return _embed_positions_case("transformers-gptj", "GPTJConfig", "GPTJForCausalLM")


def codegen() -> RealCase:
    """CodeGen: same per-layer ``embed_positions`` as GPT-J, read by indexing (``embed_positions[ids]``)
    instead of ``gather`` on a repeated copy: one per layer -> 1 (2 -> 1)."""
    return _embed_positions_case("transformers-codegen", "CodeGenConfig", "CodeGenForCausalLM", n_ctx=256)


def recurrent_gemma() -> RealCase:
    """RecurrentGemma with every block an attention block: each ``temporal_block`` owns a
    ``RecurrentGemmaRotaryEmbedding`` with a non-persistent ``inv_freq`` (partial rotary: head_dim 16,
    rotary dim 8) that forward turns into cos/sin, plus ``original_inv_freq`` that forward never reads.
    The read copies -> 1; the unread copies keep their storage: 4 -> 3."""
    transformers = _quiet_transformers()
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(
        num_hidden_layers=LAYERS, vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        lru_width=64, attention_window_size=64, block_types=["attention"], use_cache=False)
    model = transformers.RecurrentGemmaForCausalLM(config).eval()
    tables = lambda m: _named(m, ("inv_freq", "original_inv_freq"))
    read = [t for n, t in tables(model) if n.endswith(".inv_freq")]
    unread = frozenset(n for n, _ in tables(model) if n.endswith("original_inv_freq"))
    return RealCase("transformers-recurrentgemma", _pin("transformers"), model,
                    (_tokens(128),), ideal_storages=distinct_contents(read) + len(unread), rope_tensors=tables,
                    unread=unread, blocks=lambda m: m.model.layers, output=lambda out: out.logits)


# -- fair-esm -------------------------------------------------------------------------------------------

def esm2() -> RealCase:
    """ESM-2 (fair-esm): every ``MultiheadAttention`` owns ``rot_emb = RotaryEmbedding(head_dim)`` with a
    **persistent** ``inv_freq`` buffer (``register_buffer`` default) and cos/sin caches
    ``_cos_cached``/``_sin_cached`` ``(1, L, head_dim)`` built lazily in forward and *assigned* (plain
    tensor attributes, replaced when the length changes, never written in place).

    Default policy: each layer's ``inv_freq`` keeps its storage (persistent), the cos and the sin caches
    -> 1 each: 6 -> 4. ``share_persistent=True``: 6 -> 3. The caches do not exist before the first call (the first
    compiled call builds them in its graph, the second recompiles and reads them), so ideal counts hold
    after two calls. ``ESM2.forward`` also breaks the graph (``if not padding_mask.any()``).
    """
    esm = pytest.importorskip("esm")
    from esm.model.esm2 import ESM2

    torch.manual_seed(0)
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    model = ESM2(num_layers=LAYERS, embed_dim=32, attention_heads=4, alphabet=alphabet).eval()
    tokens = torch.randint(4, 24, TOKENS, generator=torch.Generator().manual_seed(1))  # amino acids, no pad
    tokens[:, 0] = alphabet.cls_idx
    tables = lambda m: _named(m, ("inv_freq", "_cos_cached", "_sin_cached"))
    inv_freq = [n for n, _ in tables(model)]  # the caches are still None here
    return RealCase("fair-esm-esm2", _pin("fair-esm"), model, (tokens,),
                    ideal_storages=LAYERS + 2, ideal_storages_share_persistent=3, rope_tensors=tables,
                    expected_skips={name: PERSISTENT for name in inv_freq}, blocks=lambda m: m.layers,
                    output=lambda out: out["logits"])


# -- rotary-embedding-torch ----------------------------------------------------------------------------

class RotaryAttention(nn.Module):
    """Causal self-attention owning its ``rotary_embedding_torch.RotaryEmbedding``, as that library's
    README uses it (``rotate_queries_or_keys`` on q and k, heads before sequence)."""

    def __init__(self, dim: int, heads: int) -> None:
        from rotary_embedding_torch import RotaryEmbedding

        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.rotary_emb = RotaryEmbedding(dim=dim // heads, cache_max_seq_len=256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        q, k = self.rotary_emb.rotate_queries_or_keys(q), self.rotary_emb.rotate_queries_or_keys(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class RotaryStack(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RotaryAttention(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def rotary_embedding_torch() -> RealCase:
    """rotary-embedding-torch: each ``RotaryEmbedding`` holds ``freqs`` (a frozen ``nn.Parameter``, the
    inverse frequencies) and ``cached_freqs``, a zero ``(cache_max_seq_len, dim)`` buffer that forward
    fills in place (``cached_freqs[:n] = freqs``) the first time. Compiled cold, graph 1 fills the caches
    (they keep their own storage while it runs) and, once the fill counter's guard fails, graph 2 only
    reads them: the identical partly filled caches then share one storage. The frozen ``freqs`` are in
    the state_dict: kept apart by default (4 -> 3: the caches share), shared with ``share_persistent=True``
    (4 -> 2)."""
    pytest.importorskip("rotary_embedding_torch")
    torch.manual_seed(0)
    model = RotaryStack().eval()
    tables = lambda m: _named(m, ("freqs", "cached_freqs"))
    freqs = [t for n, t in tables(model) if n.endswith(".freqs")]
    return RealCase("rotary-embedding-torch", _pin("rotary-embedding-torch"), model,
                    (_tokens(128),), ideal_storages=1 + len(freqs), rope_tensors=tables,
                    ideal_storages_share_persistent=1 + distinct_contents(freqs),
                    expected_skips={n: PERSISTENT for n, _ in tables(model) if n.endswith(".freqs")},
                    blocks=lambda m: m.layers)


REAL_MODELS: dict[str, Callable[[], RealCase]] = {
    "transformers-gptj": gptj,
    "transformers-codegen": codegen,
    "transformers-recurrentgemma": recurrent_gemma,
    "fair-esm-esm2": esm2,
    "rotary-embedding-torch": rotary_embedding_torch,
}
"""name -> factory; each call builds a fresh, identically seeded model (``pytest.importorskip`` inside)."""

WITH_PERSISTENT_TABLES = frozenset({"fair-esm-esm2", "rotary-embedding-torch"})
"""Models whose RoPE tables include persistent buffers or frozen parameters: their ideal differs under
``share_persistent=True``."""
