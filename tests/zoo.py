"""Every RoPE architecture transformers ships, built tiny from its defaults: the zoo the audit is swept over.

:func:`rope_model_types` lists the model types whose default config names a RoPE (``rope_parameters``,
or 4.x's ``rope_theta``). :func:`build` makes one tiny and random-init: its default config, serialized
as a checkpoint's ``config.json`` would be, shrunk (:func:`shrink`: fewer heads, small feed-forward,
vocabulary and expert counts, one layer of each kind the defaults mix, at least two) and loaded back
with ``from_dict``. The rotary dims are never shrunk: ``head_dim``, ``partial_rotary_factor``,
``mrope_section``, MLA's ``qk_rope_head_dim`` and longrope's factor lists stay the defaults', so the
audit judges the RoPE the architecture really has. :func:`sweep_one` runs the static audit, the dynamic
audit and ``share()`` on it and says how they went.

Its inputs are text, or, for the types ``tests/zoo_inputs.py`` has a builder for (vision towers, audio
encoders, multimodal models), inputs of the right shape taken from the config; that module's
``CONFIG_FIXES`` also mend default configs that do not build or run once shrunk. A type that cannot be
made tiny, or whose tiny model cannot run on its inputs, is a :class:`Skipped` with the reason. Used by
``tests/test_zoo.py`` (about twenty-five pinned types) and ``tests/zoo_sweep.py`` (all of them: ``nox -s zoo``).
"""

from __future__ import annotations

import copy
import inspect
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import zoo_inputs

# The size every shrunk config gets (a key is set only where the config has it).
HEADS = 2
VOCAB = 256
INTERMEDIATE = 64
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
LORA_RANK = 32
MAX_LAYERS = 4  # one layer of each kind the defaults mix, at most this many
TOKENS = 16
MAX_PARAMETERS = 150_000_000  # a level that leaves more is refused: the sweep shares 2 cores and some GB

_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                 "num_encoder_layers", "num_decoder_layers", "depth", "encoder_num_hidden_layers",
                 "decoder_num_hidden_layers", "num_attention_layers")
_HEAD_COUNTS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "encoder_attention_heads",
                "decoder_attention_heads", "encoder_num_attention_heads", "decoder_num_attention_heads")
_KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "encoder_num_key_value_heads",
                   "decoder_num_key_value_heads", "num_key_value_attention_heads")
_WIDTHS = ("hidden_size", "d_model", "n_embd", "embed_dim")
_FEED_FORWARD = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "ffn_dim", "ffn_hidden_size", "expert_ffn_hidden_size", "dense_intermediate_size",
                 "shared_intermediate_size", "moe_hidden_size", "intermediate_size_mlp",
                 "shared_experts_intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim")
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token")
_LORA = ("kv_lora_rank", "q_lora_rank", "o_lora_rank")
_VOCABS = ("vocab_size", "vocab_size_per_layer_input")
_MODEL_MAPPINGS = ("MODEL_MAPPING_NAMES", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                   "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES")


@dataclass
class Tiny:
    """A tiny random-init model of one type and the keyword inputs of one forward (text, or zoo_inputs')."""

    model_type: str
    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    layers: int
    level: str  # how far the config was shrunk (:data:`LEVELS`)
    output: torch.Tensor | None  # the first tensor of its output on ``inputs``, before anything ran


@dataclass
class Skipped:
    """A type the sweep does not audit, and why (its own words where transformers raised)."""

    model_type: str
    reason: str


