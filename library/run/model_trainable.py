"""The whole model as a Trainable: full fine-tuning and DreamBooth (fine_tune.py, sdxl_train.py, train_db.py).

The UNet is trained (sdxl_train.py: unless ``--learning_rate 0``, sd-scripts' "train the text encoders only"); the
text encoders too with ``--train_text_encoder`` (fine_tune.py / sdxl_train.py) or by default in train_db.py
(``--stop_text_encoder_training -1`` there means never). Each trained part has its own learning rate
(``--learning_rate_te``, SDXL ``--learning_rate_te1`` / ``--learning_rate_te2``, else ``--learning_rate``; 0 = keep
that encoder frozen), and ``--block_lr`` gives each of the UNet's blocks its own (sd-scripts' order: time/label
embeddings, ``input_blocks.*``, ``middle_block.*``, ``output_blocks.*``, ``out``; 0 = freeze the block).

The trainable is handed to ``accelerate.prepare`` (``gradient_sync == "accelerate"``): the loop calls the prepared
object in place of the UNet, so DDP / FSDP / DeepSpeed come from the user's accelerate config. Files are the whole
model, written by the family (single file with ModelSpec and the v-pred / ztsnr markers, or a diffusers folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from library.cli.problems import ConfigError
from library.families.base import ModelFamily, Parts
from library.families.sd.unet_keys import block_map, diffusers_to_ldm
from library.files.weights import streamed_saves
from library.optim.fused import FusedStep, block_chunks, chunk_parameters
from library.run.block_swap import requested_blocks_to_swap
from library.run.engines import DeepSpeedConfig, launch_problems

logger = logging.getLogger("sdtrain")
DIT_SCRIPTS = ("flux_train", "sd3_train")  # full fine-tunes of transformer families (block swap, blockwise steps)


# ---------------------------------------------------------------------------------------------------------- flags
def add_model_training_args(parser: argparse.ArgumentParser, *, script: str) -> None:
    """sd-scripts' full-training flags of ``script`` ("fine_tune", "sdxl_train", "train_db", or a transformer
    family's :data:`DIT_SCRIPTS`: "flux_train", "sd3_train")."""
    g = parser.add_argument_group("full model training")
    if script in ("fine_tune", "sdxl_train"):
        g.add_argument("--train_text_encoder", action="store_true", help="also train the text encoder(s)")
        g.add_argument("--diffusers_xformers", action="store_true", help="xformers attention (same as --xformers)")
    if script in ("fine_tune", "train_db"):
        g.add_argument("--learning_rate_te", type=float, default=None, help="text-encoder lr (default --learning_rate)")
    if script in DIT_SCRIPTS:  # sd-scripts' flux_train.py / sd3_train.py
        g.add_argument("--fused_optimizer_groups", type=int, default=None, help="step the optimizer in N parameter "
                       "groups during backward (less gradient memory)")  # fmt: skip
        g.add_argument("--blockwise_fused_optimizers", action="store_true", help="step the optimizer for each "
                       "transformer block (and once for the other weights) as soon as its gradients are ready")  # fmt: skip
        g.add_argument("--skip_latents_validity_check", action="store_true", dest="skip_cache_check",
                       help="[deprecated] same as --skip_cache_check (sd-scripts' older name)")  # fmt: skip
    if script == "flux_train":  # the transformer alone is trained
        g.add_argument("--mem_eff_save", action="store_true", help="write the model file tensor by tensor, without a "
                       "second copy of the model in memory")  # fmt: skip
        g.add_argument("--double_blocks_to_swap", type=int, default=None, help="[deprecated] use --blocks_to_swap "
                       "(--blocks_to_swap = this + --single_blocks_to_swap // 2)")  # fmt: skip
        g.add_argument("--single_blocks_to_swap", type=int, default=None, help="[deprecated] use --blocks_to_swap")
    if script == "sdxl_train":
        g.add_argument("--learning_rate_te1", type=float, default=None, help="text encoder 1 lr; 0 = do not train it")
        g.add_argument("--learning_rate_te2", type=float, default=None, help="text encoder 2 lr; 0 = do not train it")
        g.add_argument("--block_lr", type=str, default=None, help="23 comma-separated UNet block lrs (0 = freeze)")
        g.add_argument("--fused_optimizer_groups", type=int, default=None, help="step the optimizer in N parameter "
                       "groups during backward (less gradient memory)")  # fmt: skip
    if script == "train_db":
        g.add_argument(
            "--stop_text_encoder_training", type=int, default=None, help="step at which the text encoder stops "
            "training (-1: never train it)",
        )  # fmt: skip
        g.add_argument("--no_token_padding", action="store_true", help="pad captions only to the batch's longest, "
                       "not to 77 tokens (diffusers' DreamBooth)")  # fmt: skip
    g.add_argument("--use_safetensors", action="store_true", help="save in safetensors (with --save_model_as ckpt: "
                   "a .safetensors file; diffusers: safetensors weights), as sd-scripts")  # fmt: skip


