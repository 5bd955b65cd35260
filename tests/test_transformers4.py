"""transformers 4.x models that keep ``cos_cached``/``sin_cached`` in every attention layer.

transformers 4.44 gives each attention module its own rotary module whose ``_set_cos_sin_cache``
registers ``inv_freq``, ``cos_cached`` and ``sin_cached`` (all ``persistent=False``) and registers them
anew in ``forward`` when a sequence is longer than the cache. transformers 5 (the ``test`` extra) moved
RoPE to one module at model level, so these models need transformers 4.44.2 in an environment of its
own: ``pip install torch==2.13.0 && pip install -e '.[test-transformers4]'``, then
``python -m pytest tests/test_transformers4.py`` (CI does this in a second venv). Elsewhere they skip.

Ideal: per model one storage each for ``cos_cached`` and ``sin_cached`` (all layers have the same
theta, dim and length), whatever the number of layers. ``inv_freq`` is read only where a cache is
regrown, so it keeps one storage per layer until a compiled graph regrows the caches.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from real_models import unique_storages
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from rope_dedup import RopeDedupBackend

transformers = pytest.importorskip("transformers")
if not transformers.__version__.startswith("4."):
    pytest.skip(f"needs transformers 4.x (per-attention caches), found {transformers.__version__}: "
                f"see this file's docstring", allow_module_level=True)
transformers.logging.set_verbosity_error()

LAYERS = 2
MAX_POSITIONS = 64
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=4, max_position_embeddings=MAX_POSITIONS, use_cache=False)


def _model(config_name: str, model_name: str, **extra) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        config = getattr(transformers, config_name)(**COMMON, **extra)
        torch.manual_seed(0)
        return getattr(transformers, model_name)(config).eval()
    return build


MODELS = {
    "qwen2": _model("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2),
    "stablelm": _model("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=2),
    "starcoder2": _model("Starcoder2Config", "Starcoder2ForCausalLM", num_key_value_heads=2),
    "persimmon": _model("PersimmonConfig", "PersimmonForCausalLM"),
    "mixtral": _model("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=2,
                      num_experts_per_tok=2),
}


def rope_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [getattr(layer.self_attn.rotary_emb, name) for layer in model.model.layers
            for name in ("inv_freq", "cos_cached", "sin_cached")]


def tokens(seq: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))


def run(model: torch.nn.Module, backend, lengths) -> tuple[list[tuple[torch.Tensor, int]], int]:
    """(logits, RoPE storages) after each call, and the frames compiled."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter)
    out = []
    with torch.no_grad():
        for seq in lengths:
            out.append((compiled(tokens(seq)).logits, unique_storages(rope_tensors(model))))
    return out, counter.frame_count


# Two calls within the cache, then a sequence longer than it: the graph re-registers every layer's cache
# (one copy per layer until a graph reads them), and the next call shares them again.
LENGTHS = (16, 16, MAX_POSITIONS + 16, MAX_POSITIONS + 16)


@pytest.mark.parametrize("name, inner", [(name, "eager") for name in sorted(MODELS)] + [("qwen2", "aot_eager")])
def test_per_attention_caches_share_and_regrown_ones_share_again(name: str, inner: str) -> None:
    plain, plain_frames = run(MODELS[name](), inner, LENGTHS)
    torch._dynamo.reset()
    model = MODELS[name]()
    assert unique_storages(rope_tensors(model)) == 3 * LAYERS
    backend = RopeDedupBackend(inner)
    got, frames = run(model, backend, LENGTHS)
    for (logits, _), (want, _) in zip(got, plain):
        torch.testing.assert_close(logits, want, rtol=0, atol=0)
    assert [storages for _, storages in plain] == [3 * LAYERS] * len(LENGTHS)
    # cos and sin shared, inv_freq unread; the regrowing graph reads inv_freq (shared from then on) and
    # registers new caches, one per layer; the next call reads and shares them.
    assert [storages for _, storages in got] == [2 + LAYERS, 2 + LAYERS, 1 + 2 * LAYERS, 3]
    assert frames == plain_frames
    report = backend.report_for(model)
    assert not report.departed  # every regrown cache was shared again under its own path
    assert not [s for s in report.skipped if "rotary_emb" in s.path]
    shared = sorted(m for g in report.groups for m in g.members)
    assert shared == sorted(f"model.layers.{i}.self_attn.rotary_emb.{t}" for i in range(LAYERS)
                            for t in ("inv_freq", "cos_cached", "sin_cached"))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_share_in_eager_then_regrown_caches_then_share_again(name: str) -> None:
    """Without compiling: share() leaves one storage per table; a longer sequence re-registers every layer's
    caches in forward (each its own, outputs exact), the report names the shared ones that went, and a second
    share() brings the tables back to the ideal."""
    from rope_dedup import share

    reference, model = MODELS[name](), MODELS[name]()
    backend = RopeDedupBackend("eager")
    share(model, backend=backend)
    assert unique_storages(rope_tensors(model)) == 3  # inv_freq, cos_cached, sin_cached
    with torch.no_grad():
        for seq in (16, MAX_POSITIONS + 16):
            torch.testing.assert_close(model(tokens(seq)).logits, reference(tokens(seq)).logits, rtol=0, atol=0)
    assert unique_storages(rope_tensors(model)) == 1 + 2 * LAYERS
    departed = {d.path for d in backend.report_for(model).departed}
    assert departed == {f"model.layers.{i}.self_attn.rotary_emb.{t}" for i in range(LAYERS)
                        for t in ("cos_cached", "sin_cached")}
    again = share(model, backend=backend)
    assert unique_storages(rope_tensors(model)) == 3 and len(again.newly_shared) == 2 * (LAYERS - 1)
    assert not again.departed


