"""The Trainer: everything around the optimizer step (sync, clipping, EMA, logs, saves, samples, state).

The loop itself stays in the entry script; it calls these methods at fixed points (see train_network.py). What
is trained is a :class:`library.run.trainable.Trainable` (adapter network, token embeddings, ...); the trainer knows
nothing else about it. Gradient accumulation is counted here explicitly and, for trainables that run inside a
frozen model DDP cannot see (``gradient_sync == "manual"``), gradients are all-reduced by hand at each optimizer
step, so every accumulation window is known exactly (needed for bitwise-exact resume).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from library.cli import console
from library.device.rng import capture_rng, restore_rng
from library.files import metadata as md
from library.files.weights import SaveError, is_state_file
from library.optim import set_train_mode
from library.run import resume, run_files
from library.run.ema import EMA
from library.run.trackers import init_trackers
from library.run.train_step import NonFiniteLoss, StepModels, non_finite_message, validation_loss

logger = logging.getLogger("sdtrain")
_TRACKER_NAMES = {"network": "network_train", "embedding": "textual_inversion"}  # sd-scripts' default run names


@dataclass
class Result:
    """What a run produced (returned by ``main`` so tests and the demo can check it)."""

    output: Path | None
    steps: int
    epochs: int
    losses: list[float]
    ema_output: Path | None = None
    state: Path | None = None
    interrupted: bool = False
    failed: str | None = None
    validation: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class WindowStatus:
    """What every process knows at an optimizer step (:meth:`Trainer.window_status`)."""

    loss: float  # the window's mean loss, averaged over processes
    non_finite: bool  # some process saw a NaN / inf loss in the window
    stop: bool  # some process was asked to stop (Ctrl-C / SIGTERM)
    trained: bool = True  # some process's window reached the trained tensors (else the step changes nothing)


class Trainer:
    def __init__(
        self, run: Any, trainable: Any, optimizer: Any, scheduler: Any, loader: Any, max_steps: int, num_epochs: int
    ):
        self.run, self.cfg, self.acc = run, run.cfg, run.accelerator
        self.trainable, self.optimizer, self.scheduler, self.loader = trainable, optimizer, scheduler, loader
        self.max_steps, self.num_epochs = max_steps, num_epochs
        self.params = [p for p in trainable.parameters() if p.requires_grad]
        # --fused_backward_pass / --fused_optimizer_groups: the optimizer steps inside backward
        self.steps_in_backward = getattr(trainable, "fused", None) is not None
        self.generator = torch.Generator().manual_seed(self.cfg.run.seed + 1009 * self.acc.process_index)
        self.epoch = 0  # epoch index (0-based) the loop starts at
        self.step = 0  # optimizer steps done
        self.batches_in_epoch = 0  # batches consumed in the current epoch (this process)
        self.window = 0  # batches in the current accumulation window
        self._window_loss: torch.Tensor | None = None  # sum of the window's batch losses, on the device
        self._window_batches = 0
        self._window_trained = False  # a batch of the window reached the trained tensors (this process)
        self.current_epoch, self.epoch_batches = 0, loader.num_batches(0)  # set by begin_epoch / resume_if_asked
        self.log_run: str | None = None  # this run's folder under --logging_dir (kept in the state)
        self._resume_skip: tuple[int, int] | None = None
        self.losses: list[float] = []
        self.validation: list[tuple[int, float]] = []
        self.started_at = time.time()
        ema_cfg = self.cfg.ema
        self.ema = (
            EMA(
                self.params, ema_cfg.ema_decay, ema_cfg.ema_update_every, "cpu" if ema_cfg.ema_device == "cpu" else None
            )
            if ema_cfg.ema
            else None
        )
        self._broadcast_initial_weights()
        self._remove_unfinished_states()
        self._set_training(True)
        self._init_trackers()
        self.progress = self._progress_bar()

    # -------------------------------------------------------------------------------------------- set-up
    def _broadcast_initial_weights(self) -> None:
        if self.acc.num_processes > 1 and self.trainable.gradient_sync == "manual":
            from accelerate.utils import broadcast

            with torch.no_grad():
                for p in self.trainable.parameters():
                    p.copy_(broadcast(p.detach().clone(), from_process=0))

    def _remove_unfinished_states(self) -> None:
        """State folders a killed process left half-written (``*-state.partial``): never resumed from, so gone."""
        if self.acc.is_main_process:
            for folder in run_files.unfinished_states(self.cfg.save):
                shutil.rmtree(folder, ignore_errors=True)
                logger.warning("removed %s: an unfinished state folder left by an interrupted save", folder)

    def _set_training(self, mode: bool) -> None:
        self.trainable.set_training(mode)
        set_train_mode(self.optimizer, mode)

    def _init_trackers(self) -> None:
        trackers = self.cfg.trackers
        if not trackers.trackers:
            return
        name = trackers.log_tracker_name or _TRACKER_NAMES.get(self.trainable.kind, "finetuning")
        secret = ("wandb_api_key", "huggingface_token")  # never logged (sd-scripts removes them too)
        config = {k: v for k, v in self.cfg.args.items() if isinstance(v, (int, float, str, bool)) and k not in secret}
        if not trackers.log_config:
            config = {}
        init_kwargs = {}
        if trackers.log_tracker_config:
            import toml

            init_kwargs = toml.load(trackers.log_tracker_config)
        if "wandb" in trackers.trackers and trackers.wandb_run_name:
            init_kwargs.setdefault("wandb", {})["name"] = trackers.wandb_run_name
        trackers.login()
        self.log_run = init_trackers(self.acc, trackers, self.cfg.save.resume, config, init_kwargs, name)

    def _progress_bar(self):
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, desc="steps", disable=not self.acc.is_local_main_process, smoothing=0.1)

    # -------------------------------------------------------------------------------------------- the loop's hooks
    def begin_epoch(self, epoch: int) -> None:
        self.current_epoch = epoch
        skip = self.skip_batches(epoch)
        self.batches_in_epoch = skip
        self.window = 0
        self.epoch_batches = self.loader.num_batches(epoch)
        logger.info("epoch %d/%d", epoch + 1, self.num_epochs)

    def skip_batches(self, epoch: int) -> int:
        if self._resume_skip and self._resume_skip[0] == epoch:
            return self._resume_skip[1]
        return 0

    def loss_scale(self) -> float:
        """1 / size of this batch's accumulation window (the last window of an epoch may be shorter)."""
        accum = self.cfg.run.gradient_accumulation_steps
        start = (self.batches_in_epoch // accum) * accum
        return 1.0 / min(accum, self.epoch_batches - start)

    def closes_window(self) -> bool:
        """Whether the next batch closes its accumulation window (its backward is followed by an optimizer step)."""
        accum = self.cfg.run.gradient_accumulation_steps
        return self.window + 1 >= accum or self.batches_in_epoch + 1 >= self.epoch_batches

    def models(self) -> StepModels:
        """What the step runs: the run's step inputs as the trainable changes them (its wrapped model, stopped
        text-encoder training, caption rewrites), asked afresh each step."""
        return self.trainable.step_models(self.run.step_models)

    def micro_batch(self) -> contextlib.AbstractContextManager:
        """The context of one batch's forward and backward: for a model DDP wraps (full fine-tuning on several
        processes), gradients are not all-reduced for batches inside an accumulation window, only at its end."""
        model = self.models().denoiser
        if self.trainable.gradient_sync == "accelerate" and self.acc.num_processes > 1 and not self.closes_window():
            return self.acc.no_sync(model)
        return contextlib.nullcontext()

    def add_loss(self, loss: torch.Tensor) -> None:
        """Count one batch's mean loss into its window, on the device (no host read)."""
        value = loss.detach().float()
        self._window_loss = value if self._window_loss is None else self._window_loss + value
        self._window_batches += 1

    def reaches_trained(self, loss: torch.Tensor) -> bool:
        """Whether the batch's backward pass is needed: ``loss`` depends on the trained tensors. A textual-inversion
        batch whose captions all lack the token does not (the trainable's ``may_sit_out``): it is counted and makes
        its random draws like any batch, and trains nothing. For other trainables the backward always runs (a loss
        without gradient there is a bug, and torch says so)."""
        reaches = loss.requires_grad or not getattr(self.trainable, "may_sit_out", False)
        self._window_trained |= reaches
        return reaches

    def window_status(self, interrupted: bool) -> WindowStatus:
        """At an optimizer step: the window's mean loss, whether any process saw a non-finite loss, whether any was
        interrupted, whether any trained something, in one reduction over the processes and one read on the host
        (the step's only one). Every process gets the same answer, so all of them step, stop or fail together
        instead of one waiting for the others in the next collective."""
        mean = self._window_loss / max(1, self._window_batches)
        flags = (float(interrupted), float(self._window_trained))
        values = torch.stack([mean, (~torch.isfinite(mean)).float(), *(mean.new_full((), f) for f in flags)])
        if self.acc.num_processes > 1:
            values = self.acc.reduce(values, reduction="sum")
        total, non_finite, stop, trained = values.tolist()
        if self.acc.num_processes == 1:  # the host's own flags: on the simulated device (--plan_memory) a host read
            stop, trained = flags  # is zero, and the optimizer step (its state's memory) must still be planned
        self._window_loss, self._window_batches, self._window_trained = None, 0, False
        if stop and not interrupted and self.acc.is_main_process:
            print("\nanother process was interrupted: saving a resumable state after this step")
        return WindowStatus(total / self.acc.num_processes, non_finite > 0, stop > 0, trained > 0)

    def check_finite(self, status: WindowStatus) -> None:
        """Raise :class:`NonFiniteLoss` (on every process) when a process saw a NaN / inf loss in the window; the
        optimizer has not stepped, so the weights and every file saved so far are the last good ones."""
        if status.non_finite:
            raise NonFiniteLoss(non_finite_message(status.loss, self.step + 1, self.current_epoch + 1))

    def batch_done(self) -> bool:
        """Count the batch; True when it closes an accumulation window (time for the optimizer step)."""
        self.batches_in_epoch += 1
        self.window += 1
        accum = self.cfg.run.gradient_accumulation_steps
        if self.window >= accum or self.batches_in_epoch >= self.epoch_batches:
            self.window = 0
            return True
        return False

    def sync_gradients(self) -> None:
        """Average gradients over processes, then clip to --max_grad_norm (0 = off)."""
        if self.acc.num_processes > 1 and self.trainable.gradient_sync == "manual":
            sparse = self.trainable.sparse_gradients
            if sparse:  # which tensors got a gradient on some process (one host read, only for such trainables)
                had = torch.tensor([p.grad is not None for p in self.params], device=self.acc.device).float()
                had = self.acc.reduce(had, reduction="sum").tolist()
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad = self.acc.reduce(p.grad, reduction="mean")
            if sparse:
                for p, n in zip(self.params, had):
                    if n == 0:
                        p.grad = None
        if self.cfg.optim.max_grad_norm:
            self.acc.clip_grad_norm_(self.params, self.cfg.optim.max_grad_norm)

    def step_done(self, loss: float) -> None:
        self.step += 1
        self.losses.append(loss)
        logs = self.trainable.after_step()  # e.g. --scale_weight_norms, frozen embeddings; EMA sees the result
        if self.ema is not None:
            self.ema.update(self.step)
        self.progress.update(1)
        self.pending_logs = logs

    def log(self, values: dict[str, float]) -> None:
        values = {**values, **getattr(self, "pending_logs", {})}
        self.pending_logs = {}
        if "loss/average" in values:
            self.progress.set_postfix(loss=f"{values['loss/average']:.4f}", refresh=False)
        if self.cfg.trackers.trackers:
            self.acc.log(values, step=self.step)

    def after_step(self) -> None:
        save = self.cfg.save
        if run_files.save_step_now(save, self.step, self.max_steps):
            self.save_model(run_files.model_file(save, step=self.step), step=self.step)
            run_files.rotate(save, step=self.step) if self.acc.is_main_process else None
            if save.save_state:
                self.save_state(run_files.state_dir(save, step=self.step))
        self.sample(step=self.step)
        v = self.cfg.validation
        if v.validate_every_n_steps and self.step % v.validate_every_n_steps == 0:
            self.validate()

    def end_epoch(self, epoch_number: int) -> None:
        """``epoch_number`` is 1-based (the epoch just finished)."""
        self.epoch = epoch_number
        save = self.cfg.save
        if run_files.save_epoch_now(save, epoch_number, self.num_epochs):
            self.save_model(run_files.model_file(save, epoch=epoch_number), epoch=epoch_number)
            if self.acc.is_main_process:
                run_files.rotate(save, epoch=epoch_number, num_epochs=self.num_epochs)
            if save.save_state:
                self.save_state(run_files.state_dir(save, epoch=epoch_number))
        self.sample(epoch=epoch_number)
        v = self.cfg.validation
        if self.run.validation_loader is not None and (
            (v.validate_every_n_epochs and epoch_number % v.validate_every_n_epochs == 0)
            or (not v.validate_every_n_epochs and not v.validate_every_n_steps)
        ):
            self.validate()

    # -------------------------------------------------------------------------------------------- samples, validation
    def _eval_context(self):
        import contextlib

        stack = contextlib.ExitStack()
        self._set_training(False)
        stack.callback(self._set_training, True)
        if self.ema is not None:
            stack.enter_context(self.ema.applied())
        return stack

    def sample(self, *, step: int | None = None, epoch: int | None = None, at_first: bool = False) -> None:
        """Sample if --sample_* asks for it now (``at_first``: before training, step 0)."""
        from library import sampling

        if at_first:
            step, epoch = 0, 0  # sd-scripts names the first round e000000
        if not sampling.should_sample(self.cfg.sample, step=step, epoch=epoch):
            return
        cfg = self.cfg.sample
        with self._eval_context():  # every process generates its share of the prompts (library/sampling/training.py)
            sampling.sample_during_training(
                cfg,
                self.run.family,
                self.run.parts,
                output_dir=self.cfg.save.output_dir,
                output_name=self.cfg.save.output_name,
                step=step if step is not None else self.step,
                epoch=epoch,
                accelerator=self.acc,
                conds=self.run.sample_conds,
                control=getattr(self.trainable, "sample_control", None),  # a ControlNet's --cn images
            )

    def validate(self) -> float | None:
        loader = self.run.validation_loader
        if loader is None:
            return None
        v = self.cfg.validation
        seed = v.validation_seed if v.validation_seed is not None else self.cfg.run.seed
        timesteps = self.run.step_models.objective.validation_timesteps()
        with self._eval_context():
            value = validation_loss(self.models(), loader.epoch(0), seed, timesteps, v.max_validation_steps)
        value = float(self.acc.reduce(torch.tensor(value, device=self.acc.device), "mean"))
        self.validation.append((self.step, value))
        logger.info("validation loss at step %d: %.5f", self.step, value)
        self.log({"loss/validation": value})
        return value

    # -------------------------------------------------------------------------------------------- saving
    def unwrapped(self):
        return self.acc.unwrap_model(self.trainable)

    def save_model(self, path: Path, *, step: int | None = None, epoch: int | None = None) -> Path | None:
        """Write the trained file (and ``<stem>-ema`` with EMA) on the main process, atomically, with metadata. A
        failed write raises :class:`SaveError` on every process (they stop together)."""
        self.acc.wait_for_everyone()
        error = None
        if self.acc.is_main_process:
            try:
                self._write_model(path, step=step, epoch=epoch)
            except SaveError as e:
                error = e
        self._raise_everywhere(error)
        return path if self.acc.is_main_process else None

    def _raise_everywhere(self, error: SaveError | None) -> None:
        """The main process's save outcome on every process: raise its SaveError everywhere, or nothing."""
        if self.acc.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            sent = [None if error is None else (str(error), str(getattr(error, "path", "")))]
            message = broadcast_object_list(sent, from_process=0)[0]
            if message is not None and error is None:
                error = SaveError(message[0])
                error.path = Path(message[1]) if message[1] else None
        if error is not None:
            raise error

    def _write_model(self, path: Path, *, step: int | None = None, epoch: int | None = None) -> None:
        set_train_mode(self.optimizer, False)
        try:
            trained = self.unwrapped()
            meta = self.file_metadata(step=step, epoch=epoch)
            dtype = self.cfg.save.dtype
            trained.save(path, metadata=_with_hashes(trained, dtype, {**trained.metadata(), **meta}), dtype=dtype)
            logger.info("saved %s", path)
            if self.ema is not None:
                with self.ema.applied():
                    ema_path = path.with_name(path.stem + "-ema" + path.suffix)
                    ema_meta = _with_hashes(trained, dtype, {**trained.metadata(), **meta})
                    trained.save(ema_path, metadata=ema_meta, dtype=dtype)
        finally:
            set_train_mode(self.optimizer, True)

    def file_metadata(self, *, step: int | None = None, epoch: int | None = None) -> dict[str, str]:
        from library.run.run_metadata import file_metadata

        return file_metadata(self, step=step, epoch=epoch)

    def save_state(self, folder: Path | None = None, *, interrupted: bool = False) -> Path:
        """Every process contributes its RNG states; the main process writes the folder atomically."""
        save = self.cfg.save
        if folder is None:
            folder = run_files.state_dir(save, step=self.step) if interrupted else run_files.state_dir(save)
        rng = capture_rng({"generator": self.generator})
        rngs = self.acc.gather_for_metrics([rng], use_gather_object=True) if self.acc.num_processes > 1 else [rng]
        error = None
        try:
            if self.acc.is_main_process:
                self._write_state(folder, rngs, interrupted)
        except SaveError as e:
            error = e
        self._raise_everywhere(error)  # every process stops when the main one could not write
        return folder

    def _write_state(self, folder: Path, rngs: list, interrupted: bool) -> None:
        """The state folder, atomically (main process)."""
        save = self.cfg.save
        counters = {
            "epoch": self.current_epoch if self.batches_in_epoch < self.epoch_batches else self.current_epoch + 1,
            "batches_in_epoch": self.batches_in_epoch if self.batches_in_epoch < self.epoch_batches else 0,
            "step": self.step,
            "seed": self.cfg.run.seed,
            "num_processes": self.acc.num_processes,
            "losses": self.losses,
            "family": self.run.family.name,
            "settings": resume.settings_of(self.cfg.method, self.cfg.optim.optimizer_type),
            "log_run": self.log_run,
        }
        scaler = getattr(self.acc, "scaler", None)
        run_files.save_train_state(
            folder,
            trained=self.unwrapped().state_dict(),
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            counters=counters,
            rngs=rngs,
            ema=self.ema,
            scaler=scaler,
        )
        if save.save_last_n_steps_state and not interrupted:
            run_files.rotate(save, step=self.step)
        logger.info("saved state %s%s", folder, " (resume with --resume " + str(folder) + ")" if interrupted else "")

    def resume_if_asked(self) -> None:
        folder = self.cfg.save.resume
        if not folder:
            return
        state = run_files.load_train_state(folder, self.acc.process_index)  # ValueError naming a damaged file
        counters = state["counters"]
        resume.check_family(folder, counters, self.run.family.name)
        if counters.get("num_processes", 1) != self.acc.num_processes:
            raise ValueError(
                f"--resume {folder}: the state was saved with {counters.get('num_processes')} processes, this run "
                f"has {self.acc.num_processes}; resume with the same number of processes"
            )
        resume.load_into(folder, self.unwrapped(), self.optimizer, self.scheduler, state)
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        if "scaler" in state and getattr(self.acc, "scaler", None) is not None:
            self.acc.scaler.load_state_dict(state["scaler"])
        if state["rng"] is not None:
            restore_rng(state["rng"], {"generator": self.generator})
        self.epoch, self.step = counters["epoch"], counters["step"]
        self.losses = list(counters.get("losses", []))
        self._resume_skip = (counters["epoch"], counters["batches_in_epoch"])
        self.current_epoch, self.batches_in_epoch = counters["epoch"], counters["batches_in_epoch"]
        self.epoch_batches = self.loader.num_batches(self.current_epoch)
        self.progress.update(self.step)
        given = Path(self.cfg.save.resume_given or folder).resolve()
        picked = "" if given == Path(folder).resolve() else f" (the newest state in {given})"
        logger.info("resumed from %s%s at step %d (epoch %d)", folder, picked, self.step, self.epoch + 1)

    # -------------------------------------------------------------------------------------------- the end
    def check_processes_agree(self) -> None:
        """Multi-process runs: every process must hold the same trained weights (gradients are averaged)."""
        if self.acc.num_processes == 1:
            return
        local = torch.stack([p.detach().double().sum() for p in self.params]).sum().reshape(1).to(self.acc.device)
        values = self.acc.gather(local)
        if not torch.equal(values, values[:1].expand_as(values)):
            raise RuntimeError(f"the processes' trained weights differ ({values.tolist()}); please report this bug")

    def finish(self) -> Result:
        self.check_processes_agree()
        save = self.cfg.save
        path = run_files.model_file(save)
        state = None
        try:
            self.save_model(path, step=self.step, epoch=self.epoch)
            if save.save_state or save.save_state_on_train_end:
                state = self.save_state(run_files.state_dir(save))
        except SaveError as e:
            return self.stop_after_save_error(e)
        self.acc.end_training()
        self.progress.close()
        ema_path = path.with_name(path.stem + "-ema" + path.suffix) if self.ema is not None else None
        if self.acc.is_main_process:
            summary = {"output": str(path), "steps": self.step, "seconds": round(time.time() - self.started_at, 1)}
            if self.losses:
                summary["final_loss_average"] = round(sum(self.losses[-20:]) / len(self.losses[-20:]), 5)
            print("training finished: " + json.dumps(summary))
        return Result(path, self.step, self.epoch, self.losses, ema_path, state, validation=self.validation)

    def result(self, *, interrupted: bool = False, failed: str | None = None) -> Result:
        self.progress.close()
        return Result(None, self.step, self.epoch, self.losses, interrupted=interrupted, failed=failed)

    def stop_after_save_error(self, error: SaveError) -> Result:
        """A save failed (disk full, I/O error): say which file, then leave a resumable state if one can still be
        written (not when the state itself was what failed)."""
        if self.acc.is_main_process:
            console.print_error(error)
        if not is_state_file(error):  # every process takes part (the state gathers their RNG states)
            try:
                self.save_state(interrupted=True)
            except SaveError as e:
                if self.acc.is_main_process:
                    print(f"no resumable state could be written either: {e}", file=sys.stderr)
        return self.result(failed=str(error))


def _with_hashes(trained: Any, dtype: Any, metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` plus the file's ``sshs_*`` hashes where the trainable's file carries them (adapters, embeddings)."""
    tensors = trained.state_dict_for_file(dtype)
    return metadata if tensors is None else md.with_hashes(tensors, metadata)
