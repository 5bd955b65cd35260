"""Tiny torchtitan 0.3.0 models (llama3, deepseek_v3) built the way torchtitan builds them, for the tests.

Where the RoPE tables live (read from torchtitan 0.3.0's source, ``torchtitan/models/common``): there is
no model-level ``freqs_cis`` and nothing RoPE is passed to the blocks. Every attention module builds its
own ``RoPE`` (``GQAttention.__init__`` for llama3, the MLA ``Attention.__init__`` for deepseek_v3:
``self.rope = config.rope.build()``), which registers ``cache`` as a **non-persistent** buffer.
``ComplexRoPE`` fills it with ``torch.polar`` of ``outer(arange(max_seq_len), freqs)``: complex64
``(max_seq_len, rope_dim / 2)``; llama3 bends ``freqs`` with ``scaling="llama"``, deepseek_v3 with YaRN
(``scaling="yarn"``, ``_yarn_inv_freq``). Every layer gets the same RoPE config (deepseek_v3 copies it
with ``dataclasses.replace``), and ``init_weights`` -> ``RoPE._init_self_buffers`` recomputes ``cache``
per module (``self.cache = self._precompute_cache()``). So a model holds one identical table per layer
(``LAYERS`` storages) and the ideal is **one** storage. The blocks read their own buffer, so under
per-block compile each block's table reaches the one compiled graph as an input at run time.

Installing: torchtitan 0.3.0's declared dependencies pull datasets, pyarrow, pandas, tensorboard and wandb
(and importing its MoE code needs triton), so it is not in the ``test`` extra. What importing the model
code needs, with torch 2.13.0 left in place::

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && pip install tyro==1.0.17

Without triton (the CPU wheel has none), :func:`import_torchtitan` stands in for the one module that
imports it, ``torchtitan.distributed.minimal_async_ep.kernels`` (Triton kernels for expert parallelism
over symmetric memory, never run here); torch itself never sees a fake triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from importlib.metadata import version
from typing import Callable

import pytest
import torch
import torch.nn as nn
from real_models import LAYERS, RealCase, distinct_contents

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
BATCH, SEQ = 2, 32
DOCUMENTS = (20, 12)  # positions restart at 0 per document, as torchtitan's dataloaders emit them
VOCAB, DIM, HEADS, MAX_SEQ_LEN = 256, 64, 4, 256


def _kernels_without_triton() -> types.ModuleType:
    """A stand-in for the expert-parallel Triton kernels module: any kernel it is asked for raises."""
    module = types.ModuleType(KERNELS)

    def kernel(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise RuntimeError(f"{KERNELS}.{name} needs triton, which is not installed")
        return missing

    module.__getattr__ = kernel
    return module


def import_torchtitan() -> types.SimpleNamespace:
    """Import the torchtitan modules the tests use (skip the test if torchtitan is not installed).

    Importing ``torchtitan.distributed.compile`` replaces ``FakeTensorMode.__init__`` with a
    ``torch.compiler.disable`` wrapper (a workaround torchtitan carries for pytorch#178887); call
    :func:`restore_torch` when done so the rest of the session runs on torch as shipped.
    """
    pytest.importorskip("torchtitan")
    if importlib.util.find_spec("triton") is None and KERNELS not in sys.modules:
        sys.modules[KERNELS] = _kernels_without_triton()
    names = {
        "llama3": "torchtitan.models.llama3",
        "deepseek_v3": "torchtitan.models.deepseek_v3",
        "common": "torchtitan.models.common",
        "attention": "torchtitan.models.common.attention",
        "rope": "torchtitan.models.common.rope",
        "compile": "torchtitan.distributed.compile",
        "config": "torchtitan.config",
    }
    try:
        return types.SimpleNamespace(**{key: importlib.import_module(name) for key, name in names.items()})
    except ImportError as error:  # torchtitan 0.3.0 uses torch 2.11 APIs (fsdp.DataParallelMeshDims)
        pytest.skip(f"torchtitan {version('torchtitan')} does not import on torch {torch.__version__}: {error}")


def restore_torch(fake_tensor_mode_init: Callable) -> None:
    """Undo torchtitan's import-time patch of ``FakeTensorMode.__init__``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.__init__ = fake_tensor_mode_init


def rope_tables(titan: types.SimpleNamespace) -> Callable[[nn.Module], list[tuple[str, torch.Tensor]]]:
    """``model -> [(full name, cache)]`` for every torchtitan ``RoPE`` module in ``model``."""
    def tables(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return sorted((f"{name}.cache", module.cache) for name, module in model.named_modules()
                      if isinstance(module, titan.rope.RoPE))
    return tables


def _llama3_config(titan: types.SimpleNamespace):
    """torchtitan's llama3 ``debugmodel`` recipe (``_build_llama3_layers``, fused QKV, ComplexRoPE with llama
    scaling, theta 5e5, flex attention), shrunk: 2 layers, dim 64, 4 heads, 256 positions, vocab 256."""
    llama3, common = titan.llama3, titan.common
    return llama3.Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=common.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                               param_init=llama3._EMBEDDING_INIT),
        norm=common.RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=common.Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
        layers=llama3._build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=common.compute_ffn_hidden_dim(DIM, multiple_of=64),
            rope=common.ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=MAX_SEQ_LEN, theta=500000, scaling="llama"),
            attn_backend="flex"))


