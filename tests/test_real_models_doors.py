"""The other doors on real models (tests/real_models.py): torch.export, lifecycle, checkpoints, tables in forward.

Same promises as the backend tests: ideal storage counts, outputs equal to the run without the pass,
every table accounted for. Expectations come from the registry and from content equality, never from
what rope_dedup reports.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from real_models import REAL_MODELS, WITH_PERSISTENT_TABLES, RealCase, distinct_contents, unique_storages
from safetensors.torch import load_model, save_file, save_model
from torch._dynamo.testing import EagerAndRecordGraphs

from rope_dedup import RopeDedupBackend, dedup_exported
from rope_dedup.core.eligibility import SkipReason

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

# fair-esm's ESM2.forward branches on data (`if not padding_mask.any()`): torch.export refuses to trace it.
EXPORTABLE = sorted(set(REAL_MODELS) - {"fair-esm-esm2"})


def forward(case: RealCase, model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return case.output(model(*case.example_inputs))


def settle(case: RealCase, compiled: nn.Module) -> torch.Tensor:
    """Three calls: lazy caches are built on the first and read from the second on; the last output."""
    for _ in range(3):
        out = forward(case, compiled)
    return out


@pytest.mark.parametrize("share_persistent", [False, True], ids=["default", "share_persistent"])
@pytest.mark.parametrize("name", EXPORTABLE)
def test_exported_program_keeps_one_input_per_table(name: str, share_persistent: bool) -> None:
    case = REAL_MODELS[name]()
    ep = torch.export.export(case.model, case.example_inputs)
    deduped = dedup_exported(ep, share_persistent=share_persistent)
    torch.testing.assert_close(forward(case, deduped.module()), forward(case, ep.module()), rtol=0, atol=0)

    # Lifted before any call: unread tables are inputs too (and shareable); a lazy cache is still zeros.
    lifted = {s.target for s in ep.graph_signature.input_specs}
    tables = [(n, t) for n, t in case.rope_tensors(case.model) if n in lifted]
    # A lazy cache is written by the program (rotary-embedding-torch fills it under autocast, inside a
    # higher-order op's body) and, exported before any call, still zeros: kept apart for the write.
    report = deduped.graph_module.meta["rope_dedup_report"]
    unfilled = {s.path for s in report.skipped if s.kind is SkipReason.WRITTEN}
    assert unfilled == {n for n, _ in tables if n.endswith("cached_freqs")}
    kept_apart = set(case.skips(share_persistent)) | unfilled
    shareable = [t for n, t in tables if n not in kept_apart]
    ideal = len(tables) - len(shareable) + distinct_contents(shareable)
    remaining = {s.target for s in deduped.graph_signature.input_specs}
    values = {**deduped.constants, **deduped.state_dict}
    assert unique_storages(values[n] for n, _ in tables if n in remaining) == ideal
    assert ideal < len(tables) or not shareable
    assert set(deduped.state_dict) == set(ep.state_dict)  # checkpoint keys never change


def compiled_pair(name: str):
    """The case compiled with an eager-inner rope_dedup backend, and an identical eager reference."""
    case, reference = REAL_MODELS[name](), REAL_MODELS[name]()
    compiled = torch.compile(case.model, backend=RopeDedupBackend("eager"))
    return case, compiled, reference


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_dtype_round_trip_recompiles_and_shares_again(name: str) -> None:
    case, compiled, reference = compiled_pair(name)
    torch.testing.assert_close(settle(case, compiled), forward(reference, reference.model), rtol=0, atol=0)
    for dtype in (torch.float64, torch.float32):
        case.model.to(dtype)
        reference.model.to(dtype)
        torch.testing.assert_close(settle(case, compiled), settle(reference, reference.model), rtol=0, atol=0)
        assert unique_storages(t for _, t in case.rope_tensors(case.model)) == case.ideal()


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_to_empty_and_reinitialised_buffers_come_back_shared(name: str) -> None:
    case, compiled, reference = compiled_pair(name)
    expected = settle(reference, reference.model)
    settle(case, compiled)
    case.model.to_empty(device="cpu")
    case.model.load_state_dict(reference.model.state_dict())
    theirs = dict(reference.model.named_buffers())
    with torch.no_grad():  # what a model's init code does: recompute non-persistent buffers in place
        for buffer_name, tensor in case.model.named_buffers():
            tensor.copy_(theirs[buffer_name])
    torch.testing.assert_close(settle(case, compiled), expected, rtol=0, atol=0)
    assert unique_storages(t for _, t in case.rope_tensors(case.model)) == case.ideal()


def sharing(state: dict[str, torch.Tensor]) -> list[list[str]]:
    """Groups of state_dict keys whose tensors share a storage (safetensors' save_file refuses these)."""
    groups: dict[int, list[str]] = {}
    for key, tensor in state.items():
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(key)
    return sorted(keys for keys in groups.values() if len(keys) > 1)


@pytest.mark.parametrize("name", sorted(REAL_MODELS))
def test_state_dict_keys_torch_save_and_safetensors(name: str, tmp_path) -> None:
    case, compiled, reference = compiled_pair(name)
    keys = list(case.model.state_dict())
    expected = settle(case, compiled)
    assert list(case.model.state_dict()) == keys
    # Default policy: the pass shares nothing a state_dict holds (tied embeddings were shared before it).
    assert sharing(case.model.state_dict()) == sharing(reference.model.state_dict())
    if not sharing(reference.model.state_dict()):
        save_file(case.model.state_dict(), tmp_path / "model.safetensors")
    torch.save(case.model.state_dict(), tmp_path / "model.pt")
    reference.model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    torch.testing.assert_close(settle(reference, reference.model), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(WITH_PERSISTENT_TABLES))
def test_shared_persistent_tables_round_trip_with_save_model(name: str, tmp_path) -> None:
    case, other = REAL_MODELS[name](), REAL_MODELS[name]()
    expected = settle(case, torch.compile(case.model, backend=RopeDedupBackend("eager", share_persistent=True)))
    assert unique_storages(t for _, t in case.rope_tensors(case.model)) == case.ideal(share_persistent=True)
    save_model(case.model, str(tmp_path / "model.safetensors"))
    compiled_other = torch.compile(other.model, backend=RopeDedupBackend("eager", share_persistent=True))
    settle(other, compiled_other)
    load_model(other.model, str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(settle(other, compiled_other), expected, rtol=0, atol=0)


def cos_ops(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method")
               and getattr(n.target, "__name__", n.target) == "cos")


@pytest.mark.parametrize("name", ["transformers-recurrentgemma", "rotary-embedding-torch"])
def test_tables_computed_in_forward_are_merged(name: str) -> None:
    """RecurrentGemma builds cos/sin from each layer's inv_freq in forward: once the inv_freq inputs are
    one node, the two layers' computations are one (2 cos ops -> 1). rotary-embedding-torch rebuilds
    its table per query/key call; reads on either side of its in-place cache write are never merged, so
    fewer, not one, remain. Outputs stay bitwise equal to the graph without merging."""
    counts, outputs = {}, {}
    for merge in (False, True):
        torch._dynamo.reset()
        recording = EagerAndRecordGraphs()
        case = REAL_MODELS[name]()
        backend = RopeDedupBackend(recording, merge_computed=merge, share_persistent=True)
        outputs[merge] = settle(case, torch.compile(case.model, backend=backend))
        counts[merge] = cos_ops(recording.graphs[0])
    torch.testing.assert_close(outputs[True], outputs[False], rtol=0, atol=0)
    if name == "transformers-recurrentgemma":
        assert (counts[False], counts[True]) == (2, 1)
    else:
        # One cos per query/key call, 2 layers: the two computed from the shared frozen ``freqs`` (before
        # each layer's cache write) become one; the two reading each layer's just-written cache stay apart.
        assert (counts[False], counts[True]) == (4, 3)
