"""What each layer is expected to apply: ``expect=`` in any form, and the reading of a transformers config.

Whatever the form of ``expect``, it ends up as one :data:`Judge`: ``(layer, path) -> Expected``, where
``path`` is a held table's (the static audit; a model-level rotary module holding one table per kind of
layer names it ``sliding_attention_inv_freq`` or ``compress_inv_freq``), None for an applied table.
An :data:`Expected` is a :class:`RopeSpec`, a tuple of them (any one may apply: DeepSeek-V4 layers
apply a ``main`` and a ``compress`` table), :class:`NoRope` (the config turns RoPE off there), or None
(not judged).

``"config"`` reads the model's transformers configuration (:func:`read_config`) in every form
transformers 5 and 4.x ship:

- flat ``rope_parameters`` (5.x), or ``rope_theta`` + ``rope_scaling`` (4.x), or older names:
  ``rotary_emb_base`` + ``rotary_pct`` (GPT-NeoX in 4.x), a ``rotary_dim`` and no base (GPT-J, CodeGen:
  transformers' default theta, 10000);
- nested by layer type (Gemma 3, ModernBERT), with ``None`` for a type without RoPE (Beam), or by labels
  that are not layer types (DeepSeek-V4's ``main`` / ``compress``, ``_rope_type_labels``);
- per layer, ``per_layer_config`` (Gemma 4's heterogeneous configs: ``head_dim`` differs by layer);
- ``no_rope_layers`` (SmolLM3, Llama 4: 0 where a layer has no RoPE), ``layer_rope_theta`` (Granite SWA,
  Muse: a theta per layer, 0 where it has none);
- layer types without softmax attention (``linear_attention``, ``mamba``, ``conv``): not judged, and
  ``position_embedding_type`` other than ``"rope"`` (GraniteMoeHybrid's None): no RoPE anywhere;
- ``mrope_section`` (Qwen2-VL): with text-only positions every section sees the same position, so the
  table is the 1-D one;
- a partial rotary dim ``head_dim * partial_rotary_factor`` that is odd: transformers rounds the
  frequency count up (``arange(0, dim, 2)``), and so does the expectation;
- an image tower's plain theta (a config with ``patch_size`` and the ``default`` type): 1-D RoPE over the
  patches, or 2-D over their grid, half the rotary dims per axis (DINOv3), since such a config cannot say
  which: either is accepted (:attr:`ConfigSpec.grid`).

The frequencies of a ``rope_type`` come from transformers itself where it is installed: the model's own
rotary class's ``compute_default_rope_parameters`` for ``default``, ``ROPE_INIT_FUNCTIONS`` for the
others. :mod:`rope_dedup.audit.spec`'s formulas serve only what transformers' functions do not read: no
transformers, a config that is not a transformers one, older field names, and 4.x's ``default`` (its
rotary classes compute it from their own dim, as the formula does). A field the reader cannot read is
a finding (one line naming it), and the layers it concerns are not judged; ``strict=True`` raises
:class:`SpecError` instead.
"""

from __future__ import annotations

import copy
import fnmatch
import inspect
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping, Union

import torch

from rope_dedup.audit.layers import layer_index
from rope_dedup.audit.spec import SCALING_TYPES, RopeSpec, Scaling, SpecError, _frequencies, _number


@dataclass(frozen=True)
class NoRope:
    """The expectation says this layer applies no RoPE; ``why`` names the config field that says so."""

    why: str

    def __str__(self) -> str:
        return f"no RoPE ({self.why})"


# The base a config that names none gets (transformers 5's RotaryEmbeddingConfigMixin.default_theta).
_DEFAULT_THETA = 10_000.0

Expected = Union[RopeSpec, tuple, NoRope, None]
Judge = Callable[[str, Union[str, None]], Expected]  # (layer, path of a held table or None) -> Expected
Expectation = Union[RopeSpec, Mapping[str, RopeSpec], Callable[[str], Union[RopeSpec, None]], str]


