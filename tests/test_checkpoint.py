"""Checkpoint safety: state_dict keys, torch.save round trips, and the persistent-buffer policy.

safetensors' ``save_file`` refuses tensors that share memory, and ``load_state_dict`` copies into every
tensor in place. So buffers saved in a ``state_dict`` (persistent ones) are shared only when the user opts
in with ``share_persistent=True``; by default they are skipped with the reason. Non-persistent buffers and
plain tensor attributes (where RoPE caches usually live) are never in a ``state_dict``: they are shared.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_model, save_file, save_model
from torch.torch_version import TorchVersion

import rope_dedup
from rope_dedup import RopeDedupBackend, dedup_rope
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, homogeneous, rope_tensors, unique_storages
from rope_dedup.core.eligibility import SkipReason

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
LAYERS = 4


def decoder(persistent: bool, seed: int = 0) -> ToyDecoder:
    """Four layers of identical cos/sin tables; ``persistent`` registers them as HF's older models did."""
    torch.manual_seed(seed)
    model = ToyDecoder(homogeneous(LAYERS, max_len=64))
    if persistent:
        for module in model.modules():
            module._non_persistent_buffers_set.clear()
    return model


def storages(model: torch.nn.Module) -> int:
    return unique_storages([t for _, t in rope_tensors(model)])[0]


def compiled(model: ToyDecoder, **options) -> tuple[torch.nn.Module, RopeDedupBackend]:
    backend = RopeDedupBackend("eager", **options)
    compiled_model = torch.compile(model, backend=backend)
    compiled_model(TOKENS)
    return compiled_model, backend


def test_persistent_buffers_are_skipped_by_default_with_the_reason() -> None:
    model = decoder(persistent=True)
    _, backend = compiled(model)
    assert storages(model) == 2 * LAYERS
    skipped = {s.path: s.reason for s in backend.report.skipped}
    for name, _ in rope_tensors(model):
        assert skipped[name] == SkipReason.PERSISTENT.value
    assert not backend.report.groups


@pytest.mark.parametrize("share_persistent", [False, True])
def test_regional_compile_applies_the_policy_to_every_block(share_persistent: bool) -> None:
    """One graph serves every block: persistence is read from the block it was compiled for, and run-time
    interning applies the same decision to the others (instances of a class register buffers alike)."""
    model = decoder(persistent=True)
    backend = RopeDedupBackend("eager", share_persistent=share_persistent)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=backend)
    model(TOKENS)
    assert storages(model) == (2 if share_persistent else 2 * LAYERS)
    reasons = {s.reason for s in backend.report.skipped if "rope" in s.path}
    assert reasons == (set() if share_persistent else {SkipReason.PERSISTENT.value})


def test_default_model_saves_with_safetensors_save_file(tmp_path) -> None:
    for persistent in (False, True):
        model = decoder(persistent)
        compiled(model)
        save_file(model.state_dict(), tmp_path / f"model-{persistent}.safetensors")


