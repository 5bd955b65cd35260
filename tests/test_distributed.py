"""Distributed cases on 2 CPU ranks (gloo, loopback only), run once by torchrun; see distributed_cases.py."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

CASES = Path(__file__).with_name("distributed_cases.py")

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch built without gloo")


def run_cases(out_dir: Path, *extra: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(CASES), str(out_dir), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_cases(tmp_path_factory.mktemp("dist"))
    # Each xdist worker given a test here would start torchrun (48 s on 2 cores, the suite's longest set-up):
    # the first runs the cases, the other waits and reads its results. The folder is this run's alone.
    shared = tmp_path_factory.getbasetemp().parent / "distributed"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "done"
        if done.exists():
            return [json.loads((shared / f"rank{r}.json").read_text()) for r in range(2)]
        results = run_cases(shared)
        done.touch()
        return results


def per_rank(ranks: list[dict], case: str) -> list[dict]:
    results = [r[case] for r in ranks]
    for result in results:
        assert "error" not in result, result["error"]
    return results


def test_replicated_dtensor_tables_share_local_storage(ranks) -> None:
    for rank in per_rank(ranks, "replicated"):
        assert rank["dtensor_tables"]
        assert (rank["before"], rank["after"]) == (8, rank["ideal"])
        assert rank["max_abs_diff"] == 0.0  # equal to the single-process eager model
        assert [g[2] for g in rank["groups"]] == ["Replicate() on mesh (2,) cpu"] * 2


def test_tensor_parallel_losses_and_gradients_equal(ranks) -> None:
    for rank in per_rank(ranks, "tensor_parallel"):
        assert rank["loss_diff"] == 0.0 and rank["grad_max_diff"] == 0.0
        assert (rank["before"], rank["after"]) == (8, rank["ideal"])


def test_fsdp2_per_block_compile(ranks) -> None:
    for rank in per_rank(ranks, "fsdp2_regional"):
        assert rank["loss_diff"] == 0.0
        assert (rank["before"], rank["after"]) == (8, rank["ideal"])


def test_meta_build_then_share_after_init_then_compile(ranks) -> None:
    for rank in per_rank(ranks, "meta_init_share"):
        assert rank["loss_diff"] == 0.0
        assert (rank["before"], rank["after_share"], rank["after"]) == (8, rank["ideal"], rank["ideal"])
        assert rank["meta_skips"] == ["meta tensor: no data to compare; share after the tables are initialized "
                                      "(to_empty, init_weights)"]


def test_a_dtensor_model_moves_after_a_compile_and_stays_shared(ranks) -> None:
    """Before, the move raised: "_apply(): Couldn't swap Linear.weight" (a weak reference to every tensor)."""
    for rank in per_rank(ranks, "dtensor_move"):
        assert rank["after_move"] == 2 and rank["dtypes"] == ["torch.float64"]
        assert rank["max_abs_diff"] == 0.0


def test_pipeline_chunks_share_only_within_one_backend(ranks) -> None:
    for rank in per_rank(ranks, "pipeline"):
        assert rank == {"same_backend": 2, "two_backends": 4}


def test_sharded_tables_are_skipped_with_reason(ranks) -> None:
    for rank in per_rank(ranks, "sharded"):
        assert rank["after"] == 4
        assert rank["skipped"]["0.rope.cos"] == "DTensor with S(0) placement: only replicated tables are shared"
        assert "0" not in rank["skipped"]  # the forward argument is an activation, not module state


def test_recompute_keeps_dtensor_tables_with_reason(ranks) -> None:
    for rank in ranks:
        case = rank["recompute_dtensor"]
        assert "error" not in case, case["error"]
        assert case["recomputed"] == 0 and case["after"] == 2 and case["max_abs_diff"] == 0
        assert case["kept"] == ["not recomputed (a DTensor: recomputing on each rank is not supported yet): it keeps "
                                "its values"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL case needs 2 GPUs")
def test_replicated_case_on_nccl(tmp_path) -> None:
    for rank in run_cases(tmp_path, "replicated", "--device", "cuda"):
        assert (rank["replicated"]["before"], rank["replicated"]["after"]) == (8, 2)