def candidates(expected: Expected) -> tuple[RopeSpec, ...]:
    """The specs an expectation allows (none for :class:`NoRope` or None)."""
    if isinstance(expected, RopeSpec):
        return (expected,)
    return expected if isinstance(expected, tuple) else ()


def describe(expected: Expected) -> str:
    """An expectation as the audit's tables show it."""
    if isinstance(expected, tuple):
        return " | ".join(str(spec) for spec in expected)
    return "-" if expected is None else str(expected)


@dataclass(frozen=True)
class Judging:
    """``expect`` made into a :data:`Judge`, the config fields it could not read (one line each), and, for
    ``"config"``, the layers of the text model's stack with what each should apply and their types."""

    judge: Judge
    unreadable: tuple[str, ...] = ()
    stack: dict[str, Expected] = field(default_factory=dict)  # "model.layers.3" -> what it should apply
    kinds: dict[str, str] = field(default_factory=dict)  # "model.layers.3" -> its layer type


def expectation_for(expect: Expectation, model: torch.nn.Module, *, strict: bool = False) -> Judging:
    """Turn any form of ``expect`` into a :class:`Judging`. Bad input (an unknown string, a mapping to
    something else than RopeSpec, ``"config"`` on a model without ``.config``) raises :class:`SpecError`."""
    if isinstance(expect, RopeSpec):
        return Judging(lambda layer, source: expect)
    if isinstance(expect, str):
        if expect != "config":
            raise SpecError(f"expect={expect!r}: the only string understood is 'config'")
        return read_config(model, strict=strict)
    if isinstance(expect, Mapping):
        for pattern, spec in expect.items():
            if not isinstance(spec, (RopeSpec, NoRope)):
                raise SpecError(f"expect[{pattern!r}] is {type(spec).__name__}, not a RopeSpec")

        # First matching pattern wins, in the mapping's order (fnmatch: layers.[0-2], *.layers.*).
        def by_pattern(name: str) -> Expected:
            return next((spec for pattern, spec in expect.items() if fnmatch.fnmatchcase(name, pattern)), None)

        return Judging(lambda layer, source: by_pattern(layer) or (by_pattern(source) if source else None))
    if callable(expect):
        return Judging(lambda layer, source: expect(layer) or (expect(source) if source else None))
    raise SpecError(f"expect must be a RopeSpec, a mapping, a callable or 'config', not {type(expect).__name__}")