@dataclass
class Outcome:
    """What the sweep found on one type: ``status`` is ``clean``, ``finding`` or ``failure``.

    ``failure`` is what must never happen: an exception out of rope_dedup, static and dynamic audits that
    disagree, or ``share()`` changing an output; ``problems`` says which."""

    model_type: str
    status: str
    static: list[str] = field(default_factory=list)  # the static audit's findings, one line each
    dynamic: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def rope_model_types() -> list[str]:
    """Every model type whose default config (or its text config) names a RoPE, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    found = []
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception:  # a config without defaults (a composite needing sub-configs) names no RoPE by itself
            continue
        if _names_rope(config):
            found.append(model_type)
    return found


def _names_rope(config: Any) -> bool:
    """A RoPE setting in the config or its text config: ``rope_parameters``, ``rope_theta``, any other field
    named for RoPE with a value (``rotary_dim``, ``rotary_emb_base``, ``qk_rope_head_dim``), or rotary
    position embeddings."""
    for candidate in (config, _text_config(config)):
        for name, value in vars(candidate).items():
            if ("rope" in name.lower() or "rotary" in name.lower()) and value not in (None, False, 0, {}, []):
                return True
        if vars(candidate).get("position_embedding_type") in ("rotary", "rope"):
            return True
    return False


# How far :func:`shrink` goes, tried in this order: a config whose fields constrain each other (a Mamba
# head state tied to the width, a vision tower's output tied to the text width) is refused at one level
# and taken at the next.
LEVELS = ("tiny", "tiny4", "narrow", "short")


def shrink(values: dict[str, Any], level: str = "tiny") -> dict[str, Any]:
    """A config dict (``to_dict()``) made small, sub-configs included; rotary dims untouched.

    ``tiny``: fewer layers, heads, feed-forward, experts, vocabulary; ``tiny4``: the same with 4 heads
    (CodeGen splits its heads 4 ways); ``narrow``: the widths and heads kept; ``short``: layers and
    vocabulary only."""
    values = copy.deepcopy(values)
    for key, value in list(values.items()):
        if isinstance(value, dict) and "model_type" in value:
            values[key] = shrink(value, level)
    _fewer_layers(values)
    if level.startswith("tiny"):
        _fewer_heads(values, 4 if level == "tiny4" else HEADS)
    sizes = ((_VOCABS, VOCAB),) if level == "short" else (
        (_FEED_FORWARD, INTERMEDIATE), (_EXPERT_COUNTS, EXPERTS), (_EXPERTS_PER_TOKEN, EXPERTS_PER_TOKEN),
        (_LORA, LORA_RANK), (_VOCABS, VOCAB))
    for keys, size in sizes:
        for key in keys:
            if isinstance(values.get(key), int) and values[key] > size:
                values[key] = size
    if level != "short":
        for key in ("n_group", "topk_group", "num_expert_group"):
            if isinstance(values.get(key), int):
                values[key] = 1
    for key, value in list(values.items()):  # special token ids must fit the smaller vocabulary
        if key.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB:
            values[key] = VOCAB - 1 - (sum(map(ord, key)) % 32)
    if "use_cache" in values:
        values["use_cache"] = False
    return values


def _fewer_layers(values: dict[str, Any]) -> None:
    layers = next((values[k] for k in _LAYER_COUNTS if isinstance(values.get(k), int)), None)
    if not layers:
        return
    keep = _layers_to_keep(values, layers)
    for key in _LAYER_COUNTS:
        if isinstance(values.get(key), int) and values[key] == layers:
            values[key] = len(keep)
    for key, value in list(values.items()):
        if isinstance(value, (list, tuple)) and len(value) == layers and key not in ("eos_token_id",):
            values[key] = [value[i] for i in keep]
        elif _cyclic(key, value, layers):  # RecurrentGemma's block_types: a pattern the layers repeat
            values[key] = [value[i % len(value)] for i in keep]
        elif isinstance(value, dict) and value and all(isinstance(k, int) or str(k).isdigit() for k in value):
            values[key] = _renumber(value, keep)  # per_layer_config keyed by layer index


def _fewer_heads(values: dict[str, Any], count: int) -> None:
    """``count`` query heads of the default head dim; the widths follow."""
    head_dim = _head_dim(values)
    heads = next((values[k] for k in _HEAD_COUNTS if isinstance(values.get(k), int)), None)
    if not heads or heads <= count:
        return
    for key in _HEAD_COUNTS:
        if isinstance(values.get(key), int):
            values[key] = count
    for key in _KV_HEAD_COUNTS:
        if isinstance(values.get(key), int):
            values[key] = count if values[key] >= heads else 1
    if head_dim:
        if values.get("head_dim") is None and "head_dim" in values:
            values["head_dim"] = head_dim
        for key in _WIDTHS:
            if isinstance(values.get(key), int):
                values[key] = count * head_dim
    mamba = ("mamba_n_heads", "mamba_d_head", "mamba_expand")
    if all(isinstance(values.get(k), int) for k in mamba) and isinstance(values.get("hidden_size"), int):
        # Mamba hybrids tie the SSM heads to the width: n_heads * d_head == expand * hidden_size.
        values["mamba_n_heads"] = count
        values["mamba_d_head"] = values["mamba_expand"] * values["hidden_size"] // count


def _renumber(value: dict, keep: list[int]) -> dict:
    """A dict keyed by layer index (``per_layer_config``: ``{"05": {...}}``) for the layers kept, renumbered."""
    by_index = {int(key): (key, item) for key, item in value.items()}
    renumbered = {}
    for new, old in enumerate(keep):
        if old in by_index:
            key, item = by_index[old]
            renumbered[new if isinstance(key, int) else str(new).zfill(len(key))] = item
    return renumbered


def _layers_to_keep(values: dict[str, Any], layers: int) -> list[int]:
    """The first layer of each kind (what every per-layer list says of it), at least two, in order."""
    lists = [v for k, v in values.items() if isinstance(v, (list, tuple)) and len(v) == layers
             and k != "eos_token_id"]
    patterns = [v for k, v in values.items() if _cyclic(k, v, layers)]
    keep, kinds = [], set()
    for i in range(layers):
        kind = tuple(repr(v[i]) for v in lists) + tuple(repr(v[i % len(v)]) for v in patterns)
        if kind not in kinds and len(keep) < MAX_LAYERS:
            kinds.add(kind)
            keep.append(i)
    for i in range(layers):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _cyclic(key: str, value: Any, layers: int) -> bool:
    return key.endswith("types") and isinstance(value, (list, tuple)) and 0 < len(value) < layers


def _head_dim(values: dict[str, Any]) -> int | None:
    if isinstance(values.get("head_dim"), int):
        return values["head_dim"]
    width = next((values[k] for k in _WIDTHS if isinstance(values.get(k), int)), None)
    heads = next((values[k] for k in _HEAD_COUNTS if isinstance(values.get(k), int)), None)
    return width // heads if width and heads else None


def tiny_config(model_type: str, level: str = "tiny") -> Any:
    """The type's default config, shrunk (and mended, where zoo_inputs.CONFIG_FIXES says how) and loaded back
    as a checkpoint's config would be."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    values = shrink(config_class().to_dict(), level)
    fix = zoo_inputs.CONFIG_FIXES.get(model_type)
    if fix is not None:
        fix(values, level)
    return config_class.from_dict(values)


