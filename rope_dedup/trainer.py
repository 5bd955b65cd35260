"""The door for Hugging Face ``Trainer`` (and so accelerate) users: share the RoPE tables once the Trainer
has placed the model, then let any backend accelerate knows compile it.

``TrainingArguments(torch_compile_backend="rope_dedup")`` cannot work: transformers hands the name to
accelerate (``ACCELERATE_DYNAMO_BACKEND``), whose ``TorchDynamoPlugin`` reads it as
``DynamoBackend(name.upper())``, a closed enum (``inductor``, ``aot_eager``, ...), and raises before
training starts. Sharing needs no backend: :func:`rope_dedup.share` re-points each duplicate table at
one storage, and ``inductor`` (or any backend) then compiles the model as it stands.

Why a callback: ``on_train_begin`` sees the model the Trainer trains (a ``model_init`` one included), after
the Trainer has placed it on its device and before the first forward, so the tables are shared where they
train and before anything compiles, with no code around the Trainer. ``share(model)`` before
``Trainer(...)`` works as well (the Trainer's move keeps shared tables shared). Import this module only with
transformers installed.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from rope_dedup.backend import RopeDedupBackend
from rope_dedup.core.report import DedupReport
from rope_dedup.share import share


class ShareRopeTables(TrainerCallback):
    """``Trainer(..., callbacks=[ShareRopeTables()])``: :func:`rope_dedup.share` on the model at the start of
    each ``train()``; ``report`` is that call's :class:`~rope_dedup.DedupReport`."""

    def __init__(self, backend: RopeDedupBackend | None = None) -> None:
        self.backend = backend
        self.report: DedupReport | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is not None:
            self.report = share(model, backend=self.backend)