def test_generate_past_max_positions_reports_the_regrown_caches() -> None:
    """``generate`` with transformers 4.44's DynamicCache recompiles on every step (its token counter is
    a static int to dynamo) until the recompile limit, with or without rope_dedup; from then on forward
    runs eagerly and regrows the caches where no backend sees them. The report says so."""
    reference = MODELS["qwen2"]()
    model = MODELS["qwen2"]()
    backend = RopeDedupBackend("eager")
    model.forward = torch.compile(model.forward, backend=backend)
    prompt = tokens(MAX_POSITIONS - 8)[:1]
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True)
        want = reference.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True)
    assert torch.equal(got, want)
    report = backend.report_for(model)
    departed = {d.path: d for d in report.departed}
    assert sorted(departed) == sorted(f"model.layers.{i}.self_attn.rotary_emb.{t}" for i in range(LAYERS)
                                      for t in ("cos_cached", "sin_cached"))
    assert all(d.replaced and d.key.length == MAX_POSITIONS for d in departed.values())
    assert "replaced by a tensor with its own storage" in str(report)


def train(model: torch.nn.Module, backend, steps: int = 2) -> tuple[list[torch.Tensor], list[dict], int]:
    """Losses, gradients per step and table storages after ``steps`` AdamW steps of the compiled model."""
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(steps):
        ids = tokens(16 + step)
        optimizer.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, unique_storages([t for t in rope_tensors(model) if t.dim() > 1])


@pytest.mark.slow  # 62 s of the session's 102 (inductor's backward, cold); the Trainer test trains under aot_eager
def test_training_under_inductor_is_bitwise_equal_to_inductor_alone() -> None:
    """Persimmon in train mode: with each layer's placeholders redirected to one table node, inductor
    fused the rotary backward with the q/k layernorm backward differently and every gradient moved by up
    to 2e-7; with the tables shared in memory only, kernels, losses and gradients are inductor's own."""
    def persimmon() -> torch.nn.Module:
        return MODELS["persimmon"]().train()  # dropout probabilities are 0: deterministic

    want_losses, want_grads, plain_storages = train(persimmon(), "inductor")
    torch._dynamo.reset()
    losses, grads, storages = train(persimmon(), RopeDedupBackend("inductor"))
    assert (plain_storages, storages) == (2 * LAYERS, 2)
    for got, want in zip(losses, want_losses):
        assert torch.equal(got, want)
    for step, (got, want) in enumerate(zip(grads, want_grads)):
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"step {step}: {len(differ)} of {len(want)} gradients differ, e.g. {differ[:3]}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_static_audit_flags_every_layer_when_the_config_theta_changed_after_the_build(name: str) -> None:
    """Right after init, no forward: each attention layer's own caches are judged against the config."""
    from rope_dedup import explain

    model = MODELS[name]()
    calls = []
    for module in model.modules():
        module.register_forward_pre_hook(lambda module, args: calls.append(module))
    assert explain(model, expect="config").mismatches == ()
    model.config.rope_theta = 5e5
    found = explain(model, expect="config").mismatches
    attention_layers = sorted({m.layer for m in found})
    assert len(attention_layers) == LAYERS and {m.field for m in found} == {"theta"}
    assert calls == []


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_precision_audit_finds_caches_as_built_and_names_a_bf16_cast(name: str) -> None:
    """Each layer's caches, built by 4.44's own ``_set_cos_sin_cache``, match transformers' reference bit for bit;
    ``model.to(torch.bfloat16)`` rounds them (and ``inv_freq``): each is a finding that names the cast."""
    from rope_dedup import explain

    model = MODELS[name]()
    clean = explain(model, expect="config", precision=True)
    assert clean.mismatches == ()
    held = [t for t in clean.precision if t.source.endswith(("cos_cached", "sin_cached"))]
    assert len(held) == 2 * LAYERS and all(t.verdict == "matches" and t.to_reference.angle == 0 for t in held)
    model.to(torch.bfloat16)
    cast = explain(model, expect="config", precision=True)
    found = {(t.source.rpartition(".")[2], t.cause.split(":")[0]) for t in cast.precision if t.diverges}
    assert found == {("cos_cached", "a cast"), ("sin_cached", "a cast"), ("inv_freq", "frequencies (inv_freq) rounded to bfloat16")}