def build(model_type: str, seed: int = 0) -> Tiny | Skipped:
    """The type's base model (``AutoModel``'s class), as small as :data:`LEVELS` allows, in eval mode,
    with inputs its forward runs on: zoo_inputs' for the types it has a builder for, else text."""
    import transformers
    from transformers.models.auto import modeling_auto

    # The base model where AutoModel has one, else the class that wraps it (4.44's Llava has only that).
    mappings = [getattr(modeling_auto, name, {}) for name in _MODEL_MAPPINGS]
    class_name = next((mapping[model_type] for mapping in mappings if model_type in mapping), None)
    if class_name is None:
        return Skipped(model_type, "no model class: a configuration used inside other models only")
    if isinstance(class_name, (list, tuple)):
        class_name = class_name[0]
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        return Skipped(model_type, f"transformers exports no {class_name}")
    forward = inspect.signature(model_class.forward).parameters
    if "input_ids" not in forward and model_type not in zoo_inputs.BUILDERS:
        needs = next((name for name in forward if name != "self"), "?")
        return Skipped(model_type, f"no text input: its forward starts with {needs}, and zoo_inputs has no builder")
    reasons = []
    for level in LEVELS:
        tiny = _build(model_type, model_class, forward, level, seed)
        if isinstance(tiny, Tiny):
            return tiny
        reasons.append(tiny)
    wider = f"; kept wider ({LEVELS[-1]}): {reasons[-1]}" if reasons[-1] != reasons[0] else ""
    return Skipped(model_type, f"{reasons[0]}{wider}")