@dataclass(frozen=True)
class ModelTrainingConfig:
    """What of the model is trained, and at which learning rates (``None``: --learning_rate)."""

    text_encoder_lrs: tuple[float | None, ...] | None  # per text encoder; None = the encoders are not trained
    stop_text_encoder_training: int | None = None
    block_lr: tuple[float, ...] | None = None
    deepspeed: DeepSpeedConfig | None = None
    fused_backward_pass: bool = False
    fused_optimizer_groups: int | None = None
    max_grad_norm: float = 0.0  # fused steps clip each parameter on its own (sd-scripts)
    no_token_padding: bool = False  # train_db.py: captions padded to the batch's longest caption, not to 77
    train_unet: bool = True  # sdxl_train.py --learning_rate 0: False (only the text encoders train)
    blockwise_fused_optimizers: bool = False  # flux_train.py: one fused step per transformer block (+ the rest)
    mem_eff_save: bool = False  # flux_train.py: files written tensor by tensor (library/files/weights.py)
    block_swap: bool = False  # --blocks_to_swap: the swapped blocks' trained weights live on the host

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
    def trains_text_encoder(self) -> bool:
        return self.text_encoder_lrs is not None and any(lr != 0 for lr in self.text_encoder_lrs)

    @property
    def trained_parts(self) -> tuple[str, ...]:
        """The parts whose weights are trained: loaded in the training dtype, never stored in float8."""
        parts = (("denoiser", self.train_unet), ("text_encoders", self.trains_text_encoder))
        return tuple(name for name, trained in parts if trained)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelTrainingConfig:
        problems = []
        stop = getattr(args, "stop_text_encoder_training", None)
        if hasattr(args, "stop_text_encoder_training"):  # train_db.py trains the text encoder unless told -1
            train_te = stop is None or stop >= 0
        else:
            train_te = bool(getattr(args, "train_text_encoder", False))  # flux_train.py: never
        train_unet = True
        if hasattr(args, "learning_rate_te1"):  # sdxl_train.py: a part whose lr is 0 is left out of training
            lrs: tuple[float | None, ...] = tuple(
                args.learning_rate if lr is None else lr for lr in (args.learning_rate_te1, args.learning_rate_te2)
            )
            train_unet = args.learning_rate != 0
            if not train_unet and not (train_te and any(lrs)):
                problems.append("--learning_rate 0 leaves the UNet out of training and no text encoder is trained, "
                                "so this run trains nothing; add --train_text_encoder (with a non-zero "
                                "--learning_rate_te1 / --learning_rate_te2) to train the text encoders only")  # fmt: skip
            elif not train_unet and getattr(args, "block_lr", None):
                logger.warning("--block_lr is ignored: --learning_rate 0 leaves the UNet out of training")
        else:
            lrs = (getattr(args, "learning_rate_te", None),)
        if any(lr is not None and lr < 0 for lr in lrs):
            problems.append(f"text-encoder learning rates must be >= 0, got {[lr for lr in lrs if lr is not None]}")
        if train_te and args.cache_text_encoder_outputs:
            problems.append(
                "--cache_text_encoder_outputs cannot be used while training the text encoder "
                "(drop --train_text_encoder, or set --stop_text_encoder_training -1 in train_db.py)"
            )
        groups = getattr(args, "fused_optimizer_groups", None)
        blockwise = bool(getattr(args, "blockwise_fused_optimizers", False))
        problems += _fused_problems(args, groups, blockwise)
        if train_te and stop is not None and stop > 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            problems.append("--stop_text_encoder_training with several processes is not supported yet (DDP needs "
                            "the same trained parameters at every step); use one process or -1")  # fmt: skip
        no_padding = bool(getattr(args, "no_token_padding", False))
        problems += _no_padding_problems(args) if no_padding else []
        block_lr = _block_lrs(getattr(args, "block_lr", None), problems)
        deepspeed = DeepSpeedConfig.from_args(args, problems)
        problems += launch_problems()
        swaps = bool(requested_blocks_to_swap(args))
        if problems:
            raise ConfigError(problems)
        return cls(
            lrs if train_te else None, stop, block_lr, deepspeed, args.fused_backward_pass, groups, args.max_grad_norm,
            no_padding, train_unet, blockwise, bool(getattr(args, "mem_eff_save", False)), swaps,
        )  # fmt: skip


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


