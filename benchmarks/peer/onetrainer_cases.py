"""bench_vs_sdscripts.py's cases for the families whose reference trainer is Nerogar/OneTrainer (PixArt-α / Σ:
sd-scripts and musubi-tuner have no PixArt trainer).

OneTrainer reads no command line of flags: ``scripts/train.py --config-path FILE`` takes a JSON training config (its
``TrainConfig``), which names a concepts file (the image folders) and a sample-prompt file. Each run here writes the
three into its own folder (:func:`write_config`), with the run's own cache and workspace folders, so nothing is shared
between runs or written into the dataset. Both sides train the same tiny diffusers pipeline folder (the family's
``tiny.write_folder``, built by tiny_families.py under ``ASSETS/models/<folder>``) on the same 8 images at 64 px,
batch 1, float32, AdamW lr 1e-4 (constant, no warm-up), gradient clipping at norm 1, a LoRA of dim 4 alpha 2 on every
Linear of the transformer blocks, cached latents and T5 outputs, no gradient checkpointing, no loader workers:

- OneTrainer: ``training_method LORA``, ``layer_filter transformer_block`` (its ``blocks`` preset), output format
  ``KOHYA_LORA`` (which fuses ``attn1.to_q | to_k | to_v`` into ``attn.qkv`` and ``attn2.to_k | to_v`` into
  ``cross_attn.kv_linear``, as ours does), its default hybrid loss (ε MSE + the variational bound at strength 1), T5
  padded to 120 tokens for α and Σ alike (its PixArt data loader's constant). One epoch whose concept is balanced to
  ``steps`` samples (``balancing_strategy SAMPLES``) is ``steps`` optimizer steps.
- Ours: ``pixart_train_network.py`` with ``--network_module networks.lora``, the same numbers, ``--vb_loss_strength``
  at its default 1 and ``--t5xxl_max_token_length 120`` (our Σ default is the release's 300).

Both write ``lora_unet_blocks_*`` files with the same key+shape set (bench_vs_sdscripts.py compares them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dit_cases import COMMON  # beside this file: dim 4, alpha 2, seed 1, cached, the denoiser only

OURS = ["--network_module", "networks.lora", *COMMON, "--t5xxl_max_token_length", "120"]


@dataclass(frozen=True)
class OneTrainerCase:
    script: str  # ours, at the checkout root
    folder: str  # under ASSETS/models: the family's tiny pipeline folder (tiny_families.py)
    family: str  # tiny_families.py's builder
    model_type: str  # OneTrainer's ModelType


ONETRAINER_CASES = {
    "pixart_sigma": OneTrainerCase("pixart_train_network.py", "tiny-pixart_sigma", "pixart_sigma", "PIXART_SIGMA"),
    "pixart_alpha": OneTrainerCase("pixart_train_network.py", "tiny-pixart_alpha", "pixart_alpha", "PIXART_ALPHA"),
}
# OneTrainer's entry script, relative to its checkout (the run's cwd)
TRAIN = "scripts/train.py"


def training_config(case: str, model: Path, images: Path, steps: int, rdir: Path) -> dict:
    """The run's OneTrainer ``TrainConfig`` (the keys that differ from its defaults; see the module docstring)."""
    c = ONETRAINER_CASES[case]
    part = {"weight_dtype": "FLOAT_32", "gradient_checkpointing": False}
    return {
        "__version": 11, "training_method": "LORA", "model_type": c.model_type, "base_model_name": str(model),
        "workspace_dir": str(rdir / "workspace"), "cache_dir": str(rdir / "cache"), "tensorboard": False,
        "output_model_format": "KOHYA_LORA", "output_model_destination": str(rdir / "out" / "lora.safetensors"),
        "output_dtype": "FLOAT_32", "concept_file_name": str(rdir / "concepts.json"),
        "sample_definition_file_name": str(rdir / "samples.json"), "resolution": "64", "epochs": 1, "batch_size": 1,
        "learning_rate": 1e-4, "learning_rate_warmup_steps": 0, "learning_rate_scheduler": "CONSTANT",
        "clip_grad_norm": 1.0, "train_device": "cpu", "temp_device": "cpu", "train_dtype": "FLOAT_32",
        "fallback_train_dtype": "FLOAT_32", "dataloader_threads": 1, "lora_rank": 4, "lora_alpha": 2.0,
        "layer_filter_preset": "blocks", "layer_filter": "transformer_block", "vb_loss_strength": 1.0,
        "transformer": dict(part, train=True), "text_encoder": dict(part, train=False), "vae": dict(part),
        "sample_after": 100000, "sample_after_unit": "EPOCH", "backup_after": 100000, "backup_after_unit": "EPOCH",
        "backup_before_save": False, "optimizer": {"optimizer": "ADAMW"},
    }  # fmt: skip


def write_config(case: str, models: Path, images: Path, steps: int, rdir: Path) -> Path:
    """Write the run's training config, concepts file (``images``: one concept of ``steps`` samples, captions from
    the ``.txt`` beside each image, no crop jitter) and empty sample-prompt list; returns the config's path."""
    rdir.mkdir(parents=True, exist_ok=True)
    concept = {"name": "sks", "path": str(images), "seed": 1, "balancing": steps, "balancing_strategy": "SAMPLES",
               "text": {"prompt_source": "sample"}, "image": {"enable_crop_jitter": False}}  # fmt: skip
    (rdir / "concepts.json").write_text(json.dumps([concept], indent=1))
    (rdir / "samples.json").write_text("[]")
    path = rdir / "onetrainer_config.json"
    model = models / ONETRAINER_CASES[case].folder
    path.write_text(json.dumps(training_config(case, model, images, steps, rdir), indent=1))
    return path


def our_flags(case: str, models: Path) -> list[str]:
    """Our side's model and case flags (the shared ones come from the caller)."""
    return ["--pretrained_model_name_or_path", str(models / ONETRAINER_CASES[case].folder), *OURS]
