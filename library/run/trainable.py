"""What the run layer trains: the small protocol between the loop (library/run/trainer.py) and the trained thing.

The trainer, the session and the file metadata never know *what* is trained; a recipe builds one object that
implements :class:`Trainable` and hands it to :class:`library.run.trainer.Trainer`:

* ``networks.network.AdapterNetwork`` (``kind == "network"``): LoRA-family adapters (train_network.py);
* ``library.run.token_embeddings.TokenEmbeddings`` (``kind == "embedding"``): new token rows (textual inversion);
* :class:`TrainableSet`: several of them trained together (pivotal tuning: an adapter plus token embeddings).

A model-sized trainable (full fine-tune) sets ``gradient_sync = "accelerate"`` and returns the object accelerate's
``prepare`` gave it from :meth:`Trainable.prepare`, so DDP / FSDP / DeepSpeed come from the user's accelerate
config without touching the loop. Adapters and embeddings run inside a frozen model that DDP cannot see, so they
say ``"manual"`` and the trainer averages their gradients itself at each optimizer step. A model-sized trainable
may also define ``prepare_with_optimizer(accelerator, optimizer, scheduler)``: accelerate then prepares the model,
its optimizer and scheduler in one call, as DeepSpeed and FSDP require (see :func:`prepare_for_training`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@runtime_checkable
class Trainable(Protocol):
    """The trainer's whole view of what it trains (an ``nn.Module`` holding only the trained tensors)."""

    kind: str  # "network" | "embedding" | "model"
    modelspec_kind: str  # "lora" | "textual-inversion" | "" (checkpoint): the modelspec.architecture suffix
    gradient_sync: str  # "manual": the trainer all-reduces gradients; "accelerate": DDP/FSDP/DeepSpeed do
    # True when a step may leave some trained tensors without a gradient (DyLoRA trains one rank block per step):
    # with several processes the manual all-reduce then leaves "no gradient" (not zeros) where no process had one,
    # so the optimizer skips those tensors as it does in one process (no momentum, no weight decay on them)
    sparse_gradients: bool

    def parameters(self, recurse: bool = True) -> Any: ...  # those with requires_grad are optimized

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...  # resumable state (--save_state)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any: ...

    def set_training(self, mode: bool) -> None:
        """Train mode (dropout on) or eval mode (samples, validation, saving)."""

    def step_models(self, models: Any) -> Any:
        """The step's inputs (``library.run.train_step.StepModels``) as this trainable changes them: a model
        accelerate wrapped, text-encoder training stopped, captions rewritten for new tokens; ``models`` itself when
        it changes nothing. The trainer asks this before every step; trainables never write into the run's."""

    def after_step(self) -> dict[str, float]:
        """Called after every optimizer step (e.g. max-norm scaling); returns values to log."""

    def prepare(self, accelerator: Any) -> Trainable:
        """Hand the trainable to accelerate if it needs it (``gradient_sync == "accelerate"``); returns it."""

    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> dict[str, Tensor] | None:
        """The tensors of the output file, cast to ``dtype`` (``--save_precision``), which its ``sshs_*`` hashes
        cover; None for a file that carries no such hashes (a whole model, as sd-scripts writes it)."""

    def metadata(self) -> dict[str, str]:
        """This trainable's own ``ss_*`` keys (the run's keys are added by library/run/run_metadata.py)."""

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        """Write the output file atomically (metadata: the run's keys, for formats that carry metadata)."""


class TrainableSet(nn.Module):
    """Several trainables trained as one (pivotal tuning). The first is the primary: its file is the run's output
    and its ``kind`` / ``modelspec_kind`` describe the run; the others' ``save_extra(path, ...)`` write their own
    files next to it."""

    gradient_sync = "manual"

    def __init__(self, members: Sequence[Any], bundle: bool = False):
        super().__init__()
        self.members = nn.ModuleList(members)
        self.bundle = bundle  # the primary's file also carries the others' ``bundle_tensors`` (A1111 bundle_emb.*)
        self.kind = members[0].kind
        self.caption_rewrite = (
            None  # captions -> captions for the members' new tokens (library/run/token_embeddings.py)
        )
        self.modelspec_kind = members[0].modelspec_kind

    @property
    def primary(self) -> Any:
        return self.members[0]

    def set_training(self, mode: bool) -> None:
        for m in self.members:
            m.set_training(mode)

    def step_models(self, models: Any) -> Any:
        """Each member's changes in turn, then the set's caption rewrite (pivotal tuning: every new token)."""
        for m in self.members:
            models = m.step_models(models)
        if self.caption_rewrite is not None:
            models = dataclasses.replace(models, caption_rewrite=self.caption_rewrite)
        return models

    def after_step(self) -> dict[str, float]:
        logs: dict[str, float] = {}
        for m in self.members:
            logs.update(m.after_step())
        return logs

    @property
    def sparse_gradients(self) -> bool:
        return any(m.sparse_gradients for m in self.members)

    def prepare(self, accelerator: Any) -> TrainableSet:
        return self

    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        tensors = self.primary.state_dict_for_file(dtype)
        if self.bundle:
            for m in self.members[1:]:
                tensors.update(m.bundle_tensors(dtype))
        return tensors

    def metadata(self) -> dict[str, str]:
        return self.primary.metadata()

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        """The primary's file (with the bundled tensors when asked), then each other member's own file."""
        from library.files.weights import save_state_dict

        if self.bundle:
            meta = {**self.metadata(), **(metadata or {})}
            save_state_dict(self.state_dict_for_file(dtype), path, metadata=meta, wrap_ckpt=False)
        else:
            self.primary.save(path, metadata=metadata, dtype=dtype)
        for m in self.members[1:]:
            m.save_extra(path, metadata=metadata, dtype=dtype)


def prepare_for_training(trainable: Any, accelerator: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
    """Hand the optimizer and scheduler to accelerate: together with the model when the trainable asks for it
    (``prepare_with_optimizer``: full models under DDP / FSDP / DeepSpeed), else on their own."""
    together = getattr(trainable, "prepare_with_optimizer", None)
    if together is not None:
        return together(accelerator, optimizer, scheduler)
    return accelerator.prepare(optimizer, scheduler)
