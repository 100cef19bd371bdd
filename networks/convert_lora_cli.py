"""The command line every family's LoRA format converter shares (``networks/convert_<family>_lora.py``).

A converter is one ``LoraConverter``: the script's docstring and the family's
:class:`~library.families.lora_formats.LoraConversion` (the accepted ``--src`` / ``--dst`` names, which of them is the
PEFT side, the default direction, and the family's formats module that does the work: ``is_peft(state)``,
``kohya_to_peft(state, source)``, ``peft_to_kohya(state, source)``). The scripts stay thin: their docstring, one
``LoraConverter`` and ``run`` / ``main``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.families.lora_formats import LoraConversion
from networks.tool_common import check_adapter_path, dtype_of


@dataclass(frozen=True)
class LoraConverter:
    """One LoRA converter: the script's docstring (the --help text) and the family's conversion (``formats`` maps
    each accepted name to its format, ``peft_format`` or "sd-scripts")."""

    description: str
    conversion: LoraConversion

    @property
    def formats(self) -> Mapping[str, str]:
        return self.conversion.formats

    @property
    def peft_format(self) -> str:
        """The PEFT side's name in messages ("ai-toolkit", "diffusers")."""
        return self.conversion.peft_format

    @property
    def default_src(self) -> str:
        return self.conversion.default_src

    @property
    def default_dst(self) -> str:
        return self.conversion.default_dst

    def build_parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=self.description, formatter_class=argparse.RawDescriptionHelpFormatter)
        names = list(self.formats)
        p.add_argument(
            "--src", default=self.default_src, choices=names, help=f"source format (default {self.default_src})"
        )
        p.add_argument("--dst", default=self.default_dst, choices=names, help=f"destination format (default "
                       f"{self.default_dst})")  # fmt: skip
        p.add_argument("--src_path", default=None, help="source LoRA file (.safetensors)")
        p.add_argument("--dst_path", default=None, help="destination file (.safetensors)")
        p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                       help="output precision (default float: the converted factors)")  # fmt: skip
        return p

    def check(self, args: argparse.Namespace) -> tuple[str, str]:
        """Every problem with the arguments at once (ConfigError); returns the (source, destination) formats."""
        problems: list[str] = []
        src, dst = self.formats[args.src], self.formats[args.dst]
        if src == dst:
            problems.append(f"--src {args.src} and --dst {args.dst} are the same format; nothing to convert")
        if not args.src_path:
            problems.append("--src_path is required: the LoRA file to convert")
        elif not Path(args.src_path).is_file():
            problems.append(f"--src_path {args.src_path}: no such file")
        check_adapter_path("--dst_path", args.dst_path, problems)
        if problems:
            raise ConfigError(problems)
        return src, dst

    def convert(self, args: argparse.Namespace) -> Path:
        """Read ``--src_path``, convert every module's factors, write ``--dst_path`` atomically with the metadata."""
        from library.files.weights import load_state_dict, save_state_dict

        ff = importlib.import_module(self.conversion.module)
        src, dst = self.check(args)
        state, metadata = load_state_dict(args.src_path)
        peft = ff.is_peft(state)
        if (src == self.peft_format) != peft:
            found = f"PEFT / {self.peft_format} keys (*.lora_A.weight)" if peft else "kohya keys (*.lora_down.weight)"
            raise ConfigError([f"--src_path {args.src_path} holds {found}, not --src {args.src}; swap --src and --dst"])
        out = ff.peft_to_kohya(state, args.src_path) if peft else ff.kohya_to_peft(state, args.src_path)
        if not out:
            raise ConfigError([f"--src_path {args.src_path}: no LoRA modules to convert"])
        path = save_state_dict(out, args.dst_path, metadata, dtype_of(args.save_precision, None), wrap_ckpt=False)
        print(f"converted {args.src_path} ({src}) -> {path} ({dst}): {len(out)} tensors")
        return path

    def run(self, argv: Sequence[str] | None = None) -> Path:
        """Convert; returns the path written."""
        return self.convert(self.build_parser().parse_args(argv))

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
        return main_guard(lambda: self.run(argv))
