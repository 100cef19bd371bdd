"""Z-Image's own flags (musubi-tuner's ``zimage_train_network.py`` / ``zimage_setup_parser`` and the musubi-tuner
common flags that train_network.py has no name for) next to their one reader :class:`ZImageOptions`
(``ZImageFamily.options``).

Read: ``--dit`` (the DiT: another name of ``--pretrained_model_name_or_path``), ``--text_encoder`` (Qwen3-4B: one
file, a split file's first part, or a folder), ``--fp8_llm`` (Qwen3's Linear weights stored in float8, computed in
bf16: ``library/device/fp8.py``), ``--model_version base|turbo`` (sdtrain's: the weights of Z-Image and Z-Image-Turbo
cannot be told apart, so the sampler defaults follow this flag: base 25 steps with CFG 4 (musubi-tuner's sampling
defaults for the base model), turbo 8 steps without CFG (Z-Image-Turbo's)), ``--split_attn`` (musubi-tuner attends
sample by sample; the DiT here always gets each sample's own caption length: the same values),
``--use_32bit_attention`` (attention here runs in the compute dtype of PyTorch SDPA; read as a no-op with a note),
``--mem_eff_save`` (the saves here write tensor by tensor already), ``--vae_dtype`` (the AE's dtype).
``--fp8_base`` / ``--fp8_scaled`` are the shared flags (library/run/runtime.py, library/device/fp8.py).
Refused with a message: attention back ends other than SDPA and the musubi-tuner common flags with no counterpart
here (:data:`MUSUBI_ONLY`).
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
from ..options import add_once, identity_of, mark_no_effect, musubi_caching
from .objective import ZImageFlowConfig, add_flow_args

log = logging.getLogger(__name__)

FAMILY_NAMES = ("zimage",)
MODEL_VERSIONS = ("base", "turbo")
SD_ONLY_FLAGS = {
    "--v2": "Z-Image is read from the weights",
    "--v_parameterization": "Z-Image is a flow-matching model",
    "--clip_skip": "Z-Image reads Qwen3's second-to-last hidden state",
    "--max_token_length": "Z-Image takes up to 512 prompt tokens (musubi-tuner's fixed length)",
}
# musubi-tuner flags with no counterpart here: flag -> (argparse kwargs, why refused)
MUSUBI_ONLY: dict[str, tuple[dict, str]] = musubi_refused("Z-Image", {
    "--guidance_scale": ({"type": float, "default": None}, "Z-Image has no guidance embedding; the sample prompts' --l sets CFG"),
})  # fmt: skip


@dataclass(frozen=True)
class ZImageOptions:
    """The Z-Image flags of a run or a load; ``flow``: the objective's settings (training only).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    text_encoder: str | None = None
    model_version: str = "base"
    fp8_llm: bool = False
    split_attn: bool = False
    vae_dtype: str | None = None
    text_encoder_batch_size: int | None = None
    flow: ZImageFlowConfig | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        if training:
            add_flow_args(parser)
        g = parser.add_argument_group("Z-Image model", "Z-Image (musubi-tuner's zimage_* scripts)")
        if "--dit" not in parser._option_string_actions:
            g.add_argument("--dit", dest="pretrained_model_name_or_path", type=str, default=None,
                           help="the Z-Image DiT (a .safetensors file, the first of a split set, or a diffusers "
                           "folder): musubi-tuner's name of --pretrained_model_name_or_path")  # fmt: skip
        add_once(
            g,
            parser,
            "--text_encoder",
            type=str,
            default=None,
            help="Qwen3-4B: one .safetensors (ComfyUI's qwen_3_4b), the first part of a split file, or a folder",
        )
        add_once(
            g,
            parser,
            "--model_version",
            type=str,
            default=None,
            help="base (default) or turbo: the sampler defaults (base 25 steps, CFG 4; turbo 8 steps, no CFG)",
        )
        add_once(g, parser, "--fp8_llm", action="store_true",
                 help="store Qwen3's Linear weights in float8 (computed in bf16), as musubi-tuner")  # fmt: skip
        add_once(
            g,
            parser,
            "--split_attn",
            action="store_true",
            help="musubi-tuner attends sample by sample; the DiT here gets each caption's own length already",
        )
        add_once(
            g,
            parser,
            "--use_32bit_attention",
            action="store_true",
            help="musubi-tuner's float32 attention; attention here runs in the compute dtype (a no-op)",
        )
        add_once(g, parser, "--vae_dtype", type=str, default=None, help="the AE's dtype (default: the run's)")
        if training:
            add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                     help="captions per Qwen3 call when caching (default: the training batch size)")  # fmt: skip
            add_once(g, parser, "--mem_eff_save", action="store_true",
                     help="musubi-tuner's streamed save; the saves here write tensor by tensor already")  # fmt: skip
        for flag, (kwargs, reason) in MUSUBI_ONLY.items() if training else ():
            if flag not in parser._option_string_actions:
                add_unsupported(g, flag, reason, **kwargs)
        if training:
            mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> ZImageOptions:
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("text_encoder",), folders=True)
        problems += positive_count_problems(args, ("text_encoder_batch_size",))
        version = (getattr(args, "model_version", None) or "base").lower()
        if version not in MODEL_VERSIONS:
            problems.append(f"--model_version {version}: Z-Image's are base and turbo (the sampler defaults)")
        value = getattr(args, "vae_dtype", None)
        if value is not None and value not in ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16"):
            problems.append(f"--vae_dtype {value}: one of float32, float16, bfloat16")
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for Z-Image: A1111-style weights are for CLIP "
                            "prompts; drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = ZImageFlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        for flag, note in (("split_attn", "each sample's caption is attended at its own length already"),
                           ("use_32bit_attention", "attention runs in the compute dtype (PyTorch SDPA)"),
                           ("mem_eff_save", "the saves write tensor by tensor already")):  # fmt: skip
            if getattr(args, flag, False):
                log.info("--%s: %s; nothing to change", flag, note)
        return from_namespace(cls, args, flow=flow, model_version=version)

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name not in FAMILY_NAMES:
            return [f"--dit {path}: a {spec.title} model; the Z-Image scripts train Z-Image"]
        return []

    def metadata(self) -> dict[str, Any]:
        return {"ss_model_version": self.model_version}

    def prompt_identity(self) -> str:
        return identity_of((("fp8_llm", self.fp8_llm),))


def musubi_argv(argv: Any, network: bool = True) -> list[str]:
    """musubi-tuner's caching behaviour on our flags: it always trains from cached latents and text-encoder outputs
    (its separate caching scripts), so the run caches both unless told otherwise (:func:`..options.musubi_caching`:
    on disk in musubi-tuner's ``cache_directory``, where zimage_cache_*.py write); and it trains the DiT's adapters
    only (``--network_train_unet_only`` unless a ``--network_train_*`` flag is given)."""
    args = list(sys.argv[1:] if argv is None else argv)
    args = musubi_caching(args)  # on disk in the dataset config's cache_directory, where the caching scripts write
    if network and not any(a.startswith(("--network_train_unet_only", "--network_train_text_encoder_only"))
                           for a in args):  # fmt: skip
        args.append("--network_train_unet_only")  # musubi-tuner trains no text-encoder adapters
    return args