# -- transformers configs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigSpec(RopeSpec):
    """A :class:`RopeSpec` read from a transformers config: its frequencies come from transformers itself."""

    config: Any = field(default=None, compare=False, repr=False)
    layer_type: str | None = None  # the key of nested ``rope_parameters`` (a layer type or a label)
    rope_type: str = "default"
    init: Callable | None = field(default=None, compare=False, repr=False)  # transformers' function
    exponent_dim: int | None = None  # without transformers: the dim in theta ** (-2j / dim), odd or not
    # Tables over several position axes (2-D axial, M-RoPE): the model's own ``recomposition_frequencies``,
    # which places each axis's frequencies in the applied columns, and the number of axes.
    recompose: Callable | None = field(default=None, compare=False, repr=False)
    axis_count: int = 0
    # An image tower's plain theta read as 2-D RoPE over the patch grid: each axis's frequencies span half
    # the rotary dims (theta ** (-2j / (dim / 2))), a held vector is one axis's.
    grid: bool = False

    def frequencies(self, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
        """What transformers' function builds at ``seq_len``; without transformers, the same formulas here.
        Over several axes, the frequency of each distinct column of a ``dim``-wide applied table (a held
        ``inv_freq`` is one axis's vector)."""
        if self.init is None:
            return _frequencies(self.theta, self.exponent_dim or dim, self.scaling,  # type: ignore[arg-type]
                                self.attention_factor, seq_len)
        inv_freq, attention_factor = _call_init(self.init, self.config, self.layer_type, seq_len)
        columns = self.columns(inv_freq.numel())
        if columns is not None and 2 * len(columns[0]) == dim:
            inv_freq = inv_freq[list(columns[0])]
        return inv_freq.to(torch.float64), float(attention_factor)

    def columns(self, count: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(the frequency index, the axis) of each distinct column the model's recomposition makes of
        ``count`` frequencies per axis; None without one, or when it does not take a probe."""
        if self.recompose is None or self.axis_count < 2:
            return None
        return _recomposed(self.recompose, self.axis_count, count)

    def axes(self, dim: int) -> tuple[int, ...] | None:
        """The axis of each distinct column of a ``dim``-wide applied table, when the model says it."""
        if self.init is None:
            return None
        inv_freq, _ = _call_init(self.init, self.config, self.layer_type, None)
        columns = self.columns(inv_freq.numel())
        return columns[1] if columns is not None and 2 * len(columns[1]) == dim else None

    def __str__(self) -> str:
        text = super().__str__()
        if self.scaling is None and self.rope_type != "default":
            text += f" {self.rope_type}"
        return text + " per axis of a 2-D grid" if self.grid else text


def _image_grid(config: Any, parameters: Mapping[str, Any], spec: ConfigSpec) -> bool:
    """Whether a plain theta is an image tower's, whose RoPE may be over the patch grid (DINOv3's): the config
    has a ``patch_size`` and says nothing of axes or a partial rotary dim."""
    return (_get(config, "patch_size") is not None and spec.axis_count == 0 and spec.exponent_dim is not None
            and spec.exponent_dim % 4 == 0 and "partial_rotary_factor" not in parameters
            and _get(config, "partial_rotary_factor") is None)


def _grid(spec: ConfigSpec) -> ConfigSpec:
    """``spec`` as 2-D RoPE over a patch grid: per axis, the default frequencies of half the rotary dims."""
    half = spec.exponent_dim // 2  # type: ignore[operator]
    return replace(spec, rotary_dim=half, init=None, exponent_dim=half, axis_count=2, grid=True)


def _recomposed(recompose: Callable, axes: int, count: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Probe a model's ``recomposition_frequencies`` with values that encode (axis, frequency index) and read
    back (frequency index, axis) of each distinct column, a repeated half or pair read once, as recognition
    reads a table. Models put the axis on different dims of ``freq`` ((tokens, axes, n) in vision towers,
    (axes, batch, seq, n) in M-RoPE, (batch, tokens, axes, n) in Gemma 4's): each is tried."""
    code = torch.arange(axes * count, dtype=torch.float64, device="cpu").reshape(axes, count) + 1
    for dims, at in ((3, 1), (4, 0), (4, 2), (3, 0)):
        shape = [1] * (dims - 1) + [count]
        shape[at] = axes
        try:
            out = recompose(code.reshape(shape))
        except Exception:  # the model's function indexes another dim: not this shape
            continue
        if not isinstance(out, torch.Tensor) or out.numel() != out.shape[-1]:
            continue
        codes = out.reshape(-1).to(torch.int64) - 1
        if bool((codes < 0).any()) or bool((codes >= axes * count).any()) or codes.unique().numel() < 2:
            continue
        index, axis = codes % count, codes // count
        width = index.numel()
        if width % 2 == 0 and torch.equal(index[: width // 2], index[width // 2:]):
            index, axis = index[: width // 2], axis[: width // 2]
        elif width % 2 == 0 and torch.equal(index[0::2], index[1::2]):
            index, axis = index[0::2], axis[0::2]
        return tuple(index.tolist()), tuple(axis.tolist())
    return None


def _call_init(init: Callable, config: Any, layer_type: str | None, seq_len: int | None) -> tuple[torch.Tensor, float]:
    """``init(config, device=..., seq_len=..., layer_type=...)``, the keywords its signature takes (models'
    ``compute_default_rope_parameters`` take ``(config, **kwargs)`` or name some of them; 4.x functions
    take no ``layer_type``)."""
    accepted = inspect.signature(init).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    wanted = {"device": torch.device("cpu"), "seq_len": seq_len, "layer_type": layer_type}
    kwargs = {name: value for name, value in wanted.items()
              if (name in accepted or takes_any) and (value is not None or name != "layer_type")}
    inv_freq, attention_factor = init(config, **kwargs)
    return inv_freq.detach().to("cpu"), float(attention_factor)


def text_config(model: torch.nn.Module) -> Any:
    """``model.config``'s text (decoder) config; :class:`SpecError` when the model has no config."""
    config = getattr(model, "config", None)
    if config is None:
        raise SpecError("expect='config' needs model.config (a transformers model's configuration); "
                        f"{type(model).__name__} has none")
    if hasattr(config, "get_text_config"):  # multimodal wrappers keep the decoder's settings there
        try:
            return config.get_text_config()
        except ValueError:  # several text configs (an encoder and a decoder): the model's own is the one
            return config
    return getattr(config, "text_config", None) or config  # transformers 4.44 has no get_text_config


class _Reader:
    """Reads one text config into specs per layer; every field it cannot read becomes one line."""

    def __init__(self, model: torch.nn.Module, config: Any, strict: bool) -> None:
        self.model, self.config, self.strict = model, config, strict
        self.unreadable: list[str] = []
        # transformers' functions read a transformers config; any other (a hand-written model's namespace)
        # is computed with the built-in formulas.
        self.functions = _init_functions() if type(config).__module__.startswith("transformers.") else {}
        self.default_init = _default_init(model, config) if self.functions else None
        # 2-D vision RoPE ("axial"), which transformers has no init function for: each model's rotary class
        # computes it, and its recomposition places the height and width frequencies in the columns.
        self.axial = _rotary(model, config, "compute_axial_rope_parameters", own_only=False) if self.functions else None
        self.recompose = _rotary(model, config, "recomposition_frequencies", own_only=True) if self.functions else None

    def fail(self, message: str) -> None:
        if self.strict:
            raise SpecError(message)
        if message not in self.unreadable:
            self.unreadable.append(message)

    def parameters(self) -> Mapping[str, Any] | None:
        parameters = self.config.__dict__.get("rope_parameters", getattr(self.config, "rope_parameters", None))
        if parameters:
            return parameters
        theta = getattr(self.config, "rope_theta", None)  # transformers 4: rope_theta and rope_scaling side by side
        if theta is not None:
            return {**(getattr(self.config, "rope_scaling", None) or {}), "rope_theta": theta}
        # Older names, which transformers' functions do not read: computed with the built-in formulas.
        self.functions, self.default_init = {}, None
        base = _get(self.config, "rotary_emb_base") or _get(self.config, "rotary_embedding_base")  # GPT-NeoX 4.x
        if base is not None:
            return {"rope_theta": base, "partial_rotary_factor": _get(self.config, "rotary_pct") or 1.0}
        rotary_dim, head_dim = _get(self.config, "rotary_dim"), _head_dim(self.config)
        if rotary_dim and head_dim:  # GPT-J, CodeGen: a rotary dim, and the base transformers defaults to
            return {"rope_theta": getattr(self.config, "default_theta", _DEFAULT_THETA),
                    "partial_rotary_factor": rotary_dim / head_dim}
        self.fail("model.config has neither rope_parameters nor rope_theta")
        return None

    def spec(self, parameters: Mapping[str, Any] | None, config: Any, label: str | None,
             layer: int | str | None = None) -> Expected:
        """The spec of one ``rope_parameters`` entry read against ``config`` (``per_layer_config[layer]``'s, where
        the config is per layer: a field it cannot read is then said of that layer)."""
        where = f"model.config.rope_parameters[{label!r}]" if label else "model.config.rope_parameters"
        if layer is not None:
            where += f" read with per_layer_config[{layer!r}]"
        if not isinstance(parameters, Mapping):
            self.fail(f"{where} is {type(parameters).__name__}, not a mapping")
            return None
        theta = parameters.get("rope_theta")
        if theta is None:
            self.fail(f"{where} has no rope_theta")
            return None
        rope_type = parameters.get("rope_type") or parameters.get("type") or "default"
        if rope_type == "mrope":  # 4.x Qwen2-VL: plain RoPE per section
            rope_type = "default"
        init = self.default_init if rope_type == "default" else self.functions.get(rope_type)
        if rope_type == "axial" and self.axial is not None:
            init = getattr(type(self.axial), "compute_axial_rope_parameters")
        if rope_type == "axial" and init is None:
            self.fail(f"{where}: rope_type 'axial' and no rotary module with compute_axial_rope_parameters")
            return None
        if init is None and rope_type != "default" and rope_type not in SCALING_TYPES:
            known = ", ".join(("default", *sorted(set(SCALING_TYPES) | set(self.functions))))
            self.fail(f"{where}: rope_type {rope_type!r} is not one the audit knows ({known})")
            return None
        try:
            spec = self._spec(parameters, config, label, rope_type, init, float(theta))
        except Exception as error:  # transformers' own function refusing the config names the field
            self.fail(f"{where}: {_reason(error)}")
            return None
        return (spec, _grid(spec)) if rope_type == "default" and _image_grid(config, parameters, spec) else spec

    def _spec(self, parameters: Mapping[str, Any], config: Any, label: str | None, rope_type: str,
              init: Callable | None, theta: float) -> ConfigSpec:
        head_dim = _head_dim(config)
        partial = parameters.get("partial_rotary_factor") or _get(config, "partial_rotary_factor") or 1.0
        exponent_dim = int(head_dim * partial) if head_dim else None
        scaling = _scaling(parameters, config, rope_type)
        attention_factor = parameters.get("attention_factor")
        recompose, axis_count = None, 0
        sections = parameters.get("mrope_section")
        if rope_type == "axial" or isinstance(sections, (list, tuple)):
            owner = self.recompose or (self.axial if rope_type == "axial" else None)
            recompose = getattr(owner, "recomposition_frequencies", None)
            axis_count = len(sections) if isinstance(sections, (list, tuple)) else 2
        if init is not None:
            inv_freq, _ = _call_init(init, config, label, None)
            # An axial inv_freq is one axis's: the applied table is wider (ConfigSpec.frequencies).
            rotary_dim = 2 * inv_freq.numel() if rope_type != "axial" else None
        else:
            if exponent_dim is None:
                raise SpecError("no head_dim, nor hidden_size and num_attention_heads to derive it")
            rotary_dim = 2 * ((exponent_dim + 1) // 2)  # arange(0, dim, 2): an odd dim rounds up
        return ConfigSpec(theta=theta, rotary_dim=rotary_dim, scaling=scaling, attention_factor=attention_factor,
                          config=config, layer_type=label, rope_type=rope_type, init=init, exponent_dim=exponent_dim,
                          recompose=recompose, axis_count=axis_count)


def read_config(model: torch.nn.Module, *, strict: bool = False) -> Judging:
    """Per layer, the RoPE ``model.config`` asks for (see the module doc for every form it reads); a vision or
    audio tower whose own config names RoPE is read as a model of its own, and judges the layers inside it."""
    config = text_config(model)
    towers = {path: read_config(model.get_submodule(path), strict=strict)
              for path in _foreign_towers(model, config)
              if _names_rope(model.get_submodule(path).__dict__.get("config"))}
    unreadable = [f"{line} (in {path})" for path, tower in towers.items() for line in tower.unreadable]
    reader = _Reader(model, config, strict)
    parameters = reader.parameters()
    if parameters is None:
        return Judging(_with_towers(towers, lambda layer, source: None), tuple(reader.unreadable + unreadable))
    layers = _ConfigLayers(model, config, reader, parameters)
    stack = {f"{layers.stack_path}.{i}": layers.of_layer(i) for i in range(layers.stack_size)}
    for label in layers.labels if layers.labels else (None,):  # read now, so that every unreadable field is known before judging
        layers.of_label(label, label if layers.by_type else None)
    kinds = {layer: layers.types[i] for i, layer in enumerate(stack)
             if isinstance(layers.types, (list, tuple)) and i < len(layers.types)}
    return Judging(_with_towers(towers, layers.judge), tuple(reader.unreadable + unreadable), stack, kinds)


def _with_towers(towers: Mapping[str, Judging], judge: Judge) -> Judge:
    """``judge``, except inside a tower read on its own: there the tower's, with paths from the tower."""
    if not towers:
        return judge

    def judged(layer: str, source: str | None) -> Expected:
        for path, tower in towers.items():
            if layer == path or layer.startswith(path + "."):
                return tower.judge(layer[len(path) + 1:], source)
        return judge(layer, source)

    return judged


def _names_rope(config: Any) -> bool:
    """Whether a tower's config names RoPE parameters of its own (a SigLIP tower's absolute positions do not)."""
    if config is None:
        return False
    try:
        return bool(getattr(config, "rope_parameters", None)) or getattr(config, "rope_theta", None) is not None
    except Exception:  # a per-layer attribute (transformers 5.24+) raises when read config-wide
        return False


class _ConfigLayers:
    """What a read config expects of each layer of the text model, and of a table held at model level."""

    def __init__(self, model: torch.nn.Module, config: Any, reader: _Reader, parameters: Mapping[str, Any]) -> None:
        self.config, self.reader, self.parameters = config, reader, parameters
        self.types = _get(config, "layer_types")
        self.labels = [key for key, value in parameters.items() if isinstance(value, Mapping)
                       or (value is None and self.types and key in self.types)]
        # Labels that name layer types (Gemma 3, LFM3), or kinds of table every layer may apply (DeepSeek-V4).
        self.by_type = bool(self.labels) and bool(self.types) and any(label in self.types for label in self.labels)
        self.heterogeneous = bool(getattr(config, "is_heterogeneous", False))
        self.no_rope = _get(config, "no_rope_layers")
        self.thetas = _get(config, "layer_rope_theta")
        # GraniteMoeHybrid opts out of RoPE with position_embedding_type None; SeamlessM4T's speech encoder
        # uses rotary ones only with position_embeddings_type "rotary".
        self.encoding = next(((name, _get(config, name)) for name in ("position_embedding_type",
                                                                      "position_embeddings_type")
                              if hasattr(config, name)), None)
        self.count = _get(config, "num_hidden_layers")
        self.inside = _text_prefix(model, config)
        self.foreign = _foreign_towers(model, config)
        self.stack_path, self.stack_size = _text_stack(model, config)
        self._specs: dict[Any, Expected] = {}

    def of_label(self, label: str | None, where: int | str | None) -> Expected:
        """The spec of ``rope_parameters[label]`` (the flat parameters for None), for a layer index or type."""
        key = (label, where if self.heterogeneous else None)
        if key not in self._specs:
            if label is not None and self.parameters[label] is None:
                self._specs[key] = NoRope(f"rope_parameters[{label!r}] is None")
            else:
                entry = self.parameters[label] if label else self.parameters
                self._specs[key] = self.reader.spec(entry, self._config_of(where), label,
                                                    where if self.heterogeneous else None)
        return self._specs[key]

    def every_label(self, where: int | str | None) -> Expected:
        specs = tuple(s for label in self.labels for s in candidates(self.of_label(label, where)))
        return specs[0] if len(specs) == 1 else specs or None

    def with_theta(self, theta: float) -> Expected:
        """The flat spec with another theta (``layer_rope_theta``), read from a config that says so."""
        key = ("theta", theta)
        if key not in self._specs:
            patched = copy.copy(self.config)
            patched.rope_parameters = {**self.parameters, "rope_theta": theta}
            self._specs[key] = self.reader.spec(patched.rope_parameters, patched, None)
        return self._specs[key]

    def of_layer(self, index: int) -> Expected:
        if self.encoding is not None and self.encoding[1] not in ("rope", "rotary"):
            return NoRope(f"{self.encoding[0]} is {self.encoding[1]!r}")
        if isinstance(self.no_rope, (list, tuple)) and index < len(self.no_rope) and not self.no_rope[index]:
            return NoRope(f"no_rope_layers[{index}] is 0")
        kind = self.types[index] if isinstance(self.types, (list, tuple)) and index < len(self.types) else None
        if _no_attention(kind):
            return None  # Mamba, linear attention, convolution: no softmax attention to apply RoPE in
        if isinstance(self.thetas, (list, tuple)) and index < len(self.thetas) and not self.labels:
            theta = self.thetas[index]  # Granite SWA, Muse: a theta per layer, 0 for a layer without RoPE
            return NoRope(f"layer_rope_theta[{index}] is 0") if not theta else self.with_theta(float(theta))
        if not self.labels:
            return self.of_label(None, index)
        if not self.by_type:
            return self.every_label(index)
        return self.of_label(kind, index) if kind in self.labels else None  # LFM3's conv layers: no entry

    def judge(self, layer: str, source: str | None) -> Expected:
        if self.inside and not (layer == self.inside or layer.startswith(self.inside + ".")):
            return None  # a multimodal model's own parts (Music Flamingo's audio pos_emb): not the text model's
        if any(layer == tower or layer.startswith(tower + ".") for tower in self.foreign):
            return None  # a vision, audio or protein tower: the text config says nothing of it
        label = next((lb for lb in self.labels if source is not None and _names_label(source, lb)), None)
        in_stack = self.stack_path is None or layer.startswith(self.stack_path + ".")
        index = layer_index(layer) if in_stack else None
        if index is not None and (not isinstance(self.count, int) or index < self.count):
            expected = self.of_layer(index)
            return self.of_label(label, index) if isinstance(expected, tuple) and label is not None else expected
        if label is not None:
            return self.of_label(label, label if self.by_type else None)
        return self.every_label(None) if self.labels else self.of_label(None, None)

    def _config_of(self, where: int | str | None) -> Any:
        if where is None or not self.heterogeneous:
            return self.config
        try:
            return self.config.per_layer_config[where]
        except Exception:  # a label that is no layer type (DeepSeek-V4's main/compress)
            return self.config


# Layer types without softmax attention: flat rope_parameters describe the attention layers beside them.
_ATTENTION_FREE = ("linear", "mamba", "conv", "recurrent", "ssm", "rwkv", "mlp", "moe")


def _no_attention(kind: Any) -> bool:
    return isinstance(kind, str) and kind.startswith(_ATTENTION_FREE)


def _names_label(text: str, label: str) -> bool:
    """Whether a table's path or source names ``label`` (``model.rotary_emb.compress_inv_freq``)."""
    return re.search(rf"(^|[.\s]){re.escape(label)}_", text) is not None


def _foreign_towers(model: torch.nn.Module, config: Any) -> list[str]:
    """Paths of the modules that hold a config of another kind than the text config and the model's own (a
    vision tower's, Evolla's protein encoder's): what they hold is theirs to describe. (A layer holding
    its own copy of the text config, as per-layer configs give, is no tower.)"""
    kinds = {type(config), type(getattr(model, "config", None))}
    towers: list[str] = []
    for path, module in model.named_modules():
        held = module.__dict__.get("config")
        if path and held is not None and type(held) not in kinds and hasattr(held, "to_dict") \
                and not any(path.startswith(tower + ".") for tower in towers):
            towers.append(path)
    return towers


def _text_prefix(model: torch.nn.Module, config: Any) -> str:
    """The path of the shallowest module that holds the text config itself ('' for the model)."""
    for path, module in model.named_modules():
        if getattr(module, "config", None) is config:
            return path
    return ""


def _text_stack(model: torch.nn.Module, config: Any) -> tuple[str | None, int]:
    """(path, length) of the text model's list of decoder layers: the first ``ModuleList`` under the text
    prefix as long as ``num_hidden_layers``; (None, 0) when there is none."""
    count = _get(config, "num_hidden_layers")
    if not isinstance(count, int):
        return None, 0
    prefix = _text_prefix(model, config)
    root = model.get_submodule(prefix) if prefix else model
    for path, module in root.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and count:
            full = f"{prefix}.{path}" if prefix and path else prefix or path
            return full, count
    return None, 0


def _rotary(model: torch.nn.Module, config: Any, attribute: str, *, own_only: bool) -> torch.nn.Module | None:
    """The first module whose class has ``attribute``: one holding ``config`` itself first, else (unless
    ``own_only``) any."""
    rotary = [m for m in model.modules() if hasattr(type(m), attribute)]
    own = [m for m in rotary if getattr(m, "config", None) is config]
    return next(iter(own if own_only else own + rotary), None)


def _default_init(model: torch.nn.Module, config: Any) -> Callable | None:
    """What the model itself computes ``default`` RoPE with: the ``compute_default_rope_parameters`` of
    its text model's rotary class (transformers 5); None in 4.x, whose rotary classes compute it from
    their own dim (JetMoe's ``kv_channels``), as the built-in formula does."""
    rotary = [m for m in model.modules() if hasattr(type(m), "compute_default_rope_parameters")]
    own = [m for m in rotary if getattr(m, "config", None) is config]
    for module in own + rotary:
        return getattr(type(module), "compute_default_rope_parameters")
    return None


def _init_functions() -> Mapping[str, Callable]:
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return {}
    return ROPE_INIT_FUNCTIONS


def _get(config: Any, name: str) -> Any:
    """``config.name``, or None where a heterogeneous config refuses a global read of a per-layer field."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _head_dim(config: Any) -> int | None:
    head_dim = _get(config, "head_dim") or _get(config, "kv_channels")  # JetMoe names it kv_channels
    if head_dim:
        return int(head_dim)
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    return hidden // heads if hidden and heads else None


def _scaling(parameters: Mapping[str, Any], config: Any, rope_type: str) -> Scaling | None:
    """The :class:`Scaling` shown and used to name a faulty field; its values fill in transformers' defaults."""
    if rope_type not in SCALING_TYPES:
        return None
    known = {f.name for f in fields(Scaling)} - {"type"}
    given = {k: v for k, v in parameters.items() if k in known and v is not None}
    maximum = _get(config, "max_position_embeddings")
    if "original_max_position_embeddings" not in given and rope_type == "dynamic":
        given["original_max_position_embeddings"] = maximum
    if given.get("factor") is None and rope_type in ("yarn", "longrope"):
        original = given.get("original_max_position_embeddings")
        given["factor"] = maximum / original if original and maximum else None
    return Scaling(rope_type, **given)


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first}" if not isinstance(error, SpecError) else first


@dataclass(frozen=True)
class ConfigConflict:
    """A config that says two things: a legacy 4.x field next to the ``rope_parameters`` transformers 5 reads
    (DeepSpeed #8341: code that sets or reads ``config.rope_theta`` now misses the value in use)."""

    name: str  # the legacy field: rope_theta or rope_scaling
    read: str  # what rope_parameters says, which transformers 5 uses
    ignored: str  # the legacy field's value, which it ignores


def config_conflicts(model: torch.nn.Module) -> list[ConfigConflict]:
    """Legacy ``rope_theta`` / ``rope_scaling`` set on ``model.config`` that disagree with its
    ``rope_parameters`` (per layer type: with every type's). Empty for a 4.x config, which has only those."""
    config = text_config(model)
    parameters = config.__dict__.get("rope_parameters")
    if not isinstance(parameters, Mapping):
        return []
    nested = [p for p in parameters.values() if isinstance(p, Mapping)]
    groups = nested or [parameters]
    legacy = vars(config)  # set on the instance: transformers 5 maps neither to rope_parameters
    conflicts = []
    theta = legacy.get("rope_theta")
    if theta is not None and all(g.get("rope_theta") != theta for g in groups):
        conflicts.append(ConfigConflict("rope_theta", " / ".join(f"rope_theta={_number(g.get('rope_theta'))}"
                                                                  for g in groups), _number(theta)))
    scaling = legacy.get("rope_scaling")
    if isinstance(scaling, Mapping):
        def kind(p: Mapping) -> tuple:
            return p.get("rope_type") or p.get("type") or "default", p.get("factor")

        if all(kind(g) != kind(scaling) for g in groups):
            conflicts.append(ConfigConflict("rope_scaling", " / ".join(f"{kind(g)[0]} factor {kind(g)[1]}" for g in groups),
                                            f"{kind(scaling)[0]} factor {kind(scaling)[1]}"))
    return conflicts
