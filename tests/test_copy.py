"""Copies of configs and backends: frameworks deep-copy torch.compile's keywords (Lightning Fabric), and
multiprocess launchers pickle them. A copied backend is the backend itself; a pickled one carries its
config only. Each test here failed before configs and backends could be copied."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from rope_dedup import RopeDedupBackend, RopeDedupConfig
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors, unique_storages

TOKENS = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))


def eager_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    return gm.forward


CONFIGS = [
    RopeDedupConfig(),
    RopeDedupConfig(inner="aot_eager", share_persistent=True, dry_run=True, fold_constants=False),
    RopeDedupConfig(mode="max-autotune-no-cudagraphs", strict=True),
    RopeDedupConfig(inner_options={"epilogue_fusion": False}, release_memory=False),
    RopeDedupConfig(inner=eager_backend),
]


@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy, lambda c: pickle.loads(pickle.dumps(c))],
                         ids=["deepcopy", "copy", "pickle"])
def test_config_round_trips(config: RopeDedupConfig, copier) -> None:
    copied = copier(config)
    assert copied == config
    assert dict(copied.inner_options) == dict(config.inner_options)
    with pytest.raises(TypeError):  # still read-only after the copy
        copied.inner_options["epilogue_fusion"] = True


def test_a_lambda_inner_deep_copies_but_its_pickle_names_the_field() -> None:
    config = RopeDedupConfig(inner=lambda gm, example_inputs: gm.forward)
    assert copy.deepcopy(config) == config  # functions are copied as themselves
    with pytest.raises(pickle.PicklingError, match="field 'inner' holds <function .*<lambda>"):
        pickle.dumps(config)


def test_an_inner_that_cannot_be_copied_names_the_field() -> None:
    class Locked:
        def __init__(self) -> None:
            import threading
            self.lock = threading.Lock()

        def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
            return gm.forward

    config = RopeDedupConfig(inner=Locked())
    with pytest.raises(TypeError, match="cannot deep-copy RopeDedupConfig: field 'inner' holds"):
        copy.deepcopy(config)


def test_a_used_backend_copies_as_itself_and_pickles_as_a_fresh_one() -> None:
    backend = RopeDedupBackend("eager", share_persistent=False)
    model = ToyDecoder(homogeneous(4)).eval()
    with torch.no_grad():
        torch.compile(model, backend=backend)(TOKENS)
    assert unique_storages([t for _, t in rope_tensors(model)])[0] == 2
    assert copy.deepcopy(backend) is backend
    assert copy.deepcopy({"backend": backend})["backend"] is backend
    assert copy.copy(backend) is backend

    fresh = pickle.loads(pickle.dumps(backend))
    assert fresh is not backend and fresh.config == backend.config
    assert fresh.graphs_compiled == 0 and not fresh.report.groups


def test_the_module_level_backend_pickles() -> None:
    from rope_dedup import rope_dedup_backend
    assert pickle.loads(pickle.dumps(rope_dedup_backend)).config == rope_dedup_backend.config


FABRIC = textwrap.dedent("""
    import lightning_fabric  # wraps torch.compile: it deep-copies the keywords and compiles again in setup()
    import torch
    from lightning_fabric import Fabric
    from rope_dedup import RopeDedupBackend
    from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors, unique_storages

    torch.manual_seed(0)
    model = ToyDecoder(homogeneous(4)).eval()
    reference = ToyDecoder(homogeneous(4)).eval()
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (1, 8))
    backend = RopeDedupBackend("eager")

    fabric = Fabric(accelerator="cpu", devices=1)
    compiled = fabric.setup(torch.compile(model, backend=backend))
    with torch.no_grad():
        out, expected = compiled(tokens), reference(tokens)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    print(unique_storages([t for _, t in rope_tensors(model)])[0], backend.graphs_compiled,
          len(backend.report.groups))
""")


def test_lightning_fabric_compiles_through_its_wrapper_and_reaches_the_ideal() -> None:
    pytest.importorskip("lightning_fabric")
    # A child process: importing lightning_fabric replaces torch.compile for the rest of the process.
    child = subprocess.run([sys.executable, "-c", FABRIC], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    storages, graphs, groups = map(int, child.stdout.split())
    assert (storages, groups) == (2, 2)  # 8 tables (cos, sin in 4 layers): one group and storage each
    assert graphs >= 1  # the compile Fabric made, with the deep-copied backend, counted by the user's backend
