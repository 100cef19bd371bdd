"""The training loop every recipe shares: adapters (train_network.py), token embeddings (train_textual_inversion.py)
and whole models (fine_tune.py, train_db.py) run the same loop around their Trainable.

One optimizer step per accumulation window: the micro-batches' losses are back-propagated, the window's status
(loss, NaN / stop flags) is reduced over processes once, then every process steps, stops or fails together. Saves,
samples and validation happen after the step (``Trainer.after_step``) and at epoch ends; Ctrl-C saves a resumable
state after the current step.
"""

from __future__ import annotations

from typing import Any

import torch

from library.cli.console import print_error
from library.files.weights import SaveError
from library.optim import effective_lrs, make_optimizer, make_scheduler, step_without_optimizer
from library.run import memory_watch
from library.run import setup as run_setup
from library.run.train_step import Interrupt, LossTracker, NonFiniteLoss, batch_loss, check_finite
from library.run.trainable import prepare_for_training
from library.run.trainer import Result, Trainer


def train(run: run_setup.Run, trainable: Any, groups: list[dict]) -> Result:
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
    watch = run.watch or memory_watch.for_run(cfg, run.accelerator.device)  # slow steps, full card, short host
    watch.restart()

    stop = False  # Ctrl-C / SIGTERM on any process
    with Interrupt() as interrupt:
        try:
            for epoch in range(trainer.epoch, num_epochs):
                if trainer.step >= max_steps:  # resumed at the budget (only the final file was missing)
                    break
                trainer.begin_epoch(epoch)
                for batch in loader.epoch(epoch, skip=trainer.skip_batches(epoch)):
                    with trainer.micro_batch():  # DDP-wrapped models sync gradients at the window's end only
                        loss = batch_loss(trainer.models(), batch, trainer.generator).mean()
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
                                 **effective_lrs(optimizer), **watch.step_done(trainer.step)})  # fmt: skip
                    trainer.after_step()  # step saves, samples, validation
                    watch.restart()  # their time is not step time
                    # one process stops at once; several decide together at their next step (window_status)
                    stop = status.stop or (interrupt.requested and run.accelerator.num_processes == 1)
                    if stop or trainer.step >= max_steps:
                        break
                if stop and trainer.step < max_steps:  # at the last step: finish normally
                    trainer.save_state(interrupted=True)
                    return trainer.result(interrupted=True)
                trainer.log({"loss/epoch_average": tracker.end_epoch()})
                trainer.end_epoch(epoch + 1)  # epoch saves, samples, validation
                watch.restart()
                if trainer.step >= max_steps:
                    break
        except NonFiniteLoss as e:  # raised on every process together (trainer.check_finite)
            if run.accelerator.is_main_process:
                print_error(e)
            return trainer.result(failed=str(e))
        except SaveError as e:  # disk full / I/O error: the file is named, earlier files stand
            return trainer.stop_after_save_error(e)
    return trainer.finish()  # final file (+ EMA file), final state, summary line
