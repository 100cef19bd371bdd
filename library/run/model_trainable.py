"""The whole model as a Trainable: full fine-tuning and DreamBooth (fine_tune.py, sdxl_train.py, train_db.py and the
transformer families' full fine-tunes).

The denoiser is trained (unless the family's rules leave it out: ``--learning_rate 0`` where its script reads it
so); the text encoders too where the method trains them (``--train_text_encoder``, or by default in train_db.py,
whose ``--stop_text_encoder_training -1`` means never), each at the learning rate the family's rules give it (0 =
that encoder stays frozen). What differs between families (their own flags, per-encoder learning rates, per-block
learning rates, frozen parameters, the files written) is the family's (``family.full_training``: its
:class:`~library.families.full_training.TrainingRules` for the run); what differs between recipes (fine-tune vs
DreamBooth) is the flag groups the script adds (:func:`add_model_training_args`).

The trainable is handed to ``accelerate.prepare`` (``gradient_sync == "accelerate"``): the loop calls the prepared
object in place of the denoiser, so DDP / FSDP / DeepSpeed come from the user's accelerate config. Files are the
whole model, written by the family's rules (a single file with ModelSpec and the v-pred / ztsnr markers, or a
diffusers folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from library.cli.problems import ConfigError
from library.families.base import Parts
from library.families.full_training import PlainRules, TrainingRules
from library.families.protocol import ModelFamily
from library.optim.fused import FusedStep, block_chunks, chunk_parameters
from library.run.engines import DeepSpeedConfig, launch_problems

logger = logging.getLogger("sdtrain")


# ---------------------------------------------------------------------------------------------------------- flags
def _train_text_encoder(g: Any) -> None:
    g.add_argument("--train_text_encoder", action="store_true", help="also train the text encoder(s)")
    g.add_argument("--diffusers_xformers", action="store_true", help="xformers attention (same as --xformers)")


def _dreambooth(g: Any) -> None:
    g.add_argument("--stop_text_encoder_training", type=int, default=None, help="step at which the text encoder "
                   "stops training (-1: never train it)")  # fmt: skip
    g.add_argument("--no_token_padding", action="store_true", help="pad captions only to the batch's longest, not "
                   "to 77 tokens (diffusers' DreamBooth)")  # fmt: skip


def _fused_groups(g: Any) -> None:
    g.add_argument("--fused_optimizer_groups", type=int, default=None, help="step the optimizer in N parameter "
                   "groups during backward (less gradient memory)")  # fmt: skip


def _blockwise(g: Any) -> None:
    g.add_argument("--blockwise_fused_optimizers", action="store_true", help="step the optimizer for each "
                   "transformer block (and once for the other weights) as soon as its gradients are ready")  # fmt: skip
    g.add_argument("--skip_latents_validity_check", action="store_true", dest="skip_cache_check",
                   help="[deprecated] same as --skip_cache_check (sd-scripts' older name)")  # fmt: skip


# The full-training flag sets a script picks from (each the flags of one concept): "train_text_encoder" (fine-tuning
# that trains the encoders on request), "dreambooth" (train_db.py: the encoders train by default until a step),
# "fused_groups" (--fused_optimizer_groups), "blockwise" (a transformer's per-block fused steps).
FLAG_SETS = {"train_text_encoder": _train_text_encoder, "dreambooth": _dreambooth, "fused_groups": _fused_groups,
             "blockwise": _blockwise}  # fmt: skip


def add_model_training_args(parser: argparse.ArgumentParser, flag_sets: Sequence[str]) -> None:
    """The "full model training" group with the script's ``flag_sets`` (:data:`FLAG_SETS`) and ``--use_safetensors``
    (the family's own full-training flags are ``family.full_training.add_args``)."""
    g = parser.add_argument_group("full model training")
    for name in flag_sets:
        FLAG_SETS[name](g)
    g.add_argument("--use_safetensors", action="store_true", help="save in safetensors (with --save_model_as ckpt: "
                   "a .safetensors file; diffusers: safetensors weights), as sd-scripts")  # fmt: skip


@dataclass(frozen=True)
class ModelTrainingConfig:
    """What of the model is trained, at which learning rates, how the optimizer steps: the recipe's flags and the
    family's ``rules`` (``family.full_training.read``)."""

    rules: TrainingRules = PlainRules()
    stop_text_encoder_training: int | None = None
    deepspeed: DeepSpeedConfig | None = None
    fused_backward_pass: bool = False
    fused_optimizer_groups: int | None = None
    max_grad_norm: float = 0.0  # fused steps clip each parameter on its own (sd-scripts)
    no_token_padding: bool = False  # train_db.py: captions padded to the batch's longest caption, not to 77
    blockwise_fused_optimizers: bool = False  # one fused step per transformer block (+ the rest)
    block_swap: bool = False  # --blocks_to_swap: the swapped blocks' trained weights live on the host

    def resume_settings(self) -> dict[str, Any]:
        return {}  # the whole model's shapes are checked when the state loads

    def with_text_cached(self) -> None:
        return None  # what trains in the text encoders was asked for

    def deepspeed_plugin(self, cfg: Any) -> Any:
        """accelerate's DeepSpeed plugin for ``--deepspeed`` (None without it); ``cfg``: the run's TrainConfig."""
        if self.deepspeed is None:
            return None
        run = cfg.run
        return self.deepspeed.plugin(
            cfg.data.train_batch_size, run.mixed_precision, cfg.optim.max_grad_norm, run.full_fp16
        )

    def check_plan(self, plan: Any) -> list[str]:
        return []

    @property
    def text_encoder_lrs(self) -> tuple[float | None, ...] | None:
        """Per text encoder its learning rate (None: ``--learning_rate``; 0: frozen), or None: none trains."""
        return self.rules.text_encoder_lrs

    @property
    def train_unet(self) -> bool:
        return self.rules.train_denoiser

    @property
    def trains_text_encoder(self) -> bool:
        return self.text_encoder_lrs is not None and any(lr != 0 for lr in self.text_encoder_lrs)

    @property
    def trained_parts(self) -> tuple[str, ...]:
        """The parts whose weights are trained: loaded in the training dtype, never stored in float8."""
        parts = (("denoiser", self.train_unet), ("text_encoders", self.trains_text_encoder))
        return tuple(name for name, trained in parts if trained)

    @classmethod
    def reader(
        cls, family: ModelFamily, training: str = "fine_tune"
    ) -> Callable[[argparse.Namespace], ModelTrainingConfig]:
        """The reader of :func:`add_model_training_args`' flags for ``family``'s script; ``training`` "dreambooth":
        the text encoders train unless ``--stop_text_encoder_training -1`` (train_db.py), else on
        ``--train_text_encoder``."""
        return functools.partial(cls.from_args, family=family, dreambooth=training == "dreambooth")

    @classmethod
    def from_args(cls, args: argparse.Namespace, family: ModelFamily, dreambooth: bool = False) -> ModelTrainingConfig:
        """The recipe's flags (absent ones keep their defaults) and the family's rules, every problem at once."""
        problems = []
        stop = getattr(args, "stop_text_encoder_training", None)
        train_te = (stop is None or stop >= 0) if dreambooth else bool(getattr(args, "train_text_encoder", False))
        rules = None
        try:
            rules = family.full_training.read(args, train_te)
        except ConfigError as e:
            problems += e.problems
        groups = getattr(args, "fused_optimizer_groups", None)
        blockwise = bool(getattr(args, "blockwise_fused_optimizers", False))
        problems += _fused_problems(args, groups, blockwise)
        if train_te and stop is not None and stop > 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            problems.append("--stop_text_encoder_training with several processes is not supported yet (DDP needs "
                            "the same trained parameters at every step); use one process or -1")  # fmt: skip
        no_padding = bool(getattr(args, "no_token_padding", False))
        problems += _no_padding_problems(args) if no_padding else []
        deepspeed = DeepSpeedConfig.from_args(args, problems)
        problems += launch_problems()
        if problems:
            raise ConfigError(problems)
        return cls(rules, stop, deepspeed, args.fused_backward_pass, groups, args.max_grad_norm, no_padding, blockwise,
                   bool(getattr(args, "blocks_to_swap", None)))  # fmt: skip


def _no_padding_problems(args: argparse.Namespace) -> list[str]:
    """--no_token_padding's unsupported pairs (both lay captions out in 75-token chunks)."""
    others = [
        ("--max_token_length", args.max_token_length, "unpadded captions are one sequence of at most 75 tokens"),
        ("--weighted_captions", args.weighted_captions, "the weighted encoder pads to 75-token chunks"),
    ]
    return [
        f"--no_token_padding with {flag} is not supported yet ({why}); drop one of the two"
        for flag, value, why in others
        if value
    ]


def _fused_problems(args: argparse.Namespace, groups: int | None, blockwise: bool = False) -> list[str]:
    if not (args.fused_backward_pass or groups or blockwise):
        return []
    problems = []
    if groups is not None and groups < 1:
        problems.append(f"--fused_optimizer_groups must be >= 1, got {groups}")
    given = [f for f, v in (("--fused_backward_pass", args.fused_backward_pass), ("--fused_optimizer_groups", groups),
                            ("--blockwise_fused_optimizers", blockwise)) if v]  # fmt: skip
    if len(given) > 1:
        problems.append(f"choose one of {' and '.join(given)}")
    for flag, value in (("--fused_optimizer_groups", groups), ("--blockwise_fused_optimizers", blockwise)):
        if value and args.gradient_accumulation_steps != 1:
            problems.append(f"{flag} does not work with --gradient_accumulation_steps > 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or getattr(args, "deepspeed", False):
        problems.append("fused optimizer steps with several processes or DeepSpeed are not supported yet (they would "
                        "step before DDP averages the gradients); drop --fused_backward_pass / --fused_optimizer_groups"
                        " / --blockwise_fused_optimizers")  # fmt: skip
    if args.mixed_precision == "fp16":
        problems.append("fused optimizer steps with --mixed_precision fp16 are not supported yet (the loss scaler "
                        "unscales after backward); use bf16")  # fmt: skip
    return problems


# ---------------------------------------------------------------------------------------------------------- trainable
class ModelTrainable(nn.Module):
    """The UNet (+ the trained text encoders) of ``parts``; a :class:`library.run.trainable.Trainable`.

    Calling it calls the UNet (the loop gives the prepared object to ``family.predict`` in place of the UNet, so a
    DDP / FSDP wrapper sees the forward pass). ``steps_done`` (a buffer, saved with the state) drives
    ``--stop_text_encoder_training`` so a resumed run stops it at the same step.
    """

    kind = "model"
    modelspec_kind = ""
    gradient_sync = "accelerate"
    sparse_gradients = False  # every trained tensor gets a gradient each step

    def __init__(
        self,
        family: ModelFamily,
        parts: Parts,
        cfg: ModelTrainingConfig,
        save_model_as: str | None = None,
    ):
        super().__init__()
        self.family, self.parts, self.cfg = family, parts, cfg
        self.wrapped: Any = None  # what accelerate's prepare gave back (DDP / FSDP / DeepSpeed), called by the step
        self.text_encoders_stopped = False  # --stop_text_encoder_training reached
        self.save_model_as = save_model_as  # "diffusers": a folder of .bin weights (sd-scripts); else by the suffix
        self.unet = parts.denoiser
        lrs = cfg.text_encoder_lrs or ()
        self.te_indices = [i for i, lr in enumerate(lrs) if lr != 0 and i < len(parts.text_encoders)]
        self.text_encoders = nn.ModuleList([parts.text_encoders[i] for i in self.te_indices])
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
        self.unet.requires_grad_(cfg.train_unet)
        for te in self.text_encoders:
            te.requires_grad_(True)
        self.fused: FusedStep | None = None  # --fused_backward_pass / --fused_optimizer_groups hooks
        cfg.rules.freeze(self.unet)  # the family's frozen parameters (blocks at lr 0, the last N ...)
        self._apply_text_encoder_stop()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.unet(*args, **kwargs)

    @property
    def config(self) -> Any:
        """The denoiser's config: a family's ``predict`` reads it from the model it is given (FLUX: whether guidance
        is embedded), and the loop gives it this module (or accelerate's wrapper of it) in place of the denoiser."""
        return self.unet.config

    # ------------------------------------------------------------------------------------------ optimizer groups
    def param_groups(self, lr: float) -> list[dict]:
        """The denoiser's group(s) (the family's rules may split it, e.g. one per ``--block_lr`` block; none when the
        denoiser is not trained) then one group per trained text encoder."""
        groups = self.cfg.rules.denoiser_groups(self.unet, lr)
        if groups is None:
            unet = [p for p in self.unet.parameters() if p.requires_grad]
            groups = [{"params": unet, "lr": lr, "name": "unet"}] if unet else []
        lrs = self.cfg.text_encoder_lrs or ()
        for i, te in zip(self.te_indices, self.text_encoders):
            name = "textencoder" if len(self.parts.text_encoders) == 1 else f"textencoder{i + 1}"
            groups.append({"params": list(te.parameters()), "lr": lrs[i] if lrs[i] is not None else lr, "name": name})
        return groups

    # ------------------------------------------------------------------------------------------ the Trainable seam
    def step_models(self, models: Any) -> Any:
        """The step's inputs with the prepared (wrapped) model as the denoiser, and the text encoders without
        autograd once --stop_text_encoder_training is reached."""
        changes: dict[str, Any] = {}
        if self.wrapped is not None:
            changes["denoiser"] = self.wrapped
        if self.text_encoders_stopped:
            changes["train_text_encoder"] = False
        return dataclasses.replace(models, **changes) if changes else models

    def set_training(self, mode: bool) -> None:
        self.unet.train(mode)
        for te in self.text_encoders:
            te.train(mode and next(te.parameters()).requires_grad)

    def after_step(self) -> dict[str, float]:
        if self.fused is not None:
            self.fused.reset()
        self.steps_done += 1
        self._apply_text_encoder_stop()
        return {}

    def _apply_text_encoder_stop(self) -> None:
        stop = self.cfg.stop_text_encoder_training
        if stop is None or stop < 0 or int(self.steps_done) < stop or not self.text_encoders:
            return
        if next(self.text_encoders.parameters()).requires_grad:
            logger.info("stop text encoder training at step %d", int(self.steps_done))
        for te in self.text_encoders:
            te.requires_grad_(False).train(False)
            for p in te.parameters():
                p.grad = None
        self.text_encoders_stopped = True

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._apply_text_encoder_stop()
        return out

    def prepare(self, accelerator: Any) -> ModelTrainable:
        """Itself: accelerate gets the model together with its optimizer (:meth:`prepare_with_optimizer`), as
        DeepSpeed and FSDP require; the trainer keeps talking to this unwrapped object."""
        return self

    def prepare_with_optimizer(self, accelerator: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        """Model, optimizer and scheduler prepared in one call (DeepSpeed and FSDP need them together); the loop
        then calls the prepared model in place of the UNet (:meth:`step_models`)."""
        # --blocks_to_swap: the swapped blocks' weights stay on the host (place_denoiser put the model where it goes)
        placement = [False if self.cfg.block_swap else None, None, None]  # None: accelerate's default
        wrapped, optimizer, scheduler = accelerator.prepare(self, optimizer, scheduler, device_placement=placement)
        self.__dict__["wrapped"] = wrapped  # not a submodule: in one process it is this very module
        cfg = self.cfg
        if cfg.fused_backward_pass or cfg.fused_optimizer_groups or cfg.blockwise_fused_optimizers:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if cfg.blockwise_fused_optimizers:
                chunks = block_chunks(params, [bl.blocks for bl in self.family.swap_blocks(self.unet)])
            else:
                chunks = chunk_parameters(params, cfg.fused_optimizer_groups)
            self.fused = FusedStep(optimizer, chunks, cfg.max_grad_norm)
        return optimizer, scheduler

    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> None:
        """None: a whole-model file carries no ``sshs_*`` hashes (sd-scripts writes none for fine-tunes; A1111 hashes
        checkpoints from the file itself). Computing them would serialise the whole model once more in host memory
        (22 GiB for FLUX.1)."""
        return None

    def metadata(self) -> dict[str, str]:
        return {"ss_train_text_encoder": str(bool(self.text_encoders))}

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        """The whole model (single file or diffusers folder, by the path's suffix), atomically, as the family's rules
        write it."""
        meta = {k: v for k, v in (metadata or {}).items() if isinstance(v, str)}
        safetensors = self.save_model_as != "diffusers"  # a diffusers folder's weights; single files: the suffix
        self.cfg.rules.save(self.family, self.parts, Path(path), dtype=dtype, metadata=meta, safetensors=safetensors)
