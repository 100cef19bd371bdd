"""The command lines of sd-scripts' per-family LoRA tools over single model files (``networks/flux_merge_lora.py``,
``networks/flux_extract_lora.py``): generic, over a family's descriptions (``library.families.lora_tools``).

:class:`MergeTool`: adapters (any algorithm, kohya or PEFT names) into the model files users have, each module changing
its file's weight by ComfyUI's rule (``networks.single_files``), or LoRAs into one LoRA (exact with ``--concat``, else
SVD at the largest input rank). :class:`ExtractTool`: a LoRA from the difference of two denoiser files. A family's
script is its docstring and one of these (``run`` / ``main``).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from library.cli.main_guard import main_guard
from library.cli.problems import ConfigError
from library.families.loading import KeyView
from library.families.lora_tools import ExtractFromFiles, MergeIntoFiles
from networks.tool_common import (
    check_adapter_path,
    check_inputs,
    device_problem,
    dtype_of,
    ratios_for,
    save_adapter,
)

SAVE_PRECISIONS = {"float": torch.float32, "float32": torch.float32, "fp32": torch.float32, "fp16": torch.float16,
                   "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                   "fp8": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
                   "fp8_e4m3fnuz": torch.float8_e4m3fnuz, "fp8_e5m2": torch.float8_e5m2,
                   "fp8_e5m2fnuz": torch.float8_e5m2fnuz}  # fmt: skip


@dataclass(frozen=True)
class MergeTool:
    """A merge script: its docstring (the --help text), its logger's name and the family's :class:`MergeIntoFiles`."""

    description: str
    name: str
    family: MergeIntoFiles

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(self.name)

    def build_parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=self.description, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--save_precision", default=None, choices=list(SAVE_PRECISIONS),
                       help="output precision (default: --precision)")  # fmt: skip
        p.add_argument("--precision", default="float", choices=["float", "fp16", "bf16"],
                       help="precision of the merge (float recommended)")  # fmt: skip
        for file in self.family.files:
            p.add_argument(f"--{file.flag}", default=None, help=file.help)
        p.add_argument("--mem_eff_load_save", action="store_true", help="accepted: files are read memory-mapped and "
                       "only merged weights are converted")  # fmt: skip
        p.add_argument("--loading_device", default="cpu", help="device the model tensors are loaded to")
        p.add_argument("--working_device", default="cpu", help="device the merge is computed on")
        for file in self.family.files:
            p.add_argument(f"--{file.save_flag}", default=None, help=file.save_help)
        p.add_argument("--models", nargs="*", default=None, help="LoRA / LyCORIS files (kohya or PEFT names)")
        p.add_argument("--ratios", nargs="*", type=float, default=None, help="one multiplier per file (default 1.0)")
        p.add_argument("--no_metadata", action="store_true", help="LoRA output: only the minimal metadata; model "
                       "output: the input's metadata without merged_from")  # fmt: skip
        p.add_argument("--concat", action="store_true", help="LoRA + LoRA: concatenate ranks (exact)")
        p.add_argument("--shuffle", action="store_true", help="permute each output module's rank components")
        p.add_argument("--diffusers", action="store_true",
                       help=f"--{self.denoiser.flag} has diffusers names (also detected)")  # fmt: skip
        return p

    @property
    def denoiser(self):
        return self.family.files[0]

    def check(self, args: argparse.Namespace) -> list[float]:
        """The ratios; every problem of the command line in one ConfigError."""
        problems: list[str] = []
        ratios = ratios_for(args.models, args.ratios, problems)
        check_inputs("--models", args.models, problems)
        for flag in ("loading_device", "working_device"):
            device_problem(getattr(args, flag), problems)
        for file in self.family.files:
            model, save_to = file.flag, file.save_flag
            if getattr(args, model):
                check_inputs(f"--{model}", [getattr(args, model)], problems)
                out = getattr(args, save_to)
                if not out:
                    problems.append(f"--{model} needs --{save_to}: the file the merged {model} is written to")
                elif Path(out).suffix.lower() != ".safetensors":
                    problems.append(f"--{save_to} {out}: write {self.family.title} model files as .safetensors")
            elif getattr(args, save_to) and file is not self.denoiser:
                problems.append(f"--{save_to} without --{model}: pass the {model} file to merge into")
        if not self.into_model(args):
            check_adapter_path(f"--{self.denoiser.save_flag}", getattr(args, self.denoiser.save_flag), problems)
            if args.diffusers:
                problems.append(
                    f"--diffusers describes --{self.denoiser.flag}'s names; it needs --{self.denoiser.flag}"
                )
        if problems:
            raise ConfigError(problems)
        return ratios

    def into_model(self, args: argparse.Namespace) -> bool:
        return any(getattr(args, f.flag) for f in self.family.files)

    def merge_into_models(self, args: argparse.Namespace, files, ratios: list[float]) -> list[Path]:
        from library.files.weights import load_state_dict, save_state_dict
        from networks import single_files
        from networks.merge import merged_from

        given = [file.prefix for file in self.family.files if getattr(args, file.flag)]
        flags = {file.prefix: f"--{file.flag}" for file in self.family.files}
        for prefix, count in single_files.unplaced_modules(files, given).items():
            flag = flags.get(prefix, "a model file")
            self.logger.warning("%d %s module(s) are not merged: pass %s to merge them", count, prefix, flag)
        written = []
        work = dtype_of(args.precision)
        save_dtype = SAVE_PRECISIONS[args.save_precision] if args.save_precision else work
        for file in self.family.files:
            path = getattr(args, file.flag)
            if not path:
                continue
            if file is self.denoiser:
                read = self.family.read_denoiser
                state, to_output, metadata = read(path, args.loading_device, args.diffusers, f"--{file.flag}")
            else:
                state, metadata = load_state_dict(path, device=args.loading_device)
                to_output = lambda s: s  # noqa: E731
            changed = single_files.merge_into_state(state, file.prefix, file.module_names(state), files, ratios,
                                                    working_device=args.working_device, dtype=work)  # fmt: skip
            self.logger.info("%s: %d weights changed", path, len(changed))
            meta = dict(metadata)
            if not args.no_metadata:
                meta["modelspec.merged_from"] = merged_from([Path(path).stem] + [f.title for f in files])
                if "modelspec.title" in meta:
                    meta["modelspec.title"] = Path(getattr(args, file.save_flag)).stem
            written.append(save_state_dict(to_output(state), getattr(args, file.save_flag), meta, save_dtype))
        return written

    def merge_loras(self, args: argparse.Namespace, files, ratios: list[float]) -> Path:
        from networks import merge, single_files

        problems = merge.check_same_family(files)
        if problems:
            raise ConfigError(problems, "adapter files")
        if args.concat:
            state = merge.concat_merge(files, ratios)
            how = "merged by concatenating ranks (exact)"
        else:
            rank = max((f.rank_of(n) or 0) for f in files for n in f.modules if f.algos[n] != "norm")
            state = merge.svd_merge(files, ratios, new_rank=rank, new_conv_rank=None, device=args.working_device)
            how = f"merged by SVD of the summed ΔW at rank {rank}"
        if args.shuffle:
            single_files.shuffle_ranks(state)
        save_to = getattr(args, self.denoiser.save_flag)
        meta = merge.lora_metadata(files, ratios, state, how, save_to)
        module = self.family.network_module
        if any(f.metadata.get("ss_network_module") == module for f in files):
            meta["ss_network_module"] = module
        save = SAVE_PRECISIONS[args.save_precision] if args.save_precision else dtype_of(args.precision)
        return save_adapter(state, save_to, meta, save, no_metadata=args.no_metadata)

    def run(self, argv: Sequence[str] | None = None) -> list[Path]:
        """Merge; returns the paths written."""
        from networks.single_files import load_adapters_converting

        args = self.build_parser().parse_args(argv)
        ratios = self.check(args)
        files = load_adapters_converting(args.models, self.family.conversion)
        if args.mem_eff_load_save:
            self.logger.info("--mem_eff_load_save: files are read memory-mapped; only the merged weights are converted")
        if self.into_model(args):
            paths = self.merge_into_models(args, files, ratios)
        else:
            paths = [self.merge_loras(args, files, ratios)]
        print(f"merged {len(files)} file(s) into {', '.join(map(str, paths))}")
        return paths

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
        return main_guard(lambda: self.run(argv))


@dataclass(frozen=True)
class ExtractTool:
    """An extract script: its docstring (the --help text) and the family's :class:`ExtractFromFiles`."""

    description: str
    family: ExtractFromFiles

    def build_parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=self.description, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--save_precision", choices=[None, "float", "fp16", "bf16"], default=None,
                       help="output precision (default float)")  # fmt: skip
        p.add_argument("--model_org", default=None, help=self.family.org_help)
        p.add_argument("--model_tuned", default=None, help=self.family.tuned_help)
        p.add_argument("--mem_eff_safe_open", action="store_true", help="read the files one tensor at a time")
        p.add_argument("--save_to", default=None, help="output LoRA (.safetensors / .ckpt / .pt / .pth)")
        p.add_argument("--dim", type=int, default=4, help="rank of the LoRA (default 4)")
        p.add_argument("--device", default=None, help="device for the differences and SVDs, e.g. cuda")
        p.add_argument("--clamp_quantile", type=float, default=0.99, help="clamp the factors at this quantile (1: off)")
        p.add_argument("--min_diff", type=float, default=0.0, help="leave out modules whose largest |ΔW| is at most "
                       "this (default 0: every module)")  # fmt: skip
        p.add_argument("--no_metadata", action="store_true", help="only the minimal metadata")
        return p

    @staticmethod
    def check(args: argparse.Namespace) -> None:
        problems: list[str] = []
        for flag in ("model_org", "model_tuned"):
            value = getattr(args, flag)
            if not value:
                problems.append(f"--{flag} is required")
            elif not Path(value).is_file():
                problems.append(f"--{flag} {value}: no such file")
        check_adapter_path("--save_to", args.save_to, problems)
        if args.dim < 1:
            problems.append(f"--dim {args.dim}: must be >= 1")
        if not 0 < args.clamp_quantile <= 1:
            problems.append(f"--clamp_quantile must be in (0, 1], got {args.clamp_quantile}")
        if args.min_diff < 0:
            problems.append(f"--min_diff {args.min_diff}: must be >= 0")
        device_problem(args.device, problems)
        if problems:
            raise ConfigError(problems)

    def modules(self, org: KeyView, tuned: KeyView, args: argparse.Namespace) -> dict[str, str]:
        """{kohya name: weight key} of the family's extracted matrices; ``ConfigError`` when the two files differ
        in architecture."""
        names = self.family.modules(org)
        keys = list(names.values())
        tuned_keys = set(tuned)
        missing = [k for k in keys if k not in tuned_keys]
        wrong = [f"{k} {tuple(org.shape(k))} vs {tuple(tuned.shape(k))}" for k in keys
                 if k in tuned_keys and tuple(org.shape(k)) != tuple(tuned.shape(k))]  # fmt: skip
        if missing or wrong or not keys:
            detail = (f"{len(missing)} missing in --model_tuned, e.g. {', '.join(missing[:3])}" if missing else
                      f"shapes differ: {', '.join(wrong[:3])}" if wrong else "no block weights found")  # fmt: skip
            raise ConfigError([f"--model_org {args.model_org} and --model_tuned {args.model_tuned} are not the same "
                               f"architecture ({detail})"])  # fmt: skip
        return names

    def metadata(self, org: KeyView, args: argparse.Namespace) -> dict[str, str]:
        """sd-scripts' minimal metadata of an extracted LoRA, with the family read from the original's weights, +
        ModelSpec."""
        family = self.family.family_of(list(org))
        meta = {
            "ss_v2": str(family.ss_v2),
            "ss_base_model_version": family.base_model_version(),
            "ss_network_module": self.family.network_module,
            "ss_network_dim": str(args.dim),
            "ss_network_alpha": str(float(args.dim)),
            "ss_network_args": json.dumps({}),
            "ss_training_comment": f"extracted from {Path(args.model_org).name} -> {Path(args.model_tuned).name}",
        }
        return {**meta, **self.family.modelspec(family, Path(args.save_to).stem)}

    def run(self, argv: Sequence[str] | None = None) -> Path:
        """Extract; returns the path written."""
        from networks.extract import ExtractOptions, extract_from_state_dicts
        from networks.merge import output_ranks

        args = self.build_parser().parse_args(argv)
        self.check(args)
        org = self.family.read(args.model_org, "--model_org", args.mem_eff_safe_open)
        tuned = self.family.read(args.model_tuned, "--model_tuned", args.mem_eff_safe_open)
        names = self.modules(org, tuned, args)
        opts = ExtractOptions(dim=args.dim, clamp_quantile=args.clamp_quantile, min_diff=args.min_diff,
                              device=args.device)  # fmt: skip
        state = extract_from_state_dicts(names, org, tuned, opts)
        meta = self.metadata(org, args)
        ranks = sorted({rank for rank, _ in output_ranks(state).values()})  # --dim caps at each module's size
        if len(ranks) == 1:
            meta["ss_network_dim"], meta["ss_network_alpha"] = str(ranks[0]), str(float(ranks[0]))
        elif ranks:
            meta["ss_network_dim"] = meta["ss_network_alpha"] = "Dynamic"  # as merged / resized files say it
        path = save_adapter(state, args.save_to, meta, dtype_of(args.save_precision),
                            no_metadata=args.no_metadata)  # fmt: skip
        print(f"extracted {len(state) // 3} of {len(names)} modules into {path}")
        return path

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
        return main_guard(lambda: self.run(argv))
