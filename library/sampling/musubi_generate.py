"""What musubi-tuner's text-to-image scripts share (the root ``*_generate_image.py`` of the families it trains): the
command line with musubi-tuner's names, its checks (every refused flag with its reason, before anything loads), the
family loaded with LoRA files applied, and the image loop (one ``--prompt``, ``--from_file``, ``--interactive``) over
:mod:`library.sampling.minimal`.

A script states its family and what differs (:class:`MusubiGenerateScript`: its refused flags beyond the common ones,
the defaults and help of its image flags, its extra flags, how a prompt becomes a :class:`PromptSpec`) and passes
``networks.apply.apply_adapter_files`` to :meth:`MusubiGenerateScript.run` (the library does not import networks).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from library.cli.console import add_logging_args, console_logging
from library.cli.problems import ConfigError
from library.families.protocol import ModelFamily
from library.sampling.minimal import device_of_choice, generate_images
from library.sampling.prompts import PromptSpec

COMMON_REFUSED_SWITCHES = {
    "fp8": "float8 storage is training's --fp8_base; inference runs in the weights' precision",
    "fp8_scaled": "scaled float8 weights are not supported yet",
    "fp8_fast": "scaled float8 weights are not supported yet",
    "no_metadata": "the PNG info (prompt and settings) is always written",
    "vae_enable_tiling": "tiled VAE decoding is not done here",
    "use_pinned_memory_for_block_swap": "use --offload",
    "disable_numpy_memmap": "not read here",
}
COMMON_REFUSED_VALUES = {
    "include_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "exclude_patterns": "LoRA module filters at load are not supported; every module of the file is applied",
    "latent_path": "decoding saved latents is not supported",
    "save_merged_model": "saving the merged DiT is not done here; use networks/merge tools",
    "ckpt_dir": "not read here",
    "num_layers": "a DiT with fewer blocks is read from its file's shapes",
}
ApplyAdapters = Callable[..., Any]  # networks.apply.apply_adapter_files(pairs, roots, text_encoders, device, log)


@dataclass(frozen=True)
class Flag:
    """An image flag's default and help."""

    default: Any
    help: str | None = None


