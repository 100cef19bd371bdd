"""Qwen-Image's own flags (musubi-tuner's ``qwen_image_train_network.py`` / ``qwen_image_setup_parser`` and the
musubi-tuner common flags that train_network.py has no name for) next to their one reader
:class:`QwenImageOptions` (``QwenImageFamily.options``).

Read: ``--dit`` (the DiT: another name of ``--pretrained_model_name_or_path``), ``--text_encoder`` (Qwen2.5-VL-7B: one
file, a split file's first part, or a folder), ``--model_version`` ``original`` (the default), ``edit``, ``edit-2509``,
``edit-2511`` (``--edit`` / ``--edit_plus``: the edit models, with the dataset's control images; ``layered`` is refused),
``--split_attn``
(attention per sample in musubi-tuner; SDPA with the text mask gives the same values), ``--vae_dtype`` (the VAE's
dtype), ``--dit_dtype`` (musubi-tuner fixes bfloat16; read as the DiT's storage dtype when given).
``--fp8_scaled`` is the shared flag (library/run/runtime.py, library/device/fp8.py: with ``--fp8_base`` as musubi-tuner).
``--fp8_vl``: Qwen2.5-VL's Linear weights stored in float8 (musubi-tuner's plain cast; ``qwen25vl.store_fp8``); ``--fp8_base``
stores the DiT only, as musubi-tuner (Qwen2.5-VL stays bfloat16 without ``--fp8_vl``).
Refused with a message: ``--num_layers``, ``--remove_first_image_from_target``, attention back ends other than SDPA, and the musubi-tuner
common flags with no counterpart here (:data:`MUSUBI_ONLY`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..musubi_flags import musubi_refused
from ..options import add_once, identity_of, mark_no_effect
from .objective import QwenFlowConfig, add_flow_args

log = logging.getLogger(__name__)

FAMILY_NAMES = ("qwen_image",)
MODEL_VERSIONS = ("original", "layered", "edit", "edit-2509", "edit-2511")
EDIT_VERSIONS = ("edit", "edit-2509", "edit-2511")
NOT_DONE_VERSIONS = {"layered": "the layered model's RGBA layers"}
SD_ONLY_FLAGS = {
    "--v2": "Qwen-Image is read from the weights",
    "--v_parameterization": "Qwen-Image is a flow-matching model",
    "--clip_skip": "Qwen-Image reads Qwen2.5-VL's last hidden state",
    "--max_token_length": "Qwen-Image takes up to 1024 caption tokens (musubi-tuner's fixed length)",
}
# musubi-tuner flags with no counterpart here: flag -> (argparse kwargs, why refused)
MUSUBI_ONLY: dict[str, tuple[dict, str]] = musubi_refused("Qwen-Image", {
    "--num_layers": ({"type": int, "default": None}, "a DiT with fewer blocks is read from its file's shapes; give the "
                     "pruned file instead"),
    "--remove_first_image_from_target": ({"action": "store_true"}, "the layered model is not supported yet"),
    "--guidance_scale": ({"type": float, "default": None}, "Qwen-Image has no guidance embedding"),
    "--mem_eff_save": ({"action": "store_true"}, "the saves here write tensor by tensor already; drop it"),
})  # fmt: skip


@dataclass(frozen=True)
class QwenImageOptions:
    """The Qwen-Image flags of a run or a load; ``flow``: the objective's settings (training only).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    text_encoder: str | None = None
    model_version: str = "original"
    split_attn: bool = False
    vae_dtype: str | None = None
    dit_dtype: str | None = None
    text_encoder_batch_size: int | None = None
    fp8_vl: bool = False
    flow: QwenFlowConfig | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        if training:
            add_flow_args(parser)
        g = parser.add_argument_group("Qwen-Image model", "Qwen-Image (musubi-tuner's qwen_image_* scripts)")
        if "--dit" not in parser._option_string_actions:
            g.add_argument("--dit", dest="pretrained_model_name_or_path", type=str, default=None,
                           help="the Qwen-Image DiT (a .safetensors file or a diffusers folder): musubi-tuner's "
                           "name of --pretrained_model_name_or_path")  # fmt: skip
        add_once(g, parser, "--text_encoder", type=str, default=None,
                 help="Qwen2.5-VL-7B: one .safetensors (ComfyUI's qwen_2.5_vl_7b, bf16 or fp8_scaled), the first part "
                 "of a split file, or a folder")  # fmt: skip
        add_once(g, parser, "--model_version", type=str, default=None,
                 help="original (default), edit, edit-2509, edit-2511 (the edit models take the dataset's "
                 "control_directory); layered is refused for now")  # fmt: skip
        add_once(g, parser, "--edit", action="store_true", help="musubi-tuner's --model_version edit")
        add_once(g, parser, "--edit_plus", action="store_true",
                 help="musubi-tuner's --model_version edit-2509")  # fmt: skip
        add_once(g, parser, "--split_attn", action="store_true",
                 help="musubi-tuner attends sample by sample; SDPA with the text mask gives the same values")  # fmt: skip
        add_once(g, parser, "--vae_dtype", type=str, default=None, help="the VAE's dtype (default bfloat16)")
        add_once(g, parser, "--dit_dtype", type=str, default=None, help="the DiT's storage dtype")
        add_once(g, parser, "--fp8_vl", action="store_true",
                 help="Qwen2.5-VL's Linear weights in float8 (musubi-tuner's plain cast), computed in bfloat16")  # fmt: skip
        if training:
            add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                     help="captions per Qwen2.5-VL call when caching (default: the training batch size)")  # fmt: skip
        for flag, (kwargs, reason) in MUSUBI_ONLY.items() if training else ():
            if flag not in parser._option_string_actions:
                add_unsupported(g, flag, reason, **kwargs)
        if training:
            mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> QwenImageOptions:
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("text_encoder",), folders=True)
        problems += positive_count_problems(args, ("text_encoder_batch_size",))
        version = getattr(args, "model_version", None)
        named = "--model_version"
        if version is None:
            for flag, value in (("edit_plus", "edit-2509"), ("edit", "edit")):
                if getattr(args, flag, False):
                    version, named = value, f"--{flag} (musubi-tuner's --model_version)"
                    break
            else:
                version = "original"
        version = version.lower()
        if version not in MODEL_VERSIONS:
            problems.append(f"--model_version {version}: unknown; one of {', '.join(MODEL_VERSIONS)}")
        elif version in NOT_DONE_VERSIONS:
            problems.append(f"{named} {version} is not supported yet ({NOT_DONE_VERSIONS[version]} are not done); "
                            "train the original Qwen-Image with --model_version original")  # fmt: skip
        for flag in ("vae_dtype", "dit_dtype"):
            value = getattr(args, flag, None)
            if value is not None and value not in ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16"):
                problems.append(f"--{flag} {value}: one of float32, float16, bfloat16")
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for Qwen-Image: A1111-style weights are for CLIP "
                            "prompts; drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = QwenFlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        if getattr(args, "split_attn", False):
            log.info("--split_attn: PyTorch SDPA attends the whole batch with the text mask; the values are the same")
        return from_namespace(cls, args, flow=flow, model_version=version)

    @property
    def takes_control_images(self) -> bool:
        """The edit models read the dataset's control_directory (their latents reach ``predict`` as references)."""
        return self.model_version in EDIT_VERSIONS

    @property
    def prompt_control_images(self) -> bool:
        """The edit models' prompts are encoded with their control images (text cache keyed on them too)."""
        return self.model_version in EDIT_VERSIONS

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name not in FAMILY_NAMES:
            return [f"--dit {path}: a {spec.title} model; the Qwen-Image scripts train Qwen-Image"]
        return []

    def metadata(self) -> dict[str, Any]:
        return {"ss_model_version": self.model_version}

    def prompt_identity(self) -> str:
        return identity_of((("model_version", self.model_version),))


