"""One training step's loss (``batch_loss``), validation loss, the NaN guard, Ctrl-C and loss averages.

The diffusion training step shared by every trainer, plus validation and the NaN guard.

One function computes the loss of a batch (:func:`batch_loss`); training, validation and the loss-falls tests all
call it, so they cannot drift apart. Every random draw of a step (VAE latent sample, noise, timesteps, masked-loss
draws) comes from one ``torch.Generator`` that the trainer keeps in its resumable state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from library.device.placement import to_device
from library.families.base import Cond, Parts
from library.families.protocol import ModelFamily
from library.objectives.base import Objective
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite; the run stops and the files saved so far stay as they are."""


@dataclass
class StepModels:
    """What one training step needs (``denoiser`` may differ from ``parts.denoiser``, e.g. a torch.compile'd one).

    ``objective``: the family's training objective (``family.training_objective``), which the step asks for noise,
    target and loss; ``noise`` / ``loss``: the run's settings it was built from (what metadata records)."""

    family: ModelFamily
    parts: Parts
    objective: Objective
    noise: NoiseConfig
    loss: LossConfig
    denoiser: nn.Module
    clip_skip: int | None = None
    max_token_length: int | None = None
    pad_tokens: bool = True  # False: train_db.py's --no_token_padding (captions padded to the batch's longest only)
    train_text_encoder: bool = False
    weighted_captions: bool = False
    device: torch.device = torch.device("cpu")
    weight_dtype: torch.dtype = torch.float32
    # captions -> captions before encoding (textual inversion: templates, multi-vector tokens); may draw from the
    # step's generator
    caption_rewrite: Callable[[list[str], torch.Generator | None], list[str]] | None = None
    # takes each batch's conditioning images (B, 3, H, W) before the prediction (ControlNet-LLLite's network)
    conditioning: Callable[[Tensor | None], None] | None = None


def batch_latents(m: StepModels, batch: Any, generator: torch.Generator | None) -> Tensor:
    """Cached latents, or the VAE encoding of the batch's pixels (B, 4, H/8, W/8), on the training device."""
    if batch.latents is not None:
        return to_device(batch.latents, m.device)
    vae = m.parts.vae
    with torch.no_grad():
        pixels = to_device(batch.pixels, m.device, next(vae.parameters()).dtype)
        return m.family.encode_latents(m.parts, pixels, generator).to(torch.float32)


def batch_references(m: StepModels, batch: Any, generator: torch.Generator | None) -> list[Tensor]:
    """The batch's control images as latents on the training device (cached, or encoded here like the targets'
    pixels), one (B, C, h, w) per control index; [] without control images."""
    controls = getattr(batch, "controls", None)
    if not controls:
        return []
    if batch.latents is not None:
        return [to_device(c, m.device, m.weight_dtype) for c in controls]
    dtype = next(m.parts.vae.parameters()).dtype
    with torch.no_grad():
        return [m.family.encode_latents(m.parts, to_device(c, m.device, dtype), generator).to(m.weight_dtype)
                for c in controls]  # fmt: skip


def batch_cond(m: StepModels, batch: Any, generator: torch.Generator | None = None) -> Cond:
    """Text conditioning: cached encoder outputs, or the text encoders run on the batch's captions."""
    if batch.text_encoder_outputs is not None:
        out = batch.text_encoder_outputs
        hidden = out["hidden_states"]
        if not m.pad_tokens:  # --no_token_padding: the causal encoder's padded outputs, cut after the longest caption
            hidden = hidden[:, : m.family.tokenize(m.parts, list(batch.captions), pad=False)[0].shape[1]]
        pooled, mask = out.get("pooled"), out.get("mask")
        cond = Cond(to_device(hidden, m.device), None if pooled is None else to_device(pooled, m.device),
                    None if mask is None else to_device(mask, m.device))  # fmt: skip
        if m.train_text_encoder:  # the adapters' encoders run on the captions (FLUX.1: CLIP-L over the T5 cache)
            cond = m.family.cond_with_trained_encoders(m.parts, list(batch.captions), cond)
        return cond
    captions = list(batch.captions)
    if m.caption_rewrite is not None:
        captions = m.caption_rewrite(captions, generator)
    with torch.set_grad_enabled(m.train_text_encoder and torch.is_grad_enabled()):
        return encode_captions(m.family, m.parts, captions, m.clip_skip, m.max_token_length,
                               m.weighted_captions, pad=m.pad_tokens)  # fmt: skip


def encode_captions(
    family: ModelFamily,
    parts: Parts,
    captions: list[str],
    clip_skip: int | None,
    max_token_length: int | None,
    weighted: bool = False,
    *,
    pad: bool = True,
    controls: list[tuple] | None = None,
) -> Cond:
    """The conditioning of training captions. ``weighted`` (``--weighted_captions``): A1111 ``(tag:1.3)`` weights
    as sd-scripts applies them to captions (the prompt encoder of :mod:`library.text.prompt_weighting`, one 75-token
    chunk per 75 of ``--max_token_length``); otherwise the family's plain encoding, brackets kept as text.
    ``pad=False`` (``--no_token_padding``, plain encoding only): ids padded to the batch's longest caption.
    ``controls``: each caption's control images as (path, (width, height) trained at), for a family whose prompts
    see them (its options' ``prompt_control_images``: the Qwen-Image edit models)."""
    if not weighted:
        unpadded = {} if pad else {"pad": False}  # only the families train_db.py loads take it
        seen = {} if controls is None else {"controls": controls}  # prompt encoders that see the control images
        return family.encode_prompt(parts, captions, clip_skip=clip_skip, max_token_length=max_token_length,
                                    **unpadded, **seen)  # fmt: skip
    if not pad:
        raise ValueError("--no_token_padding with --weighted_captions is not supported yet; drop one of the two")
    from library.text.prompt_weighting import encode_weighted

    chunks = (max_token_length or 75) // 75
    return encode_weighted(family, parts, captions, clip_skip=clip_skip, max_embeddings_multiples=chunks)