def _build(model_type: str, model_class: type, forward: Mapping, level: str, seed: int) -> Tiny | str:
    try:
        config = tiny_config(model_type, level)
    except Exception as error:
        return f"the shrunk config is refused: {_first_line(error)}"
    model = instantiate(model_class, config, level, seed)
    if isinstance(model, str):
        return model
    text = _text_config(config)
    layers = next((getattr(text, k) for k in _LAYER_COUNTS if isinstance(getattr(text, k, None), int)), 0)
    if model_type in zoo_inputs.BUILDERS:
        return _build_from(model_type, model, config, forward, level, layers)
    vocab = getattr(text, "vocab_size", None) or VOCAB
    ids = torch.randint(4, min(vocab, VOCAB) - 40, (1, TOKENS), generator=torch.Generator().manual_seed(seed + 1))
    inputs = {"input_ids": ids}
    if "decoder_input_ids" in forward and getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids.clone()
    with torch.no_grad():
        try:
            output = first_tensor(model(**inputs))
        except Exception as error:
            if "attention_mask" not in forward:
                return f"the tiny model's own forward fails on text alone: {_first_line(error)}"
            inputs["attention_mask"] = torch.ones_like(ids)  # some forwards need one (4.44's PaliGemma)
            try:
                output = first_tensor(model(**inputs))
            except Exception:
                return f"the tiny model's own forward fails on text alone: {_first_line(error)}"
    return Tiny(model_type, model, inputs, layers, level, output)


def _build_from(model_type: str, model: torch.nn.Module, config: Any, forward: Mapping, level: str,
                layers: int) -> Tiny | str:
    """The type with zoo_inputs' inputs: images, audio, embeddings, text with an image span."""
    try:
        inputs = zoo_inputs.non_text_inputs(model_type, model, config, forward)
    except Exception as error:
        return f"the input builder raised: {_first_line(error)}"
    if isinstance(inputs, str):
        return f"no inputs: {inputs}"
    with torch.no_grad():
        try:
            output = first_tensor(model(**inputs))
        except Exception as error:
            return f"the tiny model's own forward fails on the built inputs: {_first_line(error)}"
    return Tiny(model_type, model, inputs, layers, level, output)


def instantiate(model_class: type, config: Any, level: str, seed: int) -> torch.nn.Module | str:
    """The model of ``config``, seeded and in eval mode, or why not: too large (counted on meta first), or
    transformers raised building it."""
    try:
        with torch.device("meta"):  # counted before memory is spent on it
            size = sum(p.numel() for p in model_class(config).parameters())
    except Exception as error:
        return f"the tiny model does not build: {_first_line(error)}"
    if size > MAX_PARAMETERS:
        return f"still {size / 1e6:.0f}M parameters shrunk this far ({level})"
    torch.manual_seed(seed)
    try:
        return model_class(config).eval()
    except Exception as error:
        return f"the tiny model does not build: {_first_line(error)}"


def _text_config(config: Any) -> Any:
    if not hasattr(config, "get_text_config"):  # transformers 4.44
        return getattr(config, "text_config", None) or config
    try:
        return config.get_text_config()
    except ValueError:  # several text configs (an encoder and a decoder): each is a type of its own
        return config


def first_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of a model's output (``last_hidden_state``, logits), to compare outputs."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (list, tuple)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def lines(explanation: Any) -> list[str]:
    """An audit's findings, one line each: ``layer: field: expected ... found ...``."""
    return [f"{m.layer}: {m.field}: expected {m.expected}, found {m.found}" for m in explanation.mismatches]


def sweep_one(model_type: str) -> Outcome | Skipped:
    """Build ``model_type`` tiny and run the static audit, the dynamic audit and ``share()`` on it."""
    import rope_dedup

    start = time.perf_counter()
    tiny = build(model_type)
    if isinstance(tiny, Skipped):
        return tiny
    reference = tiny.output
    outcome = Outcome(model_type, "clean")
    try:
        static = rope_dedup.explain(tiny.model, expect="config")
        dynamic = rope_dedup.explain(tiny.model, expect="config", **tiny.inputs)
    except Exception as error:
        outcome.problems.append(f"explain raised {_first_line(error)}\n{traceback.format_exc()}")
    else:
        outcome.static, outcome.dynamic = lines(static), lines(dynamic)
        outcome.problems += [f"static and dynamic audits disagree: {d}" for d in disagreements(static, dynamic)]
    try:
        rope_dedup.share(tiny.model)
        with torch.no_grad():
            after = first_tensor(tiny.model(**tiny.inputs))
        if reference is not None and not torch.equal(after, reference):
            outcome.problems.append("share() changed the output")
    except Exception as error:
        outcome.problems.append(f"share() raised {_first_line(error)}\n{traceback.format_exc()}")
    if outcome.problems:
        outcome.status = "failure"
    elif outcome.static or outcome.dynamic:
        outcome.status = "finding"
    outcome.seconds = time.perf_counter() - start
    return outcome


_STATE = re.compile(r"([\w.]+) \((?:b?float|complex)\w*\)")


