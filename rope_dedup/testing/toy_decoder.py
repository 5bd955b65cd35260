"""A toy decoder whose attention layers each own a RoPE module, in the layouts met in the wild.

Used by the tests, the examples and ``rope-dedup profile``. Each layer's :class:`TableRecipe` picks the
layout, theta, rotary dim, length, dtype and scaling, so homogeneous, local/global (Gemma), partial
rotary, scaled and mixed-dtype models are one list away. Tables are built the way model code builds
them (float32 frequencies, float32 angles, cast at the end); nothing here knows about rope_dedup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

LAYOUTS = ("cos_sin", "hf_halves", "titan_cos_sin", "complex", "stacked", "gptj", "inv_freq", "lazy_cache")
# Modules that build their table inside forward on every call: ``computed`` from nothing (no state at all),
# ``from_inv_freq`` from an ``inv_freq`` buffer and positions, HF style. Kept apart from LAYOUTS, whose
# users expect every layer to hold a table.
COMPUTED_LAYOUTS = ("computed", "from_inv_freq")
# A cache written by the forward that first needs its rows, then only read (rotary-embedding-torch's
# ``cached_freqs`` with its fill count): shared while read. Kept apart too: it is zeros until a forward.
FILLED_LAYOUTS = ("filled_cache",)
SCALINGS = (None, "linear", "ntk", "llama3", "yarn")
# How a layer computes its angles, as model code does: each rounds differently. ``float64`` keeps the angles
# and their cos/sin in float64 and casts the table at the end.
ROUTES = ("outer", "matmul", "einsum", "float64")


@dataclass(frozen=True)
class TableRecipe:
    """How one layer's RoPE table is built."""

    layout: str = "cos_sin"
    theta: float = 10000.0
    rotary_dim: int | None = None  # None: the whole head
    max_len: int = 128
    dtype: torch.dtype = torch.float32
    scaling: str | None = None
    factor: float = 4.0
    persistent: bool = False  # saved in the state_dict: what a checkpoint reload writes into
    route: str = "outer"  # how the angles are computed: one of ROUTES

    def __post_init__(self) -> None:
        known = LAYOUTS + COMPUTED_LAYOUTS + FILLED_LAYOUTS
        if self.layout not in known:
            raise ValueError(f"unknown layout {self.layout!r}; choose from {', '.join(known)}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; choose from {SCALINGS}")
        if self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}; choose from {ROUTES}")


