"""The distributed cases, run by torchrun on 2 CPU ranks (gloo); each rank writes its figures as JSON.

Launched by tests/test_distributed.py; the same code runs with NCCL when ``--device cuda`` is given.
Usage: torchrun --nproc-per-node 2 tests/distributed_cases.py OUT_DIR [--device cuda]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from rope_dedup.testing.toy_decoder import ToyDecoder, homogeneous, rope_tensors  # noqa: E402

from rope_dedup import RopeDedupBackend  # noqa: E402


def local_storages(tensors) -> int:
    """Distinct local storages on this rank (a DTensor's memory is its local tensor)."""
    return len({(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr() for t in tensors})


def replicated_twins(mesh, device: str) -> tuple[nn.Module, nn.Module]:
    """(plain reference, the same 4 layers with every parameter and buffer a replicated DTensor)."""
    torch.manual_seed(0)
    reference = nn.Sequential(*(TPAttention(explicit=True) for _ in range(4))).to(device)
    torch.manual_seed(0)
    model = nn.Sequential(*(TPAttention(explicit=True) for _ in range(4))).to(device)
    return reference, distribute_module(model, mesh, input_fn=lambda mod, inputs, mesh: tuple(
        distribute_tensor(x, mesh, [Replicate()]) for x in inputs))


def replicated_decoder(mesh, device: str) -> dict:
    """Case 1: every parameter and buffer a replicated DTensor (distribute_module), compiled whole."""
    reference, model = replicated_twins(mesh, device)
    tables = [b for layer in model for b in (layer.rope.cos, layer.rope.sin)]
    before = local_storages(tables)
    backend = RopeDedupBackend("aot_eager")
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(device)
    out = torch.compile(model, backend=backend)(x)
    expected = reference(x)
    return {
        "dtensor_tables": all(isinstance(t, DTensor) for t in tables),
        "before": before,
        "after": local_storages(tables),
        "ideal": 2,
        "max_abs_diff": (out.to_local() - expected).abs().max().item(),
        "groups": [(g.key.layout, len(g.members), g.placement) for g in backend.report.groups],
    }


def dtensor_move_after_compile(mesh, device: str) -> dict:
    """Case: replicated DTensor model compiled through rope_dedup, then moved. ``Module._apply`` always swaps a
    DTensor parameter (torch.utils.swap_tensors), which refuses a tensor with a weak reference to it."""
    reference, model = replicated_twins(mesh, device)
    backend = RopeDedupBackend("aot_eager")
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(device)
    torch.compile(model, backend=backend)(x)
    model.to(torch.float64)  # every parameter swapped, every buffer converted
    reference.to(torch.float64)
    tables = [b for layer in model for b in (layer.rope.cos, layer.rope.sin)]
    out = model(distribute_tensor(x.double(), mesh, [Replicate()]))
    return {
        "after_move": local_storages(tables),
        "dtypes": sorted({str(t.dtype) for t in tables}),
        "max_abs_diff": (out.to_local() - reference(x.double())).abs().max().item(),
    }


class TPRope(nn.Module):
    """A per-layer RoPE cache kept as a replicated DTensor on the TP mesh, used through its local value."""

    def __init__(self, head_dim: int, length: int = 32) -> None:
        super().__init__()
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(length).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos, self.sin
        if isinstance(cos, DTensor) and not isinstance(x, DTensor):
            cos, sin = cos.to_local(), sin.to_local()
        seq, half = x.shape[-2], x.shape[-1] // 2
        cos, sin = cos[:seq], sin[:seq]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TPAttention(nn.Module):
    def __init__(self, d_model: int = 32, heads: int = 4, explicit: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d_model // heads
        self.explicit = explicit  # DTensor has no CPU sharding rule for fused SDPA: spell attention out
        self.wq, self.wk, self.wv = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.rope = TPRope(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = self.rope(q), self.rope(k)
        if self.explicit:
            scores = (q @ k.transpose(-2, -1)) / self.head_dim**0.5
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
            if isinstance(scores, DTensor):
                causal = distribute_tensor(causal, scores.device_mesh, [Replicate()])
            y = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


def tp_model(mesh, device: str, parallel: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(TPAttention() for _ in range(4))).to(device)
    if parallel:
        for layer in model:
            parallelize_module(layer, mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                             "wv": ColwiseParallel(), "wo": RowwiseParallel()})
            distribute_module(layer.rope, mesh)  # buffers become replicated DTensors
    return model


def tensor_parallel(mesh, device: str) -> dict:
    """Case 2: column/row-wise TP with per-layer replicated RoPE caches; forward and backward."""
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2)).to(device)
    results = {}
    for name, backend in (("plain", "aot_eager"), ("dedup", RopeDedupBackend("aot_eager"))):
        model = tp_model(mesh, device, parallel=True)
        loss = torch.compile(model, backend=backend)(x).square().mean()
        loss.backward()
        grads = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for p in model.parameters()]
        tables = [b for layer in model for b in (layer.rope.cos, layer.rope.sin)]
        results[name] = (loss.item(), grads, local_storages(tables))
    (plain_loss, plain_grads, before), (loss, grads, after) = results["plain"], results["dedup"]
    return {
        "loss_diff": abs(loss - plain_loss),
        "grad_max_diff": max((a - b).abs().max().item() for a, b in zip(grads, plain_grads)),
        "before": before,
        "after": after,
        "ideal": 2,
    }