def text_cache_entry(cond: Cond) -> dict[str, Tensor]:
    """What the text-encoder-output cache stores for one encoding (see :func:`batch_cond`)."""
    out = {"hidden_states": cond.hidden_states}
    if cond.pooled is not None:
        out["pooled"] = cond.pooled
    if cond.mask is not None:  # FLUX's T5 attention mask (--apply_t5_attn_mask, Chroma)
        out["mask"] = cond.mask
    return out


def batch_loss(
    m: StepModels,
    batch: Any,
    generator: torch.Generator | None,
    *,
    timesteps: Tensor | None = None,
) -> Tensor:
    """Per-sample loss (B,) float32 of one batch: encode, noise, predict, loss (sd-scripts' order, section 7), the
    noising, target, prediction type and weighting being the objective's. ``timesteps`` (B,): noise at these (what
    the family's ``predict`` receives) instead of drawing them."""
    latents = batch_latents(m, batch, generator)
    cond = batch_cond(m, batch, generator).to(m.device, m.weight_dtype)
    example = m.objective.example(latents, generator, timesteps=timesteps)
    time_ids = m.family.size_conditioning(batch.original_sizes, batch.crop_top_lefts, batch.target_sizes)
    if m.conditioning is not None:
        images = getattr(batch, "conditioning_images", None)
        m.conditioning(None if images is None else to_device(images, m.device, m.weight_dtype))
    refs = batch_references(m, batch, generator)  # the edit models' control images (library/data/control_images.py)
    output = m.family.predict(m.denoiser, example.noisy.to(m.weight_dtype), example.timesteps, cond,
                              time_ids=time_ids, **({"references": refs} if refs else {}),
                              **m.objective.predict_options)  # fmt: skip
    masks = to_device(batch.masks, m.device) if batch.masks is not None else None
    return m.objective.loss_per_sample(
        m.objective.prediction(output.float(), example),
        example,
        loss_weights=to_device(batch.loss_weights, output.device),
        mask=masks,
        generator=generator,
    )


def non_finite_message(value: float, step: int, epoch: int) -> str:
    """What to say when the loss became NaN / inf at ``step`` (1-based) of ``epoch`` (1-based), and what to try."""
    return (
        f"the loss became {value} at step {step} (epoch {epoch}); training stopped and the files saved so far "
        "were left as they are. Usual causes: a learning rate that is too high, fp16 overflow (try "
        "--mixed_precision bf16, or --no_half_vae for a VAE that overflows in fp16), or a corrupt image."
    )


def check_finite(loss: Tensor, step: int, epoch: int) -> None:
    """Raise :class:`NonFiniteLoss` when ``loss`` is NaN / inf (a host read: the loop uses the trainer's per-window
    check instead, library/run/trainer.py ``window_status``)."""
    value = float(loss.detach())
    if not math.isfinite(value):
        raise NonFiniteLoss(non_finite_message(value, step, epoch))


@torch.no_grad()
def validation_loss(
    m: StepModels, batches: Iterable[Any], seed: int, timesteps: list[Any], max_batches: int | None = None
) -> float:
    """Mean loss over ``batches``, one pass per entry of ``timesteps`` (``objective.validation_timesteps()``: a
    timestep every sample is noised at, or None to draw them as in training), with every draw from generators
    seeded by ``seed``, the batch and the pass.

    Deterministic: the same weights give the same value, whatever the training RNG did before; the global RNG is
    not touched, so training continues exactly as it would have without validation.
    """
    total, count = 0.0, 0
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        for k, t in enumerate(timesteps):
            gen = torch.Generator().manual_seed(seed * 1_000_003 + i * 1009 + (k if t is None else int(round(t))))
            tt = None if t is None else torch.full((len(batch),), t)  # long for DDPM's ints, float for 1000 σ
            total += float(batch_loss(m, batch, gen, timesteps=tt).sum())
            count += len(batch)
    if count == 0:
        raise ValueError("the validation set yields no batch; lower --validation_split's batch size or add images")
    return total / count


class Interrupt:
    """Ctrl-C / SIGTERM during training: the first one asks the loop to save a resumable state and stop after the
    current step; a second one stops at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}

    def __enter__(self) -> Interrupt:
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. under some launchers): keep the default behaviour
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        from library.cli.console import is_main_process

        if is_main_process():  # every process of a launch gets the signal; one says so
            print("\ninterrupt received: saving a resumable state after this step (press Ctrl-C again to quit now)")

    def __exit__(self, *exc) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class LossTracker:
    """Running averages of the training loss: the last ``window`` steps (``loss/average``) and the epoch."""

    def __init__(self, window: int) -> None:
        self.window = max(1, window)
        self.recent: list[float] = []
        self.epoch_total, self.epoch_count = 0.0, 0

    def add(self, value: float) -> None:
        self.recent = (self.recent + [value])[-self.window :]
        self.epoch_total += value
        self.epoch_count += 1

    @property
    def average(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else float("nan")

    def end_epoch(self) -> float:
        mean = self.epoch_total / max(1, self.epoch_count)
        self.epoch_total, self.epoch_count = 0.0, 0
        return mean
