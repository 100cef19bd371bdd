"""Train a LoRA-family adapter (LoRA, LoCon, LoHa, LoKr, DoRA) for SD 1.x / 2.x; SDXL: sdxl_train_network.py.

    accelerate launch train_network.py --pretrained_model_name_or_path model.safetensors \
        --dataset_config dataset.toml --output_dir out --network_module networks.lora --network_dim 16

Takes sd-scripts' flags with the same meaning (``--config_file`` TOML too). ``python train_network.py --demo``
trains a LoRA on a tiny model and example images the repo makes itself (no download).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from library import args as arg_groups
from library import deferred_imports, demo
from library.config import parse_args
from library.logs import print_error
from library.optim import effective_lrs, make_optimizer, make_scheduler, step_without_optimizer
from library.problems import Problems
from library.run import resume, train_setup
from library.run.train_step import Interrupt, LossTracker, NonFiniteLoss, batch_loss, check_finite
from library.run.trainable import prepare_for_training
from library.run.trainer import Result, Trainer
from library.token_embeddings import EmbeddingsConfig, add_embeddings
from library.weight_files import SaveError
from networks.config import NetworkConfig, add_network_args
from networks.inject import prepare_network
from networks.tool_common import main_guard


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_demo_args(parser)
    # run groups, optimizer, network, embeddings, sampling, config
    arg_groups.add_network_training_groups(parser, add_network_args)
    return parser


@dataclass(frozen=True)
class AdapterMethod:
    """What this recipe trains: the adapter network, and new token embeddings with it (pivotal tuning)."""

    network: NetworkConfig
    embeddings: EmbeddingsConfig

    @property
    def trains_text_encoder(self) -> bool:
        return self.network.trains_text_encoder or bool(self.embeddings.specs)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AdapterMethod:
        problems = Problems()
        values = [problems.read(reader, args) for reader in (NetworkConfig.from_args, EmbeddingsConfig.from_args)]
        problems.raise_if_any()
        return cls(*values)


def run(argv: Sequence[str] | None = None, family_names: Sequence[str] = ("sd1", "sd2")) -> Result | None:
    args = parse_args(build_parser(), demo.expand(argv, family_names))  # --config_file merged; --demo filled in
    if args is None:  # --output_config wrote the file
        return None
    cfg = train_setup.read_config(args, tuple(family_names), AdapterMethod.from_args)  # all errors at once
    if resume.nothing_left(cfg.save, cfg.run):  # --resume of a finished run: say so, write nothing
        return None
    run = train_setup.start(cfg)  # accelerator, seed, dataset plan + bucket report, model, caches
    train_setup.release_unused_parts(run)  # the VAE / text encoders whose outputs are all cached
    network = prepare_network(cfg.method.network, run.family.adapter_roots(run.parts), run.family.target_classes)
    network.to(device=run.accelerator.device, dtype=cfg.run.train_dtype)
    groups = network.param_groups(cfg.optim.unet_lr, cfg.optim.text_encoder_lr, cfg.optim.learning_rate)
    trainable, groups = add_embeddings(run, network, groups, cfg.method.embeddings, cfg.optim.learning_rate)
    result = train(run, trainable, groups)
    if args.demo and run.accelerator.is_main_process and result.output is not None:
        demo.show_it_loads(result.output, cfg.model.path, run.family)
    return result


def train(run: train_setup.Run, trainable: Any, groups: list[dict]) -> Result:
    """The loop around a Trainable (any recipe's: adapters here, token embeddings in train_textual_inversion.py)."""
    cfg = run.cfg
    trainable = trainable.prepare(run.accelerator)  # adapters / embeddings: themselves (gradients averaged by hand)
    if cfg.run.torch_compile and trainable.gradient_sync == "manual":  # after injection: module names unchanged
        run.step_models.denoiser = torch.compile(run.parts.denoiser, backend=cfg.run.dynamo_backend)
    optimizer = make_optimizer(cfg.optim, groups)
    loader = run.make_loader()
    max_steps, num_epochs = run.step_budget(loader)
    scheduler = make_scheduler(cfg.optim, optimizer, max_steps, run.accelerator.num_processes)
    optimizer, scheduler = prepare_for_training(trainable, run.accelerator, optimizer, scheduler)
    trainer = Trainer(run, trainable, optimizer, scheduler, loader, max_steps, num_epochs)
    trainer.resume_if_asked()  # exact: weights, optimizer, scheduler, EMA, RNG, data position, counters
    trainer.sample(at_first=True)
    tracker = LossTracker(window=loader.num_batches(0))

    stop = False  # Ctrl-C / SIGTERM on any process
    with Interrupt() as interrupt:
        try:
            for epoch in range(trainer.epoch, num_epochs):
                if trainer.step >= max_steps:  # resumed at the budget (only the final file was missing)
                    break
                trainer.begin_epoch(epoch)
                for batch in loader.epoch(epoch, skip=trainer.skip_batches(epoch)):
                    with trainer.micro_batch():  # DDP-wrapped models sync gradients at the window's end only
                        loss = batch_loss(run.step_models, batch, trainer.generator).mean()
                        if trainer.steps_in_backward:  # --fused_backward_pass: check before the weights change
                            check_finite(loss, trainer.step + 1, epoch + 1)
                        if trainer.reaches_trained(loss):  # not a TI batch without its token (a no-op step)
                            run.accelerator.backward(loss * trainer.loss_scale())  # 1 / window: a mean over it
                    trainer.add_loss(loss)
                    if not trainer.batch_done():  # still accumulating gradients
                        continue
                    status = trainer.window_status(interrupt.requested)  # the same on every process
                    trainer.check_finite(status)  # NaN / inf anywhere: every process stops before stepping
                    if status.trained:
                        trainer.sync_gradients()  # average over processes, clip to --max_grad_norm
                        optimizer.step()
                        scheduler.step()
                    else:  # no process's window reached the trained tensors (TI: no caption held the token)
                        step_without_optimizer(scheduler)  # nothing moves; the learning rates follow the step
                    optimizer.zero_grad(set_to_none=True)
                    tracker.add(status.loss)
                    trainer.step_done(status.loss)  # counters, EMA, --scale_weight_norms
                    trainer.log({"loss/current": status.loss, "loss/average": tracker.average,
                                 **effective_lrs(optimizer)})  # fmt: skip
                    trainer.after_step()  # step saves, samples, validation
                    # one process stops at once; several decide together at their next step (window_status)
                    stop = status.stop or (interrupt.requested and run.accelerator.num_processes == 1)
                    if stop or trainer.step >= max_steps:
                        break
                if stop and trainer.step < max_steps:  # at the last step: finish normally
                    trainer.save_state(interrupted=True)
                    return trainer.result(interrupted=True)
                trainer.log({"loss/epoch_average": tracker.end_epoch()})
                trainer.end_epoch(epoch + 1)  # epoch saves, samples, validation
                if trainer.step >= max_steps:
                    break
        except NonFiniteLoss as e:  # raised on every process together (trainer.check_finite)
            if run.accelerator.is_main_process:
                print_error(e)
            return trainer.result(failed=str(e))
        except SaveError as e:  # disk full / I/O error: the file is named, earlier files stand
            return trainer.stop_after_save_error(e)
    return trainer.finish()  # final file (+ EMA file), final state, summary line


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
