"""Plan a training command's memory without running it: the same as adding ``--plan_memory`` to it.

    python tools/plan_memory.py flux_train_network.py --pretrained_model_name_or_path flux1-dev.safetensors \
        --clip_l clip_l.safetensors --t5xxl t5xxl.safetensors --ae ae.safetensors --dataset_config data.toml \
        --network_module networks.lora_flux --network_dim 16 --fp8_base --gradient_checkpointing --vram 12

SCRIPT is a training script of this repository (its file name; a path to it works too), followed by its flags,
unchanged. The command runs one step, one sampling round (when it samples) and one save on a simulated device,
reading the model files' headers only, with its outputs in a temporary folder; the table gives the device and host
memory per phase (library/measure/plan.py). ``--vram GB`` / ``--ram GB`` say whether it fits; ``--plan_memory_json
PATH`` writes the plan as JSON. Exit status 0 after a plan, 2 for a command the script refuses.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: import the repository, not this folder
    sys.path[0] = str(ROOT)

from library.cli.main_guard import main_guard  # noqa: E402


def training_scripts() -> list[str]:
    """The repository's training scripts (the root files that take ``--plan_memory``)."""
    return sorted(p.name for p in ROOT.glob("*.py") if "train" in p.stem and "--plan_memory" not in p.stem)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        usage="python tools/plan_memory.py SCRIPT [its flags...] [--vram GB] [--ram GB] [--plan_memory_json PATH]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="training scripts: " + " ".join(training_scripts()),
    )
    parser.add_argument("script", help="a training script of this repository (its file name)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the script's flags, unchanged")
    return parser


def run(argv: Sequence[str] | None = None) -> dict:
    """Plan the command; returns the plan (library/measure/plan.py)."""
    from library.measure.plan import plan_command

    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    script = Path(args.script).name
    if script not in training_scripts():
        raise ValueError(f"{args.script}: not a training script of this repository; give one of "
                         f"{', '.join(training_scripts())}, then its flags")  # fmt: skip
    module = importlib.import_module(script.removesuffix(".py"))
    flags = args.flags + ([] if "--plan_memory" in args.flags else ["--plan_memory"])
    return plan_command(lambda: module.run(flags), script=script)


def main(argv: Sequence[str] | None = None) -> int:
    def planned() -> None:
        run(argv)

    return main_guard(planned)


if __name__ == "__main__":
    sys.exit(main())