def _block_lrs(text: str | None, problems: list[str]) -> tuple[float, ...] | None:
    if not text:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        problems.append(f"--block_lr {text!r}: expected comma-separated numbers")
        return None
    if any(v < 0 for v in values):
        problems.append(f"--block_lr {text!r}: learning rates must be >= 0")
    return values


# ---------------------------------------------------------------------------------------------------------- blocks
def lr_block_count(config: Any) -> int:
    """Number of ``--block_lr`` blocks of a UNet: embeddings, input blocks, 3 middle, output blocks, out (SDXL: 23)."""
    names = {v.split(".")[0] + "." + v.split(".")[1] for v, _ in block_map(config).values() if "_blocks." in v}
    n_in = len({n for n in names if n.startswith("input_blocks.")})
    n_out = len({n for n in names if n.startswith("output_blocks.")})
    return 1 + n_in + 3 + n_out + 1


def lr_block_index(ldm_name: str, config: Any) -> int:
    """sd-scripts' block index of a UNet parameter, from its original (ldm/sgm) name."""
    n = lr_block_count(config)
    n_in = (n - 5) // 2
    head, _, rest = ldm_name.partition(".")
    if head in ("time_embed", "label_emb"):
        return 0
    if head == "input_blocks":
        return 1 + int(rest.split(".")[0])
    if head == "middle_block":
        return 1 + n_in + int(rest.split(".")[0])
    if head == "output_blocks":
        return 1 + n_in + 3 + int(rest.split(".")[0])
    if head == "out":
        return n - 1
    raise ValueError(f"UNet parameter {ldm_name!r} belongs to no --block_lr block")


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
        if cfg.block_lr is not None and cfg.train_unet:
            expected = lr_block_count(self.unet.config)
            if len(cfg.block_lr) != expected:
                raise ConfigError([f"--block_lr has {len(cfg.block_lr)} values; this UNet has {expected} blocks"])
            for name, p in self.unet.named_parameters():
                if cfg.block_lr[lr_block_index(diffusers_to_ldm(name, self.unet.config), self.unet.config)] == 0:
                    p.requires_grad_(False)
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
        """UNet group(s) (one per ``--block_lr`` block when given; none when the UNet is not trained) then one
        group per trained text encoder."""
        groups = []
        if self.cfg.block_lr is None:
            unet = [p for p in self.unet.parameters() if p.requires_grad]
            groups += [{"params": unet, "lr": lr, "name": "unet"}] if unet else []
        else:
            blocks: dict[int, list[nn.Parameter]] = {}
            for name, p in self.unet.named_parameters():
                if p.requires_grad:
                    i = lr_block_index(diffusers_to_ldm(name, self.unet.config), self.unet.config)
                    blocks.setdefault(i, []).append(p)
            for i, params in sorted(blocks.items()):
                groups.append({"params": params, "lr": self.cfg.block_lr[i], "name": f"unet_block{i:02d}"})
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
        """The whole model (single file or diffusers folder, by the path's suffix), atomically, by the family."""
        meta = {k: v for k, v in (metadata or {}).items() if isinstance(v, str)}
        safetensors = self.save_model_as != "diffusers"  # a diffusers folder's weights; single files: the suffix
        with streamed_saves(self.cfg.mem_eff_save):  # --mem_eff_save: .safetensors written tensor by tensor
            self.family.save(self.parts, path, dtype=dtype, metadata=meta, safetensors=safetensors)
