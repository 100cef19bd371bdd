"""A FLUX.1 ControlNet on a FLUX.1 transformer: the ``Trainable`` flux_train_control_net.py trains and what
flux_minimal_inference.py / samples during training apply.

The ControlNet (library/families/flux/controlnet.py) is attached to the frozen transformer by a forward pre-hook:
while a control image is set, each call of the transformer first runs the ControlNet on the same inputs and passes
its residuals as ``controlnet_block_samples`` with ``controlnet_blocks_repeat=True`` (sd-scripts' ``block_idx %
depth``). Several ControlNets on one transformer (inference) add their residuals, each times its multiplier.
The transformer is not this module's child, so ``state_dict()`` (``--save_state``) holds the ControlNet only.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from . import controlnet as C


class FluxControlNet(nn.Module):
    """The trained ControlNet (``self.model``, diffusers' ``FluxControlNetModel``) and its hook on ``transformer``."""

    kind = "network"
    modelspec_kind = ""  # sd-scripts writes the checkpoint architecture (flux-1-dev) for its ControlNet file
    gradient_sync = "manual"
    sparse_gradients = False

    def __init__(self, transformer: nn.Module, model: nn.Module, multiplier: float = 1.0,
                 checkpointing: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.model = model
        self.multiplier = float(multiplier)
        self.checkpointing = checkpointing
        self._image: Tensor | None = None
        self._once = False  # a training batch's image: used by the next transformer call only
        self._transformer = (transformer,)  # a tuple: not a submodule, not in the state
        self._hook = transformer.register_forward_pre_hook(self._add_residuals, with_kwargs=True)

    @classmethod
    def create(cls, transformer: nn.Module, depth: int = 2, **kw: Any) -> FluxControlNet:
        """A fresh ControlNet for ``transformer`` (zero-initialised outputs: the transformer's output unchanged)."""
        return cls(transformer, C.build_controlnet(transformer, depth), **kw)

    @classmethod
    def from_file(cls, transformer: nn.Module, path: str | os.PathLike, **kw: Any) -> FluxControlNet:
        """A ControlNet file in sd-scripts' keys (``flux_train_control_net.py``'s output, ours or sd-scripts')."""
        from library.files.weights import load_state_dict

        tensors, _ = load_state_dict(path)
        net = cls(transformer, C.build_controlnet(transformer, C.depth_of_file(tensors), copy_weights=False), **kw)
        net.load_file_tensors(tensors, str(path))
        return net

    def load_file_tensors(self, tensors: dict[str, Tensor], source: str) -> None:
        """Load sd-scripts' ControlNetFlux tensors; every key must match by name and shape."""
        converted = C.from_file(tensors, source)
        own = self.model.state_dict()
        wrong = [k for k, t in converted.items() if t.shape != own[k].shape]
        if wrong:
            raise ValueError(f"{source}: {len(wrong)} tensors of another shape than this model's ControlNet, e.g. "
                             f"{wrong[:2]}; was it trained for another FLUX model?")  # fmt: skip
        self.model.load_state_dict(converted, strict=True)

    def load_file(self, path: str | os.PathLike) -> None:
        from library.files.weights import load_state_dict

        self.load_file_tensors(load_state_dict(path)[0], str(path))

    # ------------------------------------------------------------------------------------------- the transformer
    def _add_residuals(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._image is None or self.multiplier == 0.0:
            return args, kwargs
        if args:
            raise ValueError("the FLUX ControlNet reads the transformer's keyword arguments (FluxFamily.predict)")
        res = C.residuals(self.model, self._image, kwargs, self.checkpointing)
        if self._once:  # a sample prompt without --cn after a step must not see the last batch's images
            self._image, self._once = None, False
        if self.multiplier != 1.0:
            res = [r * self.multiplier for r in res]
        before = kwargs.get("controlnet_block_samples")
        if before is not None:  # another ControlNet's hook ran first
            if len(before) != len(res):
                raise ValueError(f"ControlNets of different depths ({len(before)}, {len(res)}) cannot be combined")
            res = [a + b for a, b in zip(before, res)]
        return args, {**kwargs, "controlnet_block_samples": res, "controlnet_blocks_repeat": True}

    def set_cond_image(self, image: Tensor | None) -> None:
        """A training batch's control images (B, 3, H, W) in [-1, 1], for the next transformer call only."""
        self._image, self._once = image, image is not None

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = float(multiplier)

    def use_guide_image(self, image: Tensor | None) -> None:
        """A guide image (B, 3, H, W) in [-1, 1] for every transformer call until changed (sampling); None: off."""
        p = next(self.model.parameters())
        self._image, self._once = (None if image is None else image.to(p.device, p.dtype)), False

    def remove(self) -> None:
        """Detach from the transformer (its forward is plain again)."""
        self._hook.remove()
        self._image = None

    # ------------------------------------------------------------------------------------------ the Trainable seam
    def set_training(self, mode: bool) -> None:
        self.model.train(mode)

    def step_models(self, models: Any) -> Any:
        """The step hands each batch's conditioning images to the ControlNet before the prediction."""
        import dataclasses

        return dataclasses.replace(models, conditioning=self.set_cond_image)

    def after_step(self) -> dict[str, float]:
        return {}

    @contextlib.contextmanager
    def sample_control(self, spec: Any) -> Iterator[None]:
        """Sample ``spec`` (a prompt with ``--cn <image>``) with that image, resized to the prompt's size."""
        self.use_guide_image(C.guide_image(spec.control_image, spec.width, spec.height))
        try:
            yield
        finally:
            self.use_guide_image(None)

    def prepare(self, accelerator: Any) -> FluxControlNet:
        return self

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": list(self.model.parameters()), "lr": lr, "name": "controlnet"}]

    # ----------------------------------------------------------------------------------------------------- files
    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """sd-scripts' ControlNetFlux keys (``flux_train_control_net.py``'s file)."""
        state = {k: t.detach().to("cpu") for k, t in self.model.state_dict().items()}
        out = C.to_file(state)
        return {k: t.to(dtype) for k, t in out.items()} if dtype is not None else out

    def metadata(self) -> dict[str, str]:
        return {}

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        from library.files.weights import save_state_dict

        save_state_dict(self.state_dict_for_file(dtype), path, metadata=dict(metadata or {}), wrap_ckpt=False)