def disagreements(static: Any, dynamic: Any) -> list[str]:
    """Where the static and the dynamic audit of one model say different things of the same thing.

    - a held table a layer applies (the dynamic table's source names it): the same fields differ in both
      (none, or e.g. ``theta``);
    - the config: the same unreadable fields and legacy conflicts;
    - the model as a whole: tables held but none applied, or applied but none held.

    What only one audit can see is no disagreement: a held table no layer applies (``original_inv_freq``),
    a table computed in forward from no held state, and a layer that applies no RoPE (only a forward tells).
    """
    found = []
    held = {t.source.split(" (")[0]: (row.layer, verdict) for row in static.layers
            for t, verdict in zip(row.applied, row.verdicts)}
    for row in dynamic.layers:
        for table, verdict in zip(row.applied, row.verdicts):
            for path in _STATE.findall(table.source):
                if path in held and set(held[path][1]) != set(verdict):
                    found.append(f"{path}: static says {list(held[path][1]) or 'ok'} ({held[path][0]}), dynamic says "
                                 f"{list(verdict) or 'ok'} ({row.layer})")
    config = [{(m.field, m.found) for m in audit.mismatches if m.layer == "(config)"} for audit in (static, dynamic)]
    if config[0] != config[1]:
        found.append(f"config findings: static {sorted(config[0])}, dynamic {sorted(config[1])}")
    # "RoPE applied that the audit cannot measure" is no disagreement: the forward saw tables, unread.
    nothing = [any(m.layer == "(model)" and m.field == "rope" and m.found.startswith("no RoPE table")
                   for m in audit.mismatches) for audit in (static, dynamic)]
    if nothing[1] and static.applied:
        found.append("the static audit measured tables held, the dynamic audit saw none applied")
    if nothing[0] and any(_STATE.search(t.source) for t in dynamic.applied):
        found.append("the dynamic audit saw tables computed from held state, the static audit found none held")
    return found


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# -- what the sweep's findings are, and the docs table --------------------------------------------------

@dataclass(frozen=True)
class Explained:
    """Why a type's findings are true: every finding line of the type matches ``pattern``. ``since``: the first
    transformers release that has the type (None: every release swept)."""

    pattern: str
    why: str
    since: str | None = None


_ROPE_OFF_ON_GLOBAL_LAYERS = (
    "true: the model's attention applies RoPE only on sliding-window layers ({code}); its full-attention "
    "layers use no position encoding, while rope_parameters gives no layer type a None entry")
_ROPE_OFF = r"^\S+: rope: expected .* \(layer type full_attention\), found no RoPE table applied, though"

# The dynamic audit's finding for RoPE applied at positions it cannot read (it says so, and judges nothing).
_UNMEASURED = (r"^\(model\): rope: expected RoPE applied in attention layers, found RoPE applied that the audit "
               r"cannot measure .*$")

EXPLAINED_5: dict[str, Explained] = {
    **{model_type: Explained(_ROPE_OFF, _ROPE_OFF_ON_GLOBAL_LAYERS.format(code=code)) for model_type, code in {
        "cohere2": "`if self.sliding_window is not None: apply_rotary_pos_emb(...)`",
        "cohere2_moe": "`if self.sliding_window is not None or self.force_rope`",
        "cohere2_vision": "Cohere2's decoder",
        "aya_vision": "Cohere2's decoder",
        "exaone4": "`# We use global NoPE for hybrid attention model`",
        "exaone4_5": "Exaone 4's decoder",
        "exaone_moe": "`# We use global NoPE for hybrid attention model`",
        "kolibri1": "`# We use global NoPE for hybrid attention model`",
        "flint": "`# Only sliding-window layers are rotary; full-attention layers use no positional encoding`",
    }.items()},
    "lara_mini": Explained(_ROPE_OFF, _ROPE_OFF_ON_GLOBAL_LAYERS.format(
        code="`position_embeddings=position_embeddings if layer_type == \"sliding_attention\" else None`"),
        since="5.25.0"),
    "clvp": Explained(
        r"^\(config\): config: .* found model.config has neither rope_parameters nor rope_theta$",
        "true: CLVP's rotary module hard-codes its base (`10000 ** (torch.arange(0, dim, 2) / dim)`), and its "
        "config names no theta to read"),
    "zamba2": Explained(
        r"^\(model\): rope: expected RoPE applied in attention layers, found no RoPE table (held|applied)",
        "true: the default config says `use_mem_rope=False`, so the shared attention block builds no rotary "
        "module, while the config carries rope_parameters"),
    **{model_type: Explained(
        _UNMEASURED,
        "not judged: DINOv3's RoPE rotates patch-centre coordinates in [-1, 1], not whole positions; the "
        "dynamic audit says it cannot measure the tables applied (the static audit judges the held frequencies: "
        "theta and half the head per axis of the patch grid)")
       for model_type in ("dinov3_vit", "sapiens2")},
    "efficientloftr": Explained(
        _UNMEASURED,
        "not judged: EfficientLoFTR builds its 2-D positions inside the graph as two float grids counted from 1 "
        "(`ones(h, w).cumsum(0)`, `.cumsum(1)`), 2x2 in the tiny model, which the dynamic audit does not take "
        "for positions: it says it cannot measure the tables its coarse attention layers apply"),
    "kimi_linear": Explained(
        r"^\(config\): config: .* found model.config has neither rope_parameters nor rope_theta$",
        "true: Kimi Linear's MLA keeps a `qk_rope_head_dim` split but applies no RoPE (its attention has "
        "no rotary module), and its config names no theta to read"),
}