def inv_freq(spec: TableRecipe, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Frequencies as HF/torchtitan compute them, with the common scaling variants, on ``device`` (None: the
    default device, as model code builds)."""
    theta = spec.theta
    if spec.scaling == "ntk":
        theta = theta * spec.factor ** (dim / (dim - 2))
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if spec.scaling == "linear":
        freqs = freqs / spec.factor
    elif spec.scaling == "llama3":
        old_len, low, high = 8192, 1.0, 4.0
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > old_len / low, freqs / spec.factor, freqs)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        freqs = torch.where(medium, smoothed, scaled)
    elif spec.scaling == "yarn":
        old_len, beta_fast, beta_slow = 4096, 32.0, 1.0

        def correction(rotations: float) -> float:
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(correction(beta_fast)), 0), min(math.ceil(correction(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / max(high - low, 1e-3)).clamp(0, 1)
        extrapolate = 1 - ramp
        freqs = freqs / spec.factor * (1 - extrapolate) + freqs * extrapolate
    return freqs


def angles_of(route: str, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """(positions, freqs) angles the way ``route`` computes them (see ROUTES)."""
    if route == "matmul":  # HF: inv_freq[None, :, None] @ position_ids[:, None, :], then transposed
        return (freqs[None, :, None] @ positions[None, None, :]).transpose(1, 2)[0]
    if route == "einsum":
        return torch.einsum("i,j->ij", positions, freqs)
    if route == "float64":
        return torch.outer(positions.double(), freqs.double())
    return torch.outer(positions, freqs)


def yarn_mscale(spec: TableRecipe) -> float:
    return 0.1 * math.log(spec.factor) + 1.0 if spec.scaling == "yarn" else 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """Applies rotary embedding to ``x`` of shape (batch, heads, seq, head_dim) from a cached table."""

    # The buffers a layout registers (nn.Module serves them through __getattr__), typed for checkers.
    cos: torch.Tensor
    sin: torch.Tensor
    cos_cached: torch.Tensor
    sin_cached: torch.Tensor
    rope_cache: torch.Tensor
    freqs_cis: torch.Tensor
    cache: torch.Tensor
    embed_positions: torch.Tensor
    inv_freq: torch.Tensor
    freqs: torch.Tensor
    filled_freqs: torch.Tensor
    cached_freqs: torch.Tensor

    def __init__(self, spec: TableRecipe, head_dim: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.dim = spec.rotary_dim or head_dim
        freqs = inv_freq(spec, self.dim, device)
        angles = angles_of(spec.route, torch.arange(spec.max_len, dtype=torch.float32, device=device), freqs)
        mscale = yarn_mscale(spec)
        # Each layout computes only what it stores, as model code does: the build's transient is one layer's.
        def cos() -> torch.Tensor:
            return angles.cos() * mscale

        def sin() -> torch.Tensor:
            return angles.sin() * mscale

        dtype, layout = spec.dtype, spec.layout

        def buffer(name: str, value: torch.Tensor) -> None:
            self.register_buffer(name, value, persistent=spec.persistent)

        if layout == "cos_sin":
            buffer("cos", cos().to(dtype))
            buffer("sin", sin().to(dtype))
        elif layout == "hf_halves":
            emb = torch.cat((angles, angles), dim=-1)
            buffer("cos_cached", (emb.cos() * mscale).to(dtype))
            buffer("sin_cached", (emb.sin() * mscale).to(dtype))
        elif layout == "titan_cos_sin":
            emb = torch.cat((angles, angles), dim=-1)
            buffer("rope_cache", torch.cat([emb.cos(), emb.sin()], -1).to(dtype))
        elif layout == "complex":
            complex_dtype = torch.complex32 if dtype in (torch.float16, torch.bfloat16) else torch.complex64
            buffer("freqs_cis", torch.polar(torch.full_like(angles, mscale), angles).to(complex_dtype))
        elif layout == "stacked":
            buffer("cache", torch.stack([cos(), sin()], dim=-1).to(dtype))
        elif layout == "gptj":
            # GPT-J keeps a plain tensor attribute, not a buffer.
            self.embed_positions = torch.cat([sin(), cos()], dim=-1).to(dtype)
        elif layout == "inv_freq":
            buffer("inv_freq", freqs.to(dtype))
            buffer("original_inv_freq", freqs.clone().to(dtype))
        elif layout == "lazy_cache":
            # rotary-embedding-torch: zeros at init, written in place during forward.
            buffer("cached_freqs", torch.zeros(spec.max_len, self.dim // 2, dtype=dtype, device=device))
            buffer("freqs", freqs)
        elif layout == "filled_cache":
            buffer("filled_freqs", torch.zeros(spec.max_len, self.dim // 2, dtype=dtype, device=device))
            buffer("freqs", freqs)
            self.filled = 0  # rows written so far: a Python int, so dynamo guards on it
        elif layout == "from_inv_freq":
            # HF's rotary embedding: a float32 inv_freq buffer, the table rebuilt from it on every call.
            buffer("inv_freq", freqs)

    def cos_sin(self, seq: int, dtype: torch.dtype, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq, dim) cos and sin in the rotate-half convention, from the stored table (or built here)."""
        layout = self.spec.layout
        if layout == "computed":
            # From scratch, no state: arange -> pow -> outer -> cos/sin over max_len positions, then sliced.
            freqs = inv_freq(self.spec, self.dim, device)
            angles = torch.outer(torch.arange(self.spec.max_len, device=device, dtype=torch.float32), freqs)
            mscale = yarn_mscale(self.spec)
            cos, sin = (angles.cos() * mscale)[:seq], (angles.sin() * mscale)[:seq]
            cos, sin = cos.to(self.spec.dtype), sin.to(self.spec.dtype)
        elif layout == "from_inv_freq":
            # HF: inv_freq[None, :, None] @ positions[None, None, :], positions arange(seq).
            positions = torch.arange(seq, device=self.inv_freq.device, dtype=torch.float32)[None, None, :]
            angles = (self.inv_freq[None, :, None].float() @ positions).transpose(1, 2)[0]
            mscale = yarn_mscale(self.spec)
            cos, sin = (angles.cos() * mscale).to(self.spec.dtype), (angles.sin() * mscale).to(self.spec.dtype)
        elif layout == "cos_sin":
            cos, sin = self.cos[:seq], self.sin[:seq]
        elif layout == "hf_halves":
            return self.cos_cached[:seq].to(dtype), self.sin_cached[:seq].to(dtype)
        elif layout == "titan_cos_sin":
            cache = self.rope_cache[:seq]
            return cache[:, : self.dim].to(dtype), cache[:, self.dim:].to(dtype)
        elif layout == "complex":
            table = self.freqs_cis[:seq].to(torch.complex64)
            cos, sin = table.real, table.imag
        elif layout == "stacked":
            cos, sin = self.cache[:seq, :, 0], self.cache[:seq, :, 1]
        elif layout == "gptj":
            sin, cos = self.embed_positions[:seq].chunk(2, dim=-1)
        elif layout == "inv_freq":
            angles = torch.outer(torch.arange(seq, device=self.inv_freq.device, dtype=torch.float32),
                                 self.inv_freq.float())
            cos, sin = angles.cos(), angles.sin()
        elif layout == "filled_cache":
            if seq > self.filled:
                angles = torch.outer(torch.arange(seq, device=self.freqs.device, dtype=torch.float32), self.freqs)
                self.filled_freqs[:seq] = angles.to(self.filled_freqs.dtype)
                self.filled = seq
            cos, sin = self.filled_freqs[:seq].float().cos(), self.filled_freqs[:seq].float().sin()
        else:
            angles = torch.outer(torch.arange(seq, device=self.freqs.device, dtype=torch.float32), self.freqs)
            self.cached_freqs[:seq] = angles.to(self.cached_freqs.dtype)
            cos, sin = self.cached_freqs[:seq].float().cos(), self.cached_freqs[:seq].float().sin()
        cos, sin = cos.to(dtype), sin.to(dtype)
        return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(x.shape[-2], x.dtype, x.device)
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        rot = rot * cos + _rotate_half(rot) * sin
        return torch.cat([rot, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, spec: TableRecipe, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False, device=device)
        self.out = nn.Linear(d_model, d_model, bias=False, device=device)
        self.rope = Rope(spec, self.head_dim, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, spec: TableRecipe, graph_break: bool = False,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model, device=device), nn.LayerNorm(d_model, device=device)
        self.attention = Attention(d_model, heads, spec, device)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model, device=device), nn.GELU(),
                                 nn.Linear(2 * d_model, d_model, device=device))
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.mlp(self.norm2(x))