def musubi_argv(argv: Any, network: bool = True) -> list[str]:
    """musubi-tuner's caching behaviour on our flags: it always trains from cached latents and text-encoder outputs
    (its separate caching scripts), so the run caches both unless the command line says otherwise
    (``--cache_latents*`` / ``--cache_text_encoder_outputs*`` given): with musubi-tuner's dataset config on disk, in
    its ``cache_directory`` (``--cache_dir``, unless given) else next to the images, where
    qwen_image_cache_latents.py / qwen_image_cache_text_encoder_outputs.py write them, and in memory with
    sd-scripts' dataset config; and it trains the DiT's adapters only
    (``--network_train_unet_only`` unless a ``--network_train_*`` flag is given)."""
    from library.cli.parse import peek
    from library.data import musubi_dataset

    args = list(sys.argv[1:] if argv is None else argv)
    config = peek(args, "dataset_config")
    on_disk = "_to_disk" if musubi_dataset.read_musubi(config) is not None else ""
    folder = musubi_dataset.cache_directory(config)
    if folder is not None and peek(args, "cache_dir") is None:
        args += ["--cache_dir", folder]
    if not any(a.startswith("--cache_latents") for a in args):
        args.append("--cache_latents" + on_disk)
    if not any(a.startswith("--cache_text_encoder_outputs") for a in args):
        args.append("--cache_text_encoder_outputs" + on_disk)
    if network and not any(a.startswith(("--network_train_unet_only", "--network_train_text_encoder_only"))
                           for a in args):  # fmt: skip
        args.append("--network_train_unet_only")  # musubi-tuner trains no text-encoder adapters
    return args
