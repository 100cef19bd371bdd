"""Train a LoRA-family adapter (LoRA, LoCon, LoHa, LoKr, DoRA) for SD 1.x / 2.x; SDXL: sdxl_train_network.py.

    accelerate launch train_network.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml --output_dir out --network_module networks.lora --network_dim 16

Takes sd-scripts' flags with the same meaning (``--config_file`` TOML too). ``python train_network.py --demo``
trains a LoRA on a tiny model and example images the repo makes itself (no download).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from library.cli import deferred_imports
from library.cli.main_guard import main_guard
from library.cli.parse import parse_args
from library.cli.problems import ConfigError, Problems
from library.families.registry import network_module_problems
from library.measure import plan as memory_plan  # noqa: F401 - registers the --plan_memory planner
from library.run import args as arg_groups
from library.run import config as run_config
from library.run import demo, run_files
from library.run import setup as run_setup
from library.run.loop import train
from library.run.token_embeddings import EmbeddingsConfig, add_embeddings
from library.run.trainer import Result
from networks.config import NetworkConfig, add_network_args
from networks.demo_check import show_it_loads
from networks.inject import prepare_network

FAMILIES = ("sd1", "sd2")  # the first is what --demo builds


def build_parser(
    description: str | None = __doc__, block_swap: bool = False, family_names: Sequence[str] = FAMILIES
) -> argparse.ArgumentParser:
    """The flags of train_network.py, then those of ``family_names``' own (their load, objective and training
    flags: ``family.options``); ``block_swap``: the block-swap flags read (DiT scripts), not refused."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_demo_args(parser)
    # run groups, optimizer, network, embeddings, sampling, config
    arg_groups.add_network_training_groups(parser, add_network_args, block_swap=block_swap)
    return run_config.script_options(tuple(family_names)).add_args(parser, training=True)


@dataclass(frozen=True)
class AdapterMethod:
    """What this recipe trains: the adapter network, and new token embeddings with it (pivotal tuning)."""

    network: NetworkConfig
    embeddings: EmbeddingsConfig

    trained_parts = ()  # the adapter and the token rows are tensors of their own
    fused_backward_pass = False
    no_token_padding = False

    @property
    def trains_text_encoder(self) -> bool:
        return self.network.trains_text_encoder or bool(self.embeddings.specs)

    def resume_settings(self) -> dict[str, Any]:
        """The network config's fields (a state records its shape-giving ones)."""
        return {f.name: getattr(self.network, f.name) for f in dataclasses.fields(self.network)}

    def with_text_cached(self) -> AdapterMethod | None:
        """With every text-encoder output cached: the denoiser's adapters only, when the text encoders' come from
        the module's default (sd-scripts stops with an assertion; its Anima and SDXL docs' command lines hit it);
        None when they were asked for (``--network_train_text_encoder_only``, pivotal tuning's new tokens)."""
        if self.network.train_text_encoder_only or self.embeddings.specs:
            return None
        return dataclasses.replace(self, network=dataclasses.replace(self.network, train_unet_only=True))

    def deepspeed_plugin(self, cfg: Any) -> None:
        return None

    def check_plan(self, plan: Any) -> list[str]:
        return []

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdapterMethod:
        problems = Problems()
        values = [problems.read(reader, args) for reader in (NetworkConfig.from_args, EmbeddingsConfig.from_args)]
        problems.raise_if_any()
        return cls(*values)


def run(
    argv: Sequence[str] | None = None,
    family_names: Sequence[str] = FAMILIES,
    parser: Callable[[], argparse.ArgumentParser] | None = None,
) -> Result | None:
    """Train an adapter. ``family_names``: the families the script takes; ``parser``: builds the script's parser
    (default :func:`build_parser`)."""
    build = parser or functools.partial(build_parser, family_names=family_names)
    args = parse_args(build(), demo.expand(argv, family_names))  # --config_file merged; --demo filled in
    if args is None:  # --output_config wrote the file
        return None
    cfg = run_config.read_config(args, tuple(family_names), AdapterMethod.from_args)  # all errors at once
    problems = network_module_problems(cfg.method.network.module, cfg.family)  # another family's own module
    if problems:
        raise ConfigError(problems)
    if run_files.nothing_left(cfg.save, cfg.run):  # --resume of a finished run: say so, write nothing
        return None
    run = run_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    run_setup.release_unused_parts(run)  # the VAE / text encoders whose outputs are all cached
    network = prepare_network(cfg.method.network, run.family.adapter_roots(run.parts), run.family.target_classes)
    network.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    groups = network.param_groups(cfg.optim.unet_lr, cfg.optim.text_encoder_lr, cfg.optim.learning_rate)
    trainable, groups = add_embeddings(run, network, groups, cfg.method.embeddings, cfg.optim.learning_rate)
    result = train(run, trainable, groups)
    if args.demo and run.accelerator.is_main_process and result.output is not None:
        show_it_loads(result.output, cfg.model.path, run.family)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