class ToyDecoder(nn.Module):
    """Embedding, one :class:`Block` per spec, norm and head. ``graph_break`` breaks inside every block.

    ``device`` is passed to every tensor the model makes, as transformers passes it to its rope init
    functions; None (the default) builds on the default device, as most model code does."""

    def __init__(self, specs: list[TableRecipe], d_model: int = 32, heads: int = 2, vocab: int = 64,
                 graph_break: bool = False, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, device=device)
        self.layers = nn.ModuleList(Block(d_model, heads, spec, graph_break, device) for spec in specs)
        self.norm = nn.LayerNorm(d_model, device=device)
        self.head = nn.Linear(d_model, vocab, bias=False, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def homogeneous(layers: int, **spec) -> list[TableRecipe]:
    """The same RoPE spec for every layer (the common case: identical copies everywhere)."""
    return [TableRecipe(**spec)] * layers


def local_global(layers: int, every: int = 3, local_theta: float = 1e4, global_theta: float = 1e6,
                 **spec) -> list[TableRecipe]:
    """Gemma-style: every ``every``-th layer global (theta 1e6), the rest local (theta 1e4)."""
    base = TableRecipe(**spec)
    return [replace(base, theta=global_theta if (i + 1) % every == 0 else local_theta) for i in range(layers)]


def rope_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every RoPE table the toy model holds, by construction (not by recognition): for tests and profiles."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, Rope):
            state = {**dict(module.named_buffers(recurse=False)),
                     **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
            found += [(f"{name}.{attr}", tensor) for attr, tensor in state.items()]
    return found


def unique_storages(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(count, bytes) of distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return len(storages), sum(storages.values())