def test_share_persistent_opts_in_and_save_model_round_trips(tmp_path) -> None:
    model = decoder(persistent=True)
    compiled_model, backend = compiled(model, share_persistent=True)
    assert storages(model) == 2
    assert len(backend.report.groups) == 2
    # The documented trap, and why sharing persistent buffers is opt-in:
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(model.state_dict(), tmp_path / "refused.safetensors")
    # The documented way: save_model writes one copy of each shared tensor; load_model checks that the
    # target shares the same way, so the target is compiled (deduplicated) before loading.
    save_model(model, str(tmp_path / "model.safetensors"))
    fresh = decoder(persistent=True, seed=1)
    with pytest.raises(RuntimeError, match="Missing key"):
        load_model(fresh, str(tmp_path / "model.safetensors"))
    fresh_compiled, _ = compiled(fresh, share_persistent=True)
    load_model(fresh, str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(fresh_compiled(TOKENS), compiled_model(TOKENS), rtol=0, atol=0)


@pytest.mark.parametrize("persistent", [False, True], ids=["non_persistent", "persistent_opt_in"])
def test_state_dict_keys_are_unchanged_and_torch_save_round_trips(tmp_path, persistent: bool) -> None:
    model = decoder(persistent)
    keys = list(model.state_dict())
    compiled_model, _ = compiled(model, share_persistent=persistent)
    assert storages(model) == 2
    assert list(model.state_dict()) == keys
    path = tmp_path / "state.pt"
    torch.save(model.state_dict(), path)
    fresh = decoder(persistent, seed=1)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    torch.testing.assert_close(fresh(TOKENS), compiled_model(TOKENS), rtol=0, atol=0)


def test_loading_a_checkpoint_into_a_deduplicated_model_keeps_outputs() -> None:
    """load_state_dict copies in place: into shared tables it writes the same values once per sharer."""
    model = decoder(persistent=True)
    reference = decoder(persistent=True, seed=1)
    compiled_model, _ = compiled(model, share_persistent=True)
    model.load_state_dict(reference.state_dict())
    assert storages(model) == 2
    torch.testing.assert_close(compiled_model(TOKENS), reference(TOKENS), rtol=0, atol=0)


class Tables(torch.nn.Module):
    """Two equal non-persistent tables, read with get_attr after symbolic_trace."""

    def __init__(self) -> None:
        super().__init__()
        table = ToyDecoder(homogeneous(1, max_len=16)).layers[0].attention.rope.cos
        self.register_buffer("a", table.clone(), persistent=False)
        self.register_buffer("b", table.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + x * self.b


# torch 2.14 made symbolic_trace keep persistent=False (the GraphModule used to register every buffer it
# copies as persistent); the tests below say which torch does what.
TRACE_KEEPS_PERSISTENCE = torch.__version__ >= TorchVersion("2.14")


def test_plain_symbolic_trace_keeps_persistence_only_from_torch_2_14() -> None:
    gm = torch.fx.symbolic_trace(Tables())
    if TRACE_KEEPS_PERSISTENCE:
        assert set(gm.state_dict()) == set()
        assert dedup_rope(gm).modified
    else:
        assert set(gm.state_dict()) == {"a", "b"}
        result = dedup_rope(gm)
        assert not result.modified
        assert {s.reason for s in result.report.skipped} == {SkipReason.PERSISTENT.value}
    assert dedup_rope(torch.fx.symbolic_trace(Tables()), share_persistent=True).modified


def test_rope_dedup_symbolic_trace_shares_non_persistent_tables_on_every_torch() -> None:
    model = Tables()
    gm = rope_dedup.symbolic_trace(model)
    assert set(gm.state_dict()) == set(model.state_dict()) == set()
    x = torch.randn(16, 8)
    result = dedup_rope(gm)
    assert result.modified
    assert [len(g.members) for g in result.report.groups] == [2]
    assert gm.a.data_ptr() == gm.b.data_ptr()
    assert not result.report.skipped
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_rope_dedup_symbolic_trace_keeps_persistent_buffers_persistent() -> None:
    model = Tables()
    model._non_persistent_buffers_set.discard("a")
    gm = rope_dedup.symbolic_trace(model)
    assert set(gm.state_dict()) == {"a"}
    result = dedup_rope(gm)
    assert [s.path for s in result.report.skipped] == ["a"]
    assert [g.members for g in result.report.groups] == [["b"]]


def persistent_model() -> ToyDecoder:
    model = ToyDecoder([TableRecipe(max_len=64)] * 2)
    for module in model.modules():
        module._non_persistent_buffers_set.clear()
    return model


def checkpoint(*thetas: float) -> dict[str, torch.Tensor]:
    other = ToyDecoder([TableRecipe(max_len=64, theta=theta) for theta in thetas])
    return other.state_dict() | {n: t.clone() for n, t in rope_tensors(other)}


@pytest.mark.parametrize("how", ["compile", "share"])
@pytest.mark.parametrize("strict", [True, False])
def test_a_checkpoint_with_different_tables_unshares_them_first(how: str, strict: bool) -> None:
    """load_state_dict copies every sharer's value in place: into one storage, the last one would win. A
    pre-hook gives each differing member its own storage first, so each ends with exactly its value."""
    state = checkpoint(1e4, 5e5)
    model = persistent_model()
    if how == "compile":
        _, backend = compiled(model, share_persistent=True)
    else:
        backend = RopeDedupBackend("eager", share_persistent=True)
        rope_dedup.share(model, backend=backend)
    assert storages(model) == 2
    if not strict:
        state = {k: v for k, v in state.items() if not k.endswith("sin")}  # missing keys: left as they are
    model.load_state_dict(state, strict=strict)
    for name, table in rope_tensors(model):
        expected = state.get(name, table)
        assert torch.equal(table, expected), name
    reloaded = {s.path for s in backend.report_for(model).skipped if s.kind is SkipReason.RELOADED}
    assert reloaded == {"layers.1.attention.rope.cos"} | ({"layers.1.attention.rope.sin"} if strict else set())
    assert storages(model) == (4 if strict else 3)  # layer 0 kept the shared storage; layer 1 has its own


def test_an_equal_checkpoint_loads_and_stays_shared() -> None:
    model = persistent_model()
    _, backend = compiled(model, share_persistent=True)
    model.load_state_dict(checkpoint(1e4, 1e4))
    assert storages(model) == 2 and not [s for s in backend.report.skipped if s.kind is SkipReason.RELOADED]


def test_assign_puts_the_checkpoint_tensors_in_place_and_shares_nothing_by_accident() -> None:
    state = checkpoint(1e4, 5e5)
    model = persistent_model()
    compiled(model, share_persistent=True)
    model.load_state_dict(state, assign=True)
    for name, table in rope_tensors(model):
        assert table is state[name]


class FrozenTables(torch.nn.Module):
    """Two equal frozen parameters: in the state_dict like persistent buffers, so under the same policy."""

    def __init__(self) -> None:
        super().__init__()
        table = ToyDecoder(homogeneous(1, max_len=16)).layers[0].attention.rope.cos
        self.a = torch.nn.Parameter(table.clone(), requires_grad=False)
        self.b = torch.nn.Parameter(table.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + x * self.b


@pytest.mark.parametrize("share_persistent", [False, True])
def test_frozen_parameters_follow_the_persistent_policy(share_persistent: bool) -> None:
    model = FrozenTables()
    backend = RopeDedupBackend("eager", share_persistent=share_persistent)
    x = torch.randn(16, 8)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x), rtol=0, atol=0)
    assert (model.a.data_ptr() == model.b.data_ptr()) == share_persistent
    assert {s.reason for s in backend.report.skipped} == (set() if share_persistent else {SkipReason.PERSISTENT.value})


class AssignsInForward(torch.nn.Module):
    """A module that sets an attribute in forward (fair-esm's rotary caches): dynamo then reaches its
    buffers through ``__dict__['_buffers']``, and persistence must still be read."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        table = ToyDecoder(homogeneous(1, max_len=16)).layers[0].attention.rope.cos
        self.register_buffer("cos", table.clone(), persistent=persistent)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = 1
        return x * self.cos


@pytest.mark.parametrize("persistent", [False, True])
def test_persistence_is_read_when_forward_assigns_attributes(persistent: bool) -> None:
    layers = torch.nn.Sequential(AssignsInForward(persistent), AssignsInForward(persistent))
    backend = RopeDedupBackend("eager")
    x = torch.randn(16, 8)
    torch.testing.assert_close(torch.compile(layers, backend=backend)(x), layers(x), rtol=0, atol=0)
    assert (layers[0].cos.data_ptr() == layers[1].cos.data_ptr()) != persistent
    report = backend.report_for(layers)
    if persistent:
        assert {s.path: s.reason for s in report.skipped} == {"0.cos": SkipReason.PERSISTENT.value, "1.cos": SkipReason.PERSISTENT.value}
    else:
        assert report.groups[0].members == ["0.cos", "1.cos"]
