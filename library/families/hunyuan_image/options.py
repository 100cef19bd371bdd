"""HunyuanImage 2.1's own flags (sd-scripts' ``hunyuan_image_train_network.py: setup_parser``) next to their one reader
:class:`HunyuanOptions` (``HunyuanImageFamily.options``).

Load flags: ``--text_encoder`` (Qwen2.5-VL-7B), ``--byt5`` (byT5-small Glyph), ``--vae_chunk_size`` (sd-scripts'
chunked VAE convolutions: the same values; the diffusers VAE here runs whole), ``--attn_mode`` / ``--split_attn``
(PyTorch SDPA; xformers / flash / sageattn refused). Training adds the objective's flags (``objective.py``) and:

* ``--network_train_unet_only`` is required (sd-scripts' LoRA has no text-encoder adapters; its doc line passes it);
* ``--fp8_base`` / ``--fp8_base_unet`` without ``--fp8_scaled`` are refused pointing to ``--fp8_scaled`` (sd-scripts
  warns and ignores them); with it they are left to the shared ``--fp8_scaled`` (sd-scripts ignores them then);
* ``--fp8_scaled`` is the shared flag where the run layer has it (else refused here);
* ``--fp8_vl``: Qwen2.5-VL's Linear and norm weights in float8 as sd-scripts stores them
  (``encoders/qwen25vl.store_fp8_as_sd_scripts``); ``--text_encoder_cpu``: Qwen2.5-VL and byT5 stay on the CPU and compute
  there (caching, or every step without a cache), as sd-scripts.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..options import add_once, identity_of, mark_no_effect
from .objective import HunyuanFlowConfig, add_hunyuan_flow_args

log = logging.getLogger(__name__)

FAMILY_NAMES = ("hunyuan_image",)
ATTN_MODES = ("torch", "sdpa", "xformers", "flash", "sageattn")
SD_ONLY_FLAGS = {
    "--v2": "HunyuanImage 2.1 is read from the weights",
    "--v_parameterization": "HunyuanImage 2.1 is a flow-matching model (sd-scripts' script does not read it)",
    "--clip_skip": "HunyuanImage 2.1 reads Qwen2.5-VL's hidden_states[-3] (sd-scripts' script does not read it)",
    "--max_token_length": "Qwen2.5-VL takes up to 1024 caption tokens, byT5 128 (sd-scripts' script does not read it)",
}
LATER = ("not implemented for HunyuanImage 2.1 by this script (scaled float8 DiT weights are the shared --fp8_scaled "
         "of the training scripts)")  # fmt: skip
VAE_NOTE = ("sd-scripts' chunked VAE convolutions compute the same values as whole ones to save memory; the diffusers "
            "VAE here runs each image whole (same latents and images, more peak memory)")  # fmt: skip


@dataclass(frozen=True)
class HunyuanOptions:
    """The HunyuanImage flags of a run or a load (sd-scripts' names); ``flow``: the objective's (training only)."""

    text_encoder: str | None = None
    byt5: str | None = None
    vae_chunk_size: int | None = None
    attn_mode: str | None = None
    split_attn: bool = False
    text_encoder_batch_size: int | None = None
    qwen_max_length: int = 1024  # caption tokens (sd-scripts' TOKENIZER_MAX_LENGTH); the tiny model uses fewer
    fp8_vl: bool = False
    text_encoder_cpu: bool = False
    flow: HunyuanFlowConfig | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        if training:
            add_hunyuan_flow_args(parser)
        g = parser.add_argument_group("HunyuanImage 2.1 model", "HunyuanImage 2.1 (sd-scripts' "
                                      "hunyuan_image_train_network.py)")  # fmt: skip
        add_once(g, parser, "--text_encoder", type=str, default=None,
                 help="Qwen2.5-VL-7B: qwen_2.5_vl_7b.safetensors (Comfy-Org), a transformers file or folder")  # fmt: skip
        add_once(g, parser, "--byt5", type=str, default=None,
                 help="byT5-small Glyph: byt5_small_glyphxl_fp16.safetensors (Comfy-Org)")  # fmt: skip
        add_once(g, parser, "--vae_chunk_size", type=int, default=None, help=f"accepted: {VAE_NOTE}")
        add_once(g, parser, "--attn_mode", type=str, default=None, choices=list(ATTN_MODES),
                 help="attention: torch / sdpa (the default, PyTorch SDPA); xformers, flash and sageattn are refused")  # fmt: skip
        add_once(g, parser, "--split_attn", action="store_true",
                 help="sd-scripts computes attention sample by sample to save memory; SDPA gives the same values")  # fmt: skip
        if "--fp8_scaled" not in parser._option_string_actions:
            add_unsupported(g, "--fp8_scaled", LATER, action="store_true")
        add_once(g, parser, "--fp8_vl", action="store_true",
                 help="Qwen2.5-VL's Linear and norm weights in float8 (e4m3fn), computed in bf16 / float32")  # fmt: skip
        add_once(g, parser, "--text_encoder_cpu", action="store_true",
                 help="Qwen2.5-VL and byT5 stay on the CPU and compute there")  # fmt: skip
        if training:
            add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                     help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
            mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> HunyuanOptions:
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("byt5",))
        problems += missing_path_problems(args, ("text_encoder",), folders=True)
        problems += positive_count_problems(args, ("text_encoder_batch_size", "vae_chunk_size"))
        mode = getattr(args, "attn_mode", None)
        if mode in ("xformers", "flash", "sageattn"):
            problems.append(f"--attn_mode {mode} is not supported: HunyuanImage's attention runs on PyTorch SDPA "
                            "(diffusers' attention dispatch); drop the flag or use --attn_mode torch")  # fmt: skip
        for flag in ("fp8_base", "fp8_base_unet"):
            if getattr(args, flag, False) and not getattr(args, "fp8_scaled", False):
                problems.append(f"--{flag} is not supported for HunyuanImage 2.1 (as in sd-scripts): its fp8 mode is "
                                f"--fp8_scaled (per-tensor scaled fp8); use --fp8_scaled instead of --{flag}")  # fmt: skip
        if training and hasattr(args, "network_train_unet_only") and not args.network_train_unet_only:
            problems.append("HunyuanImage 2.1 LoRA trains the DiT only: add --network_train_unet_only (sd-scripts' "
                            "networks.lora_hunyuan_image has no text-encoder adapters; its documented command line "
                            "passes the flag)")  # fmt: skip
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for HunyuanImage 2.1: A1111-style weights are for "
                            "CLIP prompts (sd-scripts' script has none either); drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = HunyuanFlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        if getattr(args, "vae_chunk_size", None):
            log.info("--vae_chunk_size: %s", VAE_NOTE)
        if getattr(args, "split_attn", False):
            log.info("--split_attn: PyTorch SDPA attends the whole batch at once; the values are the same")
        return from_namespace(cls, args, flow=flow)

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name not in FAMILY_NAMES:
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; the HunyuanImage scripts train "
                    "HunyuanImage 2.1"]  # fmt: skip
        return []

    def metadata(self) -> dict[str, Any]:
        return {}

    def prompt_identity(self) -> str:
        return identity_of((("qwen_max_length", self.qwen_max_length),))
