"""Models change after they are compiled: conversions, re-materialization, deletion, several backends.

``.to(dtype)``, ``.to(device)`` and ``to_empty()`` keep shared tables shared (one converted table per group:
rope_dedup/core/moves.py, tests/test_conversions.py); meta-device init and re-initialised buffers bring new,
unshared tensors. A recompile (new dtype or device: dynamo's guards fail) or run-time interning (same dtype
and device: the compiled graph is reused) keeps memory at the ideal, with outputs equal to eager and a
bounded number of graphs.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import compile_model, rope_storages
from torch._dynamo.utils import counters
from rope_dedup.testing.toy_decoder import TableRecipe, ToyDecoder, homogeneous, local_global, rope_tensors, unique_storages

from rope_dedup import RopeDedupBackend
from rope_dedup.core.eligibility import SkipReason

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
SPECS = {"homogeneous": homogeneous(4, max_len=64), "local_global": local_global(6, every=3, max_len=64)}
IDEAL = {"homogeneous": 2, "local_global": 4}  # one cos and one sin per distinct theta


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def reinitialise(model: ToyDecoder, reference: ToyDecoder) -> None:
    """What a model's init code does after to_empty(): recompute (here: copy) every buffer in place."""
    mine, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    with torch.no_grad():
        for name, tensor in mine.items():
            tensor.copy_(theirs[name.replace("._orig_mod", "")])


def check(model: torch.nn.Module, compiled: torch.nn.Module, reference: ToyDecoder, ideal: int) -> None:
    with torch.no_grad():
        torch.testing.assert_close(compiled(TOKENS), reference(TOKENS), rtol=0, atol=0)
    assert rope_storages(model) == ideal


@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
@pytest.mark.parametrize("scenario", sorted(SPECS))
def test_dtype_conversions_recompile_once_and_share_again(scenario: str, regional: bool) -> None:
    torch.manual_seed(0)
    model, reference = ToyDecoder(SPECS[scenario]).eval(), ToyDecoder(SPECS[scenario]).eval()
    reference.load_state_dict(model.state_dict())
    compiled = compile_model(model, RopeDedupBackend("eager"), regional)
    check(model, compiled, reference, IDEAL[scenario])
    seen = graphs()
    for dtype in (torch.float64, torch.float32, torch.float64):
        model.to(dtype)
        reference.to(dtype)
        assert rope_storages(model) == IDEAL[scenario]  # .to() converted one table per group
        check(model, compiled, reference, IDEAL[scenario])
        check(model, compiled, reference, IDEAL[scenario])
    # One new graph for float64 (whole model, or the one graph all blocks share); going back to a dtype
    # seen before reuses its graph (and interns).
    assert graphs() - seen == 1


def test_to_empty_and_reinitialised_buffers_are_interned_without_a_recompile() -> None:
    torch.manual_seed(0)
    model, reference = ToyDecoder(SPECS["local_global"]).eval(), ToyDecoder(SPECS["local_global"]).eval()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=RopeDedupBackend("eager"))
    check(model, compiled, reference, IDEAL["local_global"])
    seen = graphs()
    model.to_empty(device="cpu")
    assert rope_storages(model) == IDEAL["local_global"]  # one uninitialized table per group
    model.load_state_dict(reference.state_dict())
    reinitialise(model, reference)
    check(model, compiled, reference, IDEAL["local_global"])
    assert graphs() == seen


def test_meta_init_then_materialise_then_compile() -> None:
    torch.manual_seed(0)
    reference = ToyDecoder(SPECS["local_global"]).eval()
    with torch.device("meta"):
        model = ToyDecoder(SPECS["local_global"]).eval()
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    reinitialise(model, reference)
    compiled = torch.compile(model, backend=RopeDedupBackend("eager"))
    check(model, compiled, reference, IDEAL["local_global"])


def test_compiling_a_meta_model_skips_its_tables_with_the_reason() -> None:
    """A graph traced before materialization sees meta tensors: nothing to compare, nothing shared."""
    with torch.device("meta"):
        model = ToyDecoder(homogeneous(2, max_len=64))
    backend = RopeDedupBackend("eager")
    torch.compile(model, backend=backend)(TOKENS.to("meta"))
    reasons = {s.reason for s in backend.report.skipped if ".rope." in s.path}
    assert reasons == {SkipReason.META.value}


def test_device_moves_recompile_and_share_on_each_device(device: torch.device) -> None:
    if device.type == "cpu":
        pytest.skip("moving between devices needs a device besides the CPU: ROPE_DEDUP_TEST_DEVICE=cuda")
    torch.manual_seed(0)
    model, reference = ToyDecoder(SPECS["local_global"]).eval(), ToyDecoder(SPECS["local_global"]).eval()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=RopeDedupBackend("eager"))
    for where in (device, "cpu", device):
        model.to(where)
        reference.to(where)
        with torch.no_grad():
            torch.testing.assert_close(compiled(TOKENS.to(where)), reference(TOKENS.to(where)), rtol=0, atol=0)
        assert rope_storages(model) == IDEAL["local_global"]
    # One graph per device: the device guard fails on cpu (a recompile), and back on the device the first
    # graph's guards hold again (as for dtypes above), so it is reused.
    assert graphs() == 2


def test_deleting_the_model_frees_its_canonical_tables() -> None:
    backend = RopeDedupBackend("eager")
    model = ToyDecoder(homogeneous(4, max_len=64))
    compiled = torch.compile(model, backend=backend)
    compiled(TOKENS)
    assert len(backend.report.groups) == 2
    tables = [weakref.ref(t) for _, t in rope_tensors(model)]
    del model, compiled
    gc.collect()
    assert all(ref() is None for ref in tables)
    assert backend.report.groups == []
    assert backend.store.snapshot() == []


def test_two_backends_never_share_between_their_models() -> None:
    torch.manual_seed(0)
    first, second = ToyDecoder(homogeneous(4, max_len=64)), ToyDecoder(homogeneous(4, max_len=64))
    for model in (first, second):
        torch.compile(model, backend=RopeDedupBackend("eager"))(TOKENS)
    assert rope_storages(first) == rope_storages(second) == 2
    both = [t for m in (first, second) for _, t in rope_tensors(m)]
    assert unique_storages(both)[0] == 4


def test_one_backend_shares_across_the_models_it_compiles() -> None:
    """The flip side, and why a backend instance per model is the way to keep models apart."""
    backend = RopeDedupBackend("eager")
    first, second = ToyDecoder(homogeneous(2, max_len=64)), ToyDecoder(homogeneous(2, max_len=64))
    for model in (first, second):
        torch.compile(model, backend=backend)(TOKENS)
    both = [t for m in (first, second) for _, t in rope_tensors(m)]
    assert unique_storages(both)[0] == 2


def test_a_model_built_with_other_specs_after_compile_is_not_merged() -> None:
    """Buffers replaced with different content (another theta) after compiling: the merged graph falls back."""
    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(2, max_len=64)).eval()
    compiled = torch.compile(model, backend=RopeDedupBackend("eager"))
    compiled(TOKENS)
    other = ToyDecoder([TableRecipe(max_len=64), TableRecipe(max_len=64, theta=5e5)]).eval()
    other.load_state_dict(model.state_dict())
    for name, tensor in rope_tensors(other):
        owner, attr = name.rsplit(".", 1)
        model.get_submodule(owner).register_buffer(attr, tensor.clone(), persistent=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(TOKENS), other(TOKENS), rtol=0, atol=0)
    assert rope_storages(model) == 4
