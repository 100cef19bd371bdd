"""Anima's own flags (sd-scripts' ``anima_train_utils.add_anima_training_arguments`` and ``anima_train_network.py``'s
own) next to their one reader :class:`AnimaOptions` (``AnimaFamily.options``).

Load flags (every entry point that loads an Anima model): ``--qwen3`` (Qwen3-0.6B: a folder or one .safetensors),
``--llm_adapter_path`` (the LLM adapter beside a DiT file without one), ``--t5_tokenizer_path``,
``--qwen3_max_token_length`` / ``--t5_max_token_length`` (512 each), ``--vae_chunk_size`` / ``--vae_disable_cache``
(sd-scripts' memory options of its own VAE class: see :data:`VAE_NOTES`), ``--attn_mode`` / ``--split_attn``.
Training adds the objective's flags (``objective.py``) and ``--text_encoder_batch_size``. The full fine-tune's
learning-rate flags (``--llm_adapter_lr --self_attn_lr --cross_attn_lr --mlp_lr --mod_lr``) are
``full_training.py``'s; the LoRA script accepts them with no effect, as sd-scripts' does (:func:`add_lora_script_args`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..options import add_once, identity_of, mark_no_effect
from .objective import AnimaFlowConfig, add_anima_flow_args

log = logging.getLogger(__name__)

FAMILY_NAMES = ("anima",)
DEFAULT_LENGTH = 512
ATTN_MODES = ("torch", "sdpa", "xformers", "flash", "sageattn")
SD_ONLY_FLAGS = {
    "--v2": "Anima is read from the weights",
    "--v_parameterization": "Anima is a flow-matching model (sd-scripts' Anima script does not read it)",
    "--clip_skip": "Anima reads Qwen3's last hidden state (sd-scripts' Anima script does not read it)",
    "--max_token_length": "Anima's lengths are --qwen3_max_token_length and --t5_max_token_length",
}
FULL_TUNE_LRS = ("--llm_adapter_lr", "--self_attn_lr", "--cross_attn_lr", "--mlp_lr", "--mod_lr")
VAE_NOTES = {
    "vae_chunk_size": "sd-scripts' chunked convolutions compute the same values as whole ones to save memory; the "
    "diffusers VAE here encodes each image whole (same latents, more peak memory while caching)",
    "vae_disable_cache": "sd-scripts' VAE keeps features of earlier frames for its causal convolutions; an image is "
    "one frame, so there is nothing to keep and the latents are the same either way",
}


@dataclass(frozen=True)
class AnimaOptions:
    """The Anima flags of a run or a load (sd-scripts' names); ``flow``: the objective's settings (training only).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    qwen3: str | None = None
    llm_adapter_path: str | None = None
    t5_tokenizer_path: str | None = None
    qwen3_max_token_length: int = DEFAULT_LENGTH
    t5_max_token_length: int = DEFAULT_LENGTH
    vae_chunk_size: int | None = None
    vae_disable_cache: bool = False
    attn_mode: str | None = None
    split_attn: bool = False
    text_encoder_batch_size: int | None = None
    flow: AnimaFlowConfig | None = None

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        if training:
            add_anima_flow_args(parser)
        g = parser.add_argument_group("Anima model", "Anima (sd-scripts' anima_train_network.py)")
        add_once(g, parser, "--qwen3", type=str, default=None,
                 help="Qwen3-0.6B text encoder: a folder (transformers) or one .safetensors file")  # fmt: skip
        add_once(g, parser, "--llm_adapter_path", type=str, default=None,
                 help="LLM adapter weights, for a DiT file without them (default: the adapter in the DiT file)")  # fmt: skip
        add_once(g, parser, "--t5_tokenizer_path", type=str, default=None,
                 help="T5 tokenizer folder for the adapter's target tokens (default: the shipped T5 vocabulary)")  # fmt: skip
        # outside training the lengths default to None (512), so gen_img.py gives another family's model no value
        length = DEFAULT_LENGTH if training else None
        add_once(g, parser, "--qwen3_max_token_length", type=int, default=length,
                 help="Qwen3 tokens per caption (default 512)")  # fmt: skip
        add_once(g, parser, "--t5_max_token_length", type=int, default=length,
                 help="T5 tokens per caption for the LLM adapter (default 512)")  # fmt: skip
        add_once(g, parser, "--vae_chunk_size", type=int, default=None, help=f"accepted: {VAE_NOTES['vae_chunk_size']}")
        add_once(g, parser, "--vae_disable_cache", action="store_true",
                 help=f"accepted: {VAE_NOTES['vae_disable_cache']}")  # fmt: skip
        add_once(g, parser, "--attn_mode", type=str, default=None, choices=list(ATTN_MODES),
                 help="attention: torch / sdpa (the default, PyTorch SDPA); xformers, flash and sageattn are refused")  # fmt: skip
        add_once(g, parser, "--split_attn", action="store_true",
                 help="sd-scripts computes attention sample by sample to save memory; SDPA gives the same values")  # fmt: skip
        if training:
            add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                     help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
            add_unsupported(g, "--unsloth_offload_checkpointing", "use --cpu_offload_checkpointing: it keeps the "
                            "checkpointed blocks' inputs on the host too (blocking copies)", action="store_true")  # fmt: skip
            mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> AnimaOptions:
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("llm_adapter_path",))
        problems += missing_path_problems(args, ("qwen3",), folders=True)
        t5 = getattr(args, "t5_tokenizer_path", None)
        if t5 is not None and not (Path(t5) / "tokenizer.json").is_file():
            problems.append(f"--t5_tokenizer_path {t5}: no tokenizer.json in this folder (give a T5 tokenizer folder, "
                            "or drop the flag for the shipped T5 vocabulary)")  # fmt: skip
        problems += positive_count_problems(args, ("qwen3_max_token_length", "t5_max_token_length",
                                                   "text_encoder_batch_size", "vae_chunk_size"))  # fmt: skip
        mode = getattr(args, "attn_mode", None)
        if mode in ("xformers", "flash", "sageattn"):
            problems.append(f"--attn_mode {mode} is not supported: Anima's attention runs on PyTorch SDPA (diffusers' "
                            "attention dispatch); drop the flag or use --attn_mode torch")  # fmt: skip
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for Anima: A1111-style weights are for CLIP prompts "
                            "(sd-scripts' Anima script has none either); drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = AnimaFlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        for flag, note in VAE_NOTES.items():
            if getattr(args, flag, None):
                log.info("--%s: %s", flag, note)
        if getattr(args, "split_attn", False):
            log.info("--split_attn: PyTorch SDPA attends the whole batch at once; the values are the same")
        # not given (None outside training): the default length, not None (which would leave captions unpadded)
        values = {k: getattr(cls, k) if getattr(args, k, None) is None else getattr(args, k)
                  for k in ("qwen3_max_token_length", "t5_max_token_length")}  # fmt: skip
        return from_namespace(cls, args, flow=flow, **values)

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name not in FAMILY_NAMES:
            return [f"--pretrained_model_name_or_path {path}: a {spec.title} model; the Anima scripts train Anima"]
        return []

    def metadata(self) -> dict[str, Any]:
        return {"ss_qwen3_max_token_length": self.qwen3_max_token_length,
                "ss_t5_max_token_length": self.t5_max_token_length}  # fmt: skip

    def prompt_identity(self) -> str:
        return identity_of((("qwen3_max_token_length", self.qwen3_max_token_length),
                            ("t5_max_token_length", self.t5_max_token_length),
                            ("t5_tokenizer_path", self.t5_tokenizer_path)))  # fmt: skip


def add_lora_script_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """anima_train_network.py: the full fine-tune's learning-rate flags, accepted with no effect (sd-scripts' LoRA
    script parses them and reads none; a LoRA's per-module rates are ``network_reg_lrs``)."""
    g = parser.add_argument_group("Anima full fine-tune learning rates", "read by anima_train.py only")
    for flag in FULL_TUNE_LRS:
        add_once(g, parser, flag, type=float, default=None, help="anima_train.py's; no effect on a LoRA")
    mark_no_effect(parser, {flag: "a learning rate of anima_train.py's parameter groups; a LoRA's per-module rates "
                            "are --network_args network_reg_lrs" for flag in FULL_TUNE_LRS})  # fmt: skip
    return parser