# transformers 4.44: filled in from its sweep.
EXPLAINED_4: dict[str, Explained] = {"clvp": EXPLAINED_5["clvp"]}  # the same model code on 4.44.2


def explained() -> dict[str, Explained]:
    """The explanations for the installed transformers' sweep: those of its major version whose type it has."""
    import transformers

    version = transformers.__version__
    table = EXPLAINED_5 if version.startswith("5.") else EXPLAINED_4
    return {t: e for t, e in table.items() if e.since is None or _release(e.since) <= _release(version)}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def status_of(result: Outcome | Skipped) -> str:
    return "skipped" if isinstance(result, Skipped) else result.status


def problems_of(result: Outcome | Skipped) -> list[str]:
    """What must not happen: a failure of rope_dedup, a finding nobody explained, an explanation with
    nothing to explain."""
    if isinstance(result, Skipped):
        return []
    problems = list(result.problems)
    why = explained().get(result.model_type)
    findings = result.static + result.dynamic
    problems += [f"finding not explained in zoo.explained(): {line}" for line in findings
                 if why is None or not re.search(why.pattern, line)]
    if why is not None and not findings:
        problems.append("zoo.explained() explains a finding this sweep did not make")
    return problems


def stale_explanations(swept: list[str]) -> list[str]:
    """Explained types the sweep no longer covers (renamed, or no longer naming RoPE)."""
    return sorted(set(explained()) - set(swept))


def table(results: list[Outcome | Skipped]) -> list[str]:
    """The docs table: model type, then clean / finding (why) / skipped (why)."""
    rows = ["| model type | result | why |", "|---|---|---|"]
    for result in results:
        if isinstance(result, Skipped):
            rows.append(f"| {result.model_type} | skipped | {_cell(result.reason)} |")
        elif result.status == "finding":
            known = explained().get(result.model_type)
            lines = sorted(set(result.static) | set(result.dynamic))
            why = (known.why if known else "NOT EXPLAINED") + ": " + "; ".join(lines)
            rows.append(f"| {result.model_type} | finding | {_cell(why)} |")
        else:
            rows.append(f"| {result.model_type} | {result.status} | {_cell('; '.join(result.problems))} |")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _markers(version: str) -> tuple[str, str]:
    return f"<!-- zoo: transformers=={version} -->", f"<!-- /zoo: transformers=={version} -->"


def read_table(path: Path, version: str) -> list[str] | None:
    """The table docs/zoo.md holds for this transformers version (None: none)."""
    begin, end = _markers(version)
    text = path.read_text().splitlines() if path.exists() else []
    if begin not in text or end not in text:
        return None
    return text[text.index(begin) + 1:text.index(end)]


def write_table(path: Path, version: str, rows: list[str]) -> None:
    """Put ``rows`` between this version's markers in docs/zoo.md (appended with them where absent)."""
    begin, end = _markers(version)
    text = path.read_text().splitlines() if path.exists() else []
    if begin in text and end in text:
        text[text.index(begin) + 1:text.index(end)] = rows
    else:
        text += ["", f"## transformers {version}", "", begin, *rows, end]
    path.write_text("\n".join(text) + "\n")
