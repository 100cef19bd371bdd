"""Exponential moving average of the trained parameters (``--ema``).

``shadow <- shadow - (1 - d) * (shadow - param)`` after every ``update_every``-th optimizer step, with
``d = decay ** update_every`` so the averaging horizon (about ``1 / (1 - decay)`` steps) does not depend on the
interval, and ``d = min(d, (1 + n) / (10 + n))`` for the first updates (n = number of updates so far, the warm-up
diffusers' EMAModel uses) so early averages are not dominated by the random initial weights. The shadow copy is fp32
and may live on another device (``device="cpu"`` keeps it off the GPU). Used for samples and saved alongside the
regular weights.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from library.cli.parse import from_namespace
from library.cli.problems import ConfigError


class EMA:
    """EMA of ``params`` (the trainable parameters, in a fixed order)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        decay: float = 0.999,
        update_every: int = 1,
        device: str | torch.device | None = None,
        warmup: bool = True,
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"--ema_decay must be in (0, 1), got {decay}")
        if update_every < 1:
            raise ValueError(f"--ema_update_every must be >= 1, got {update_every}")
        self.params = list(params)
        self.decay, self.update_every, self.warmup = decay, update_every, warmup
        self.shadow = [p.detach().to(device or p.device, torch.float32, copy=True) for p in self.params]
        self.num_updates = 0

    def current_decay(self) -> float:
        d = self.decay**self.update_every
        if self.warmup:
            d = min(d, (1 + self.num_updates) / (10 + self.num_updates))
        return d

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Call after optimizer step number ``step`` (1-based); updates when ``step % update_every == 0``."""
        if step % self.update_every:
            return False
        d = self.current_decay()
        for s, p in zip(self.shadow, self.params):
            s.sub_((s - p.detach().to(s.device, torch.float32)).mul_(1.0 - d))
        self.num_updates += 1
        return True

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """Temporarily put the averaged weights into the parameters (for sampling, validation or saving)."""
        backup = [p.detach().clone() for p in self.params]
        for s, p in zip(self.shadow, self.params):
            p.copy_(s.to(p.device, p.dtype))
        try:
            yield
        finally:
            for b, p in zip(backup, self.params):
                p.copy_(b)

    def state_dict(self) -> dict[str, Tensor]:
        out = {f"shadow.{i}": s for i, s in enumerate(self.shadow)}
        out["num_updates"] = torch.tensor(self.num_updates)
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        n = sum(1 for k in state if k.startswith("shadow."))
        if n != len(self.shadow):
            raise ValueError(f"EMA state has {n} tensors but the network has {len(self.shadow)} trainable parameters")
        for i, s in enumerate(self.shadow):
            src = state[f"shadow.{i}"]
            if src.shape != s.shape:
                raise ValueError(f"EMA state tensor {i}: shape {tuple(src.shape)} != parameter {tuple(s.shape)}")
            s.copy_(src)
        self.num_updates = int(state["num_updates"])


def add_ema_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ema")
    g.add_argument("--ema", action="store_true", help="keep an EMA of the trained weights (samples + saved file)")
    g.add_argument("--ema_decay", type=float, default=0.999)
    g.add_argument("--ema_update_every", type=int, default=1, help="update the EMA every N optimizer steps")
    g.add_argument("--ema_device", type=str, default="same", choices=["same", "cpu"], help="where the EMA lives")


@dataclass(frozen=True)
class EMAConfig:
    ema: bool = False
    ema_decay: float = 0.999
    ema_update_every: int = 1
    ema_device: str = "same"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EMAConfig:
        """Read the flags of :func:`add_ema_args`; ``ConfigError`` listing every problem."""
        cfg = from_namespace(cls, args)
        problems = []
        if cfg.ema and not 0 < cfg.ema_decay < 1:
            problems.append(f"--ema_decay must be in (0, 1), got {cfg.ema_decay}")
        if cfg.ema and cfg.ema_update_every < 1:
            problems.append(f"--ema_update_every must be >= 1, got {cfg.ema_update_every}")
        if problems:
            raise ConfigError(problems)
        return cfg