def fsdp2_regional(mesh, device: str) -> dict:
    """Case 3: FSDP2 on per-layer blocks compiled one by one (torchtitan's order: compile, then shard)."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3)).to(device)
    results = {}
    for name, backend in (("plain", "aot_eager"), ("dedup", RopeDedupBackend("aot_eager"))):
        torch.manual_seed(0)
        model = ToyDecoder(homogeneous(4)).to(device)
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)
            fully_shard(model.layers[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        losses = []
        for _ in range(2):
            loss = model(tokens).logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.item())
        results[name] = (losses, local_storages(t for _, t in rope_tensors(model)))
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(results["plain"][0], results["dedup"][0])),
        "before": results["plain"][1],
        "after": results["dedup"][1],
        "ideal": 2,
    }


def meta_init_share(mesh, device: str) -> dict:
    """Case 6: torchtitan's order without the pass at build time: build on meta, shard (FSDP2), to_empty,
    init, then rope_dedup.share() and per-block compile with the same backend."""
    from rope_dedup import share

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(6)).to(device)
    initial = [t for _, t in rope_tensors(ToyDecoder(homogeneous(4)))]  # what init_weights computes
    results, meta_skips = {}, None
    for name in ("plain", "shared"):
        with torch.device("meta"):
            model = ToyDecoder(homogeneous(4))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        backend = RopeDedupBackend("aot_eager") if name == "shared" else "aot_eager"
        if name == "shared":  # before init: every table on meta, skipped with its reason
            meta_skips = sorted({s.reason for s in share(model, backend=backend).skipped if "rope" in s.path})
        model.to_empty(device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                    module.reset_parameters()
            for (_, table), value in zip(rope_tensors(model), initial):
                table.copy_(value)
        if name == "shared":
            share(model, backend=backend)
        shared_after_init = local_storages(t for _, t in rope_tensors(model))
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)
        losses = []
        for _ in range(2):
            loss = model(tokens).logsumexp(-1).mean()
            loss.backward()
            losses.append(loss.item())
        results[name] = (losses, shared_after_init, local_storages(t for _, t in rope_tensors(model)))
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(results["plain"][0], results["shared"][0])),
        "before": results["plain"][2],
        "after_share": results["shared"][1],
        "after": results["shared"][2],
        "meta_skips": meta_skips,
        "ideal": 2,
    }


def pipeline_chunks(mesh, device: str) -> dict:
    """Case 4: two model chunks on one rank; one backend instance shares across them, two never do."""
    tokens = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(4)).to(device)
    counts = {}
    for name in ("same_backend", "two_backends"):
        torch.manual_seed(0)
        model = ToyDecoder(homogeneous(4)).to(device)
        first, second = RopeDedupBackend("aot_eager"), RopeDedupBackend("aot_eager")
        chunk_a = torch.compile(nn.Sequential(model.embed, *model.layers[:2]), backend=first)
        chunk_b = torch.compile(nn.Sequential(*model.layers[2:]), backend=first if name == "same_backend" else second)
        chunk_b(chunk_a(tokens))
        counts[name] = local_storages(t for _, t in rope_tensors(model))
    return counts


def sharded_tables(mesh, device: str) -> dict:
    """Case 5: a table sharded across ranks is left alone, with the reason in the report."""
    model = nn.Sequential(*(TPAttention(explicit=True) for _ in range(2))).to(device)
    for layer in model:
        for name in ("cos", "sin"):
            layer.rope.register_buffer(name, distribute_tensor(getattr(layer.rope, name), mesh, [Shard(0)]),
                                       persistent=False)
    backend = RopeDedupBackend("aot_eager")
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(5)).to(device)
    expected = model(x)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), expected)
    tables = [b for layer in model for b in (layer.rope.cos, layer.rope.sin)]
    return {"after": local_storages(tables), "skipped": {s.path: s.reason for s in backend.report.skipped}}


def recompute_dtensor(mesh, device: str) -> dict:
    """Case: share(model, tables="recompute") on replicated DTensor tables: kept (not recomputed per rank yet),
    each with its reason, shared as before, outputs equal."""
    from rope_dedup import share

    reference, model = replicated_twins(mesh, device)
    report = share(model, backend=RopeDedupBackend("eager"), tables="recompute")
    tables = [b for layer in model for b in (layer.rope.cos, layer.rope.sin)]
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)).to(device)
    return {
        "recomputed": len(report.recomputed),
        "kept": sorted({s.reason for s in report.skipped if s.kind.name == "NOT_EXACT"}),
        "after": local_storages(tables),
        "max_abs_diff": (model(x).to_local() - reference(x)).abs().max().item(),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    device = "cuda" if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    cases = {"replicated": replicated_decoder, "tensor_parallel": tensor_parallel,
             "fsdp2_regional": fsdp2_regional, "pipeline": pipeline_chunks, "sharded": sharded_tables,
             "meta_init_share": meta_init_share, "dtensor_move": dtensor_move_after_compile,
             "recompute_dtensor": recompute_dtensor}
    selected = [c for c in cases if c in sys.argv] or list(cases)
    results = {}
    for name in selected:
        torch._dynamo.reset()
        try:
            results[name] = cases[name](mesh, device)
        except Exception as error:  # report per case: one failure must not hide the others
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
