"""Fine-tune a whole SD3 medium / SD3.5 medium / large model: fine_tune.py's recipe with the SD3 families.

    accelerate launch --mixed_precision bf16 sd3_train.py --pretrained_model_name_or_path sd3_medium.safetensors \
        --dataset_config dataset.toml --output_dir output --output_name sd3_finetuned --train_text_encoder \
        --learning_rate 4e-6 --blocks_to_swap 10

sd-scripts' sd3_train.py flags with the same meaning: fine_tune.py's, SD3's flow-matching objective
(library/flow_matching.py ``add_sd3_flow_args``), the SD3 model flags (library/families/sd3/options.py), block
swapping (``--blocks_to_swap``: library/run/block_swap.py), the steps in backward (``--fused_backward_pass``: Adafactor,
one parameter at a time; ``--blockwise_fused_optimizers``: one step per joint block; ``--fused_optimizer_groups``:
library/optim/fused.py) and sd3_train.py's own (library/families/sd3/full_training.py): ``--train_text_encoder``
(CLIP-L and CLIP-G), ``--train_t5xxl``, ``--learning_rate_te1 / te2 / te3`` (0 = that encoder is not trained),
``--use_t5xxl_cache_only`` (the T5 outputs come from the cache while CLIP-L / CLIP-G train),
``--num_last_block_to_freeze`` (the last N ``x_block`` parameters, counted as sd-scripts counts them). The output is
what sd-scripts writes: an SAI single file with the transformer and the VAE, and each trained text encoder next to
it (``<name>_clip_l.safetensors`` ...); with ``--save_model_as diffusers`` a diffusers folder of everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fine_tune
from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.cli.problems import ConfigError
from library.families.sd3 import full_training
from library.families.sd3.options import FAMILY_NAMES, SD3Options, add_sd3_model_args
from library.flow_matching import add_sd3_flow_args
from library.run import train_setup
from library.run.model_trainable import ModelTrainable, ModelTrainingConfig
from library.run.trainer import Result

FAMILIES = FAMILY_NAMES
FORMATS = ("safetensors", "diffusers", "diffusers_safetensors")  # sd-scripts' ckpt: refused (SD3 has no pickle)


def build_parser() -> argparse.ArgumentParser:
    """fine_tune.py's flags for sd3_train.py (block swapping read), plus the SD3 flow-matching, model and full
    fine-tuning groups."""
    parser = fine_tune.build_parser("sd3_train", __doc__, block_swap=True)
    add_sd3_flow_args(parser)
    add_sd3_model_args(parser)
    return full_training.add_sd3_full_training_args(parser)


@dataclass(frozen=True)
class SD3TrainingConfig(ModelTrainingConfig):
    """:class:`ModelTrainingConfig` with sd3_train.py's ``--num_last_block_to_freeze``."""

    num_last_block_to_freeze: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SD3TrainingConfig:
        """The shared reader (fused steps, DeepSpeed, launch) on the flags it knows, then SD3's text-encoder rules
        (``full_training``): text-encoder lrs (CLIP-L, CLIP-G, T5), ``--learning_rate 0`` = transformer frozen."""
        problems = full_training.problems(args)
        shared = argparse.Namespace(**vars(args))
        shared.train_text_encoder = False  # the SD3 reader decides the encoders (and their cache) below
        shared.cache_text_encoder_outputs = False
        for name in ("learning_rate_te1", "learning_rate_te2"):  # (their presence means sdxl_train.py's rules there)
            delattr(shared, name)
        try:
            base = ModelTrainingConfig.from_args(shared)
        except ConfigError as e:
            base, problems = None, [*problems, *e.problems]
        lrs = full_training.text_encoder_lrs(args)
        train_unet = args.learning_rate != 0
        if not train_unet and not (lrs and any(lrs)):
            problems.append("--learning_rate 0 leaves the transformer out of training and no text encoder is "
                            "trained, so this run trains nothing; add --train_text_encoder (with a non-zero "
                            "--learning_rate_te1 / --learning_rate_te2) to train the text encoders only")  # fmt: skip
        if problems:
            raise ConfigError(problems)
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(ModelTrainingConfig)}
        fields.update(text_encoder_lrs=lrs, train_unet=train_unet)
        return cls(**fields, num_last_block_to_freeze=args.num_last_block_to_freeze)


class SD3ModelTrainable(ModelTrainable):
    """The transformer (+ the trained encoders); ``--num_last_block_to_freeze`` applied; files as sd-scripts'
    sd3_train.py writes them (module docstring of library/families/sd3/full_training.py)."""

    def __init__(self, family: Any, parts: Any, cfg: SD3TrainingConfig, save_model_as: str | None = None):
        super().__init__(family, parts, cfg, save_model_as)
        if cfg.train_unet:
            full_training.freeze_last_x_block_parameters(self.unet, cfg.num_last_block_to_freeze)

    def save(self, path: str | Path, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        """A ``.safetensors`` path: the SAI file (transformer + VAE) and the trained encoders' files next to it
        (``<stem>_clip_l.safetensors`` ...), each atomic; a folder: the whole pipeline (:meth:`ModelTrainable.save`)."""
        from library.families.sd3.saving import text_encoder_state
        from library.files.weights import save_state_dict, streamed_saves

        path = Path(path)
        if path.suffix.lower() != ".safetensors":
            return super().save(path, metadata, dtype)
        meta = {k: v for k, v in (metadata or {}).items() if isinstance(v, str)}
        with streamed_saves(self.cfg.mem_eff_save):
            self.family.save(self.parts, path, dtype=dtype, metadata=meta, text_encoders=False)
            for name in full_training.sidecar_names(self.cfg.text_encoder_lrs):
                te = self.parts.text_encoders[full_training.TEXT_ENCODER_NAMES.index(name)]
                save_state_dict(text_encoder_state(te), path.with_name(f"{path.stem}_{name}.safetensors"), {}, dtype)
        return None


def read_config(argv: Sequence[str] | None) -> train_setup.TrainConfig | None:
    """The typed configuration the run uses, every problem reported at once; None after --output_config."""
    args = parse_args(build_parser(), argv)  # --config_file merged
    if args is None:  # --output_config wrote the file
        return None
    full_training.imply_text_cache(args)  # --use_t5xxl_cache_only: before the dataset flags are read
    args.save_model_as = fine_tune.output_format(args)
    return train_setup.read_config(args, FAMILIES, SD3TrainingConfig.from_args, FORMATS, training="fine_tune",
                                   model_options=SD3Options.from_args)  # fmt: skip


def run(argv: Sequence[str] | None = None) -> Result | None:
    """Train the whole model (fine_tune.py's run with :class:`SD3ModelTrainable`)."""
    from library.run.loop import train

    cfg = read_config(argv)
    if cfg is None:
        return None
    run = train_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    model = SD3ModelTrainable(run.family, run.parts, cfg.method, cfg.save.save_model_as)
    if run.block_swap is None:  # (--blocks_to_swap: place_for_training put each weight where it lives)
        model.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    return train(run, model, model.param_groups(cfg.optim.learning_rate))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