def _deepseek_v3_config(titan: types.SimpleNamespace):
    """torchtitan's deepseek_v3 ``debugmodel`` recipe (``_build_dsv3_layers``: MLA with q_lora_rank 0, layer 0
    dense and layer 1 MoE, ComplexRoPE with YaRN factor 40 on the 16-dim rope part), shrunk to dim 64."""
    ds, common = titan.deepseek_v3, titan.common
    rope = common.ComplexRoPE.Config(dim=16, max_seq_len=MAX_SEQ_LEN, theta=10000.0, scaling="yarn",
                                     rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=4096)
    layers = ds._build_dsv3_layers(
        n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=HEADS, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, mscale=0.70, dense_hidden_dim=128,
        moe_hidden_dim=32, num_experts=4, num_shared_experts=1, router_top_k=2, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope)
    return ds.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=DIM,
        tok_embeddings=common.Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=ds._EMBEDDING_INIT),
        norm=common.RMSNorm.Config(normalized_shape=DIM, param_init=ds._NORM_INIT),
        lm_head=common.Linear.Config(in_features=DIM, out_features=VOCAB, param_init=ds._output_linear_init(DIM)),
        layers=layers, mtp_layers=[])


CONFIGS = {"llama3": _llama3_config, "deepseek_v3": _deepseek_v3_config}


def example_inputs(titan: types.SimpleNamespace) -> tuple:
    """``(tokens, positions, attention_masks)`` as torchtitan's trainer passes them: per-document positions
    and the block-causal flex mask built from them with torchtitan's own mask mods. (Built with
    ``create_block_mask`` directly: torchtitan's ``create_attention_mask`` wraps it in an inductor
    ``torch.compile``, an extra inductor compile per test that is not what is under test.)"""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    attention = titan.attention
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS]).expand(BATCH, SEQ)
    mask_mod = and_masks(attention.get_causal_mask_mod(),
                         attention.get_efficient_causal_mask_mod_for_packed_document(positions))
    masks = create_block_mask(mask_mod, BATCH, None, SEQ, SEQ, device="cpu")
    return tokens, positions, masks


def init_weights(model: nn.Module) -> None:
    """What torchtitan's trainer does after ``to_empty``: seeded here so two builds are identical."""
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))


def build(titan: types.SimpleNamespace, name: str, on_meta: bool = False) -> RealCase:
    """A tiny torchtitan model in eval mode. ``on_meta``: built on the meta device and left there, for the
    trainer's order (compile the blocks, then ``to_empty`` + :func:`init_weights`); otherwise built on CPU
    and initialised. The ideal is one storage: see the module docstring."""
    config = CONFIGS[name](titan)
    if on_meta:
        with torch.device("meta"):
            model = config.build()
    else:
        model = config.build()
        init_weights(model)
    tables = rope_tables(titan)
    assert len(tables(model)) == LAYERS  # one RoPE module per attention layer, none at model level
    if not on_meta:
        assert distinct_contents(t for _, t in tables(model)) == 1
    return RealCase(name, f"torchtitan=={version('torchtitan')}", model.eval(), example_inputs(titan),
                    ideal_storages=1, rope_tensors=tables)