@dataclass(frozen=True)
class MusubiGenerateScript:
    """One musubi-tuner generate script (module docstring).

    ``spec_fields(args, parts)``: the :class:`PromptSpec` fields besides the prompt and size (``negative_prompt``,
    ``steps``, ``scale``, ``guidance`` ...), read once the family is loaded. ``extra_args(group)``: the script's own
    flags on the image group; ``extra_problems(args, options)``: its own checks, before anything loads;
    ``sampling(args, family, parts)``: the family to sample with once loaded (an edit model's control images).
    """

    family: ModelFamily
    doc: str
    log: logging.Logger
    dit_help: str
    vae_help: str
    spec_fields: Callable[[argparse.Namespace, Any], dict[str, Any]]
    refused_switches: Mapping[str, str] = field(default_factory=dict)
    refused_values: Mapping[str, str] = field(default_factory=dict)
    guidance_scale: Flag = Flag(4.0, "true CFG scale (default 4.0)")
    image_size: Flag = Flag([256, 256])
    infer_steps: Flag = Flag(25)
    flow_shift: Flag = Flag(None, "a static shift (default: the dynamic shift)")
    extra_args: Callable[[Any], None] | None = None
    extra_problems: Callable[[argparse.Namespace, Any], list[str]] | None = None
    sampling: Callable[[argparse.Namespace, ModelFamily, Any], Any] | None = None

    @property
    def refused(self) -> dict[str, str]:
        return {**COMMON_REFUSED_SWITCHES, **self.refused_switches, **COMMON_REFUSED_VALUES, **self.refused_values}

    def build_parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(description=self.doc.split("\n\n")[0])
        add_logging_args(parser)
        parser.add_argument("--dit", type=str, required=True, help=self.dit_help)
        parser.add_argument("--vae", type=str, default=None, help=self.vae_help)
        g = parser.add_argument_group("image")
        g.add_argument("--lora_weight", type=str, nargs="*", default=None, help="LoRA files")
        g.add_argument("--lora_multiplier", type=float, nargs="*", default=None, help="their multipliers (default 1.0)")
        g.add_argument("--lycoris", action="store_true", help="accepted: LyCORIS files are read like any adapter file")
        g.add_argument("--guidance_scale", type=float, default=self.guidance_scale.default,
                       help=self.guidance_scale.help)  # fmt: skip
        if self.extra_args is not None:
            self.extra_args(g)
        g.add_argument("--prompt", type=str, default=None)
        g.add_argument("--negative_prompt", type=str, default=None)
        g.add_argument("--image_size", type=int, nargs=2, default=self.image_size.default, metavar=("H", "W"))
        g.add_argument("--infer_steps", type=int, default=self.infer_steps.default, help=self.infer_steps.help)
        g.add_argument("--save_path", type=str, required=True, help="folder for the images")
        g.add_argument("--seed", type=int, default=None)
        g.add_argument("--flow_shift", type=float, default=self.flow_shift.default, help=self.flow_shift.help)
        g.add_argument("--device", type=str, default=None, help="default: CUDA, else MPS, else CPU")
        g.add_argument("--attn_mode", type=str, default="torch", choices=["torch", "sdpa", "xformers", "flash",
                                                                           "sageattn", "flash3"])  # fmt: skip
        g.add_argument("--output_type", type=str, default="images", choices=["images", "latent", "latent_images"])
        g.add_argument("--sample_solver", type=str, default="euler", help="euler only here")
        g.add_argument("--from_file", type=str, default=None, help="one prompt per line")
        g.add_argument("--interactive", action="store_true")
        g.add_argument("--offload", action="store_true", help="each part on the device only while it runs")
        g.add_argument("--blocks_to_swap", type=int, default=None, help="read as --offload")
        switches = {**COMMON_REFUSED_SWITCHES, **self.refused_switches}
        for flag, why in switches.items():
            if f"--{flag}" not in parser._option_string_actions:
                g.add_argument(f"--{flag}", action="store_true", help=f"refused: {why}")
        for flag, why in {**COMMON_REFUSED_VALUES, **self.refused_values}.items():
            if f"--{flag}" not in parser._option_string_actions:
                g.add_argument(f"--{flag}", type=str, nargs="*", default=None, help=f"refused: {why}")
        self.family.options.add_args(parser, training=False)  # --text_encoder --model_version, musubi-only refusals
        return parser

    def _problems(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], Any]:
        from library.cli.parse import unsupported_problems

        problems = unsupported_problems(parser, args)
        problems += [f"--{flag}: {why}" for flag, why in self.refused.items()
                     if getattr(args, flag, None) not in (None, False)]  # fmt: skip
        if args.output_type != "images":
            problems.append(f"--output_type {args.output_type}: only images are written")
        if args.sample_solver != "euler":
            problems.append(
                f"--sample_solver {args.sample_solver}: the flow Euler sampler only (--sample_solver euler)"
            )
        if args.attn_mode not in ("torch", "sdpa"):
            problems.append(f"--attn_mode {args.attn_mode}: attention runs on PyTorch SDPA (torch / sdpa)")
        if args.prompt is None and args.from_file is None and not args.interactive:
            problems.append("give --prompt, --from_file or --interactive")
        loras, multipliers = list(args.lora_weight or []), list(args.lora_multiplier or [])
        if multipliers and len(multipliers) not in (1, len(loras)):
            problems.append(f"--lora_multiplier: {len(multipliers)} values for {len(loras)} --lora_weight files")
        options = None
        try:
            options = self.family.options.from_args(args, training=False)
        except ConfigError as e:
            problems += e.problems
        if self.extra_problems is not None and options is not None:
            problems += self.extra_problems(args, options)
        return problems, options

    def run(self, argv: Sequence[str] | None, apply_adapter_files: ApplyAdapters) -> list[Path]:
        """Run the script with ``argv``; returns the written image paths."""
        import torch

        parser = self.build_parser()
        args = parser.parse_args(argv)
        console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
        problems, options = self._problems(parser, args)
        if problems:
            raise ConfigError(problems)
        family, log = self.family, self.log
        offload = args.offload or bool(args.blocks_to_swap)
        device = torch.device(args.device) if args.device else device_of_choice()
        parts = family.load(args.dit, vae=args.vae, device="cpu" if offload else device, options=options)
        if args.flow_shift is not None:
            parts.scheduler_config["static_shift"] = float(args.flow_shift)
        loras, multipliers = list(args.lora_weight or []), list(args.lora_multiplier or [])
        pairs = [(p, multipliers[i] if i < len(multipliers) else (multipliers[0] if multipliers else 1.0))
                 for i, p in enumerate(loras)]  # fmt: skip
        networks = apply_adapter_files(pairs, family.adapter_roots(parts), False, device, log)
        height, width = args.image_size
        fields = self.spec_fields(args, parts)

        def spec_of(prompt: str) -> PromptSpec:
            return PromptSpec(prompt, width=width, height=height, **fields)

        if self.sampling is not None:
            family = self.sampling(args, family, parts)
        negative = fields.get("negative_prompt", "")
        return generate_images(family, parts, args, spec_of, device, offload, networks, negative, log)