# -- the Trainer door ---------------------------------------------------------------------------------------

def train_two_steps(tmp_path, monkeypatch, callbacks: list) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """Two optimizer steps of a tiny Qwen2 through ``Trainer``, compiled by accelerate with ``aot_eager``
    (AOTAutograd's training graphs without inductor's minutes of CPU codegen); the loss of each step."""
    from transformers import Trainer, TrainingArguments

    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE"):  # TrainingArguments sets them
        monkeypatch.delenv(name, raising=False)
    model = MODELS["qwen2"]().train()
    data = [{"input_ids": tokens(16)[0], "labels": tokens(16)[0]} for _ in range(4)]
    losses = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False):
            loss = super().compute_loss(model, inputs, return_outputs)
            losses.append(loss.detach().clone())
            return loss

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                             use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, seed=0, torch_compile=True, torch_compile_backend="aot_eager")
    Recording(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    return losses, model


def test_trainer_with_shared_tables_trains_as_without(tmp_path, monkeypatch) -> None:
    from rope_dedup.trainer import ShareRopeTables

    plain, unshared = train_two_steps(tmp_path / "plain", monkeypatch, [])
    callback = ShareRopeTables()
    shared, model = train_two_steps(tmp_path / "shared", monkeypatch, [callback])
    assert len(plain) == len(shared) == 2
    for a, b in zip(plain, shared):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert unique_storages(rope_tensors(unshared)) == 3 * LAYERS  # inv_freq, cos and sin per layer
    assert unique_storages(rope_tensors(model)) == 3  # one each, still after two compiled steps
    assert sorted(g.key.layout for g in callback.report.groups) == ["cos-halves", "inv_freq", "sin-halves"]
    assert counters["stats"]["unique_graphs"] > 0  # accelerate compiled the model: the path under test


def test_accelerate_refuses_the_backend_by_name(tmp_path, monkeypatch) -> None:
    """Why the door is a callback: accelerate reads the backend name as a closed enum."""
    from accelerate import Accelerator
    from transformers import TrainingArguments

    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    TrainingArguments(output_dir=str(tmp_path), use_cpu=True, torch_compile_backend="rope_dedup")
    with pytest.raises(ValueError, match="ROPE_DEDUP"):
        Accelerator()


# Models whose caches, cast to bf16 (``model.to(torch.bfloat16)``), a recipe reproduces: each layer's cos and sin.
BF16 = {
    "persimmon": MODELS["persimmon"],
    "gpt_neox": _model("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "falcon": _model("FalconConfig", "FalconForCausalLM", new_decoder_architecture=True, alibi=False),
    "phi": _model("PhiConfig", "PhiForCausalLM"),
}


@pytest.mark.parametrize("name", BF16)
def test_bf16_caches_are_recomputed_whole(name: str) -> None:
    """A bf16 sine measures theta 9999 and an amplitude of 1.0003 (within bf16 of the float32 recipe that made
    it): every layer's cos_cached and sin_cached are recomputed, outputs bitwise equal."""
    import copy

    from rope_dedup import share
    from rope_dedup.core.eligibility import SkipReason
    from rope_dedup.recompute import RecomputedTable

    model = BF16[name]().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    report = share(model, tables="recompute")
    assert not [s for s in report.skipped if s.kind is SkipReason.NOT_EXACT]
    caches = [b for n, b in model.named_buffers() if n.endswith(("cos_cached", "sin_cached"))]
    assert len(caches) == 2 * LAYERS and all(isinstance(b, RecomputedTable) and b.is_recomputed for b in caches)
    with torch.no_grad():
        assert torch.equal(model(tokens(16)).logits, twin(tokens(16)).logits)
