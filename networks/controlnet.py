"""ControlNet (Zhang et al.; sd-scripts' ``train_control_net.py`` / ``sdxl_train_control_net.py``) on a UNet: a
trainable copy of the UNet's encoder half (diffusers ``ControlNetModel.from_unet``) whose zero-initialised 1x1
convolutions add residuals to the frozen UNet's skip connections and middle block.

:class:`ControlNet` is a ``Trainable`` (library/run/trainable.py) and the inference adapter of gen_img.py alike. It
attaches to the UNet by a forward pre-hook (no patched ``forward``): while a conditioning image is set, each UNet
call first runs the ControlNet on the same inputs and passes its residuals through the UNet's own
``down_block_additional_residuals`` / ``mid_block_additional_residual`` arguments, so the training step, the
training samples, gen_img.py and a diffusers pipeline given this UNet all see the same controlled model. Several
ControlNets on one UNet add their residuals (diffusers' ``MultiControlNetModel``).

The conditioning image is (B, 3, H, W) in [0, 1] as the ControlNet sees it (diffusers, ComfyUI, A1111 and
sd-scripts' SDXL trainer and gen_img.py; the dataset's [-1, 1] images are mapped). Files: the original (LDM) names
sd-scripts' SD trainer writes (:mod:`networks.controlnet_keys`) or diffusers' names, which sd-scripts' SDXL
trainer writes (its ``SdxlControlNet.state_dict``); both are read back, and ``control_model.`` prefixes too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from networks.controlnet_keys import LDM_PREFIX, is_ldm, ldm_map

FILE_KEYS = ("ldm", "diffusers")


def controlnet_from_unet(unet: nn.Module) -> nn.Module:
    """A fresh ControlNet: the UNet's encoder weights, zero output convolutions (diffusers ``from_unet``)."""
    from diffusers import ControlNetModel

    if unet.device.type == "meta":  # --plan_memory: shapes only
        with torch.device("meta"):
            return ControlNetModel.from_unet(unet, load_weights_from_unet=False).to(unet.dtype)
    model = ControlNetModel.from_unet(unet).to(unet.device)
    return model if model.dtype == unet.dtype else model.to(unet.dtype)


def read_file_tensors(tensors: dict[str, Tensor], model: nn.Module, source: str) -> dict[str, Tensor]:
    """A ControlNet file's tensors in ``model``'s (diffusers) names: LDM names converted, ``control_model.``
    stripped; every key must match by name and shape."""
    if "difference" in tensors:
        raise ValueError(f"{source}: a 'Transfer Control' difference file; only full ControlNet files are read")
    own = model.state_dict()
    if is_ldm(tensors):
        names = ldm_map(list(own), model.config.layers_per_block)
        tensors = {k.removeprefix(LDM_PREFIX): t for k, t in tensors.items()}
        tensors = {d: tensors[ldm] for d, ldm in names.items() if ldm in tensors} | {
            k: t for k, t in tensors.items() if k not in set(names.values())
        }
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    wrong = [k for k in own if k in tensors and tensors[k].shape != own[k].shape]
    if missing or extra or wrong:
        raise ValueError(
            f"{source}: not a ControlNet for this model ({len(missing)} keys missing, e.g. {missing[:2]}; "
            f"{len(extra)} unexpected, e.g. {extra[:2]}; {len(wrong)} of another shape, e.g. {wrong[:2]}); "
            "check that it was trained for this base model (each base model needs its own ControlNet)"
        )
    return tensors


def load_controlnet(path: str | os.PathLike, unet: nn.Module) -> nn.Module:
    """A ControlNet from a file (LDM or diffusers names; .safetensors/.ckpt/.pt) or a diffusers folder."""
    from library.files.weights import load_state_dict

    if os.path.isdir(path):
        from diffusers import ControlNetModel

        return ControlNetModel.from_pretrained(path).to(device=unet.device, dtype=unet.dtype)
    model = controlnet_from_unet(unet)
    tensors, _ = load_state_dict(path)
    model.load_state_dict(read_file_tensors(tensors, model, str(path)))
    return model


class ControlNet(nn.Module):
    """A ControlNet hooked to ``unet``: ``set_cond_image(image)`` switches it on for the following UNet calls."""

    kind = "network"
    modelspec_kind = "controlnet"
    gradient_sync = "manual"
    sparse_gradients = False

    def __init__(self, unet: nn.Module, controlnet: nn.Module, file_keys: str = "ldm", multiplier: float = 1.0):
        super().__init__()
        if file_keys not in FILE_KEYS:
            raise ValueError(f"file_keys must be one of {FILE_KEYS}, got {file_keys!r}")
        self.controlnet = controlnet
        self.file_keys = file_keys
        self.multiplier = multiplier
        self.cond_image: Tensor | None = None
        self.ratio = 1.0  # gen_img's --control_net_ratios: the fraction of the schedule that is controlled
        self.schedule: Tensor | None = None  # the sampler's timesteps (for the ratio)
        self._unet = (unet,)  # a tuple: the UNet is not this module's child (nor in its state)
        self._hook = unet.register_forward_pre_hook(self._add_residuals, with_kwargs=True)

    def remove(self) -> None:
        """Detach from the UNet."""
        self._hook.remove()

    # ------------------------------------------------------------------------------------------------- the hook
    def set_cond_image(self, image: Tensor | None) -> None:
        """(B, 3, H, W) in [0, 1] for the next UNet calls; None switches the ControlNet off."""
        self.cond_image = image

    def set_dataset_image(self, image: Tensor | None) -> None:
        """A batch's conditioning images as the dataset gives them ([-1, 1])."""
        self.set_cond_image(None if image is None else (image + 1) / 2)

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = float(multiplier)

    def _controlled(self, timestep: Any) -> bool:
        if self.ratio >= 1.0 or self.schedule is None:
            return True
        t = float(timestep.flatten()[0]) if isinstance(timestep, Tensor) else float(timestep)
        done = int((self.schedule > t + 1e-4).sum())  # steps before this one
        return done / len(self.schedule) <= self.ratio  # sd-scripts: off once step / steps > ratio

    def _add_residuals(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.cond_image is None or self.multiplier == 0.0:
            return None
        names = ("sample", "timestep", "encoder_hidden_states")
        values = {n: (args[i] if i < len(args) else kwargs[n]) for i, n in enumerate(names)}
        sample = values["sample"]
        if not self._controlled(values["timestep"]):
            return None
        image = self.cond_image.to(sample.device, self.controlnet.dtype)
        if sample.shape[0] != image.shape[0]:  # classifier-free guidance: (uncond, cond) share the image
            image = image.repeat(sample.shape[0] // image.shape[0], 1, 1, 1)
        down, mid = self.controlnet(
            sample.to(self.controlnet.dtype), values["timestep"],
            encoder_hidden_states=values["encoder_hidden_states"].to(self.controlnet.dtype), controlnet_cond=image,
            conditioning_scale=self.multiplier, added_cond_kwargs=kwargs.get("added_cond_kwargs"), return_dict=False,
        )  # fmt: skip
        down, mid = [d.to(sample.dtype) for d in down], mid.to(sample.dtype)  # a float32 ControlNet, bf16 UNet
        earlier = kwargs.get("down_block_additional_residuals")
        if earlier is not None:  # another ControlNet ran first: the residuals add up
            down = [a + b for a, b in zip(earlier, down)]
            mid = kwargs["mid_block_additional_residual"] + mid
        return args, {**kwargs, "down_block_additional_residuals": down, "mid_block_additional_residual": mid}

    # ------------------------------------------------------------------------------------------ the Trainable seam
    def set_training(self, mode: bool) -> None:
        self.controlnet.train(mode)
        if not mode:
            self.set_cond_image(None)  # samples / saving: no training batch's image lingers

    def step_models(self, models: Any) -> Any:
        """The step sets each batch's conditioning images before the prediction."""
        import dataclasses

        return dataclasses.replace(models, conditioning=self.set_dataset_image)

    def after_step(self) -> dict[str, float]:
        return {}

    @contextlib.contextmanager
    def sample_control(self, spec: Any) -> Iterator[None]:
        """Sample ``spec`` (a prompt with ``--cn <image>``) with that image as the condition, resized to the
        prompt's size; off again afterwards."""
        self.set_cond_image(guide_image(spec.control_image, spec.width, spec.height))
        try:
            yield
        finally:
            self.set_cond_image(None)

    def prepare(self, accelerator: Any) -> ControlNet:
        return self

    def param_groups(self, lr: float, zero_conv_lr: float | None = None) -> list[dict]:
        """One group at ``lr``; with ``zero_conv_lr`` (sd-scripts' SDXL ``--control_net_lr``) the ``controlnet_*``
        modules (conditioning embedding, zero convolutions) get their own."""
        named = list(self.controlnet.named_parameters())
        if zero_conv_lr is None:
            return [{"params": [p for _, p in named], "lr": lr, "name": "controlnet"}]
        own = [p for n, p in named if n.startswith("controlnet_")]
        copied = [p for n, p in named if not n.startswith("controlnet_")]
        return [{"params": own, "lr": zero_conv_lr, "name": "controlnet"},
                {"params": copied, "lr": lr, "name": "unet_copy"}]  # fmt: skip

    # ----------------------------------------------------------------------------------------------------- files
    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> None:
        """None: a ControlNet file is a whole model, which sd-scripts writes without ``sshs_*`` hashes (hashing
        would serialise the 1.4 / 4.8 GB file once more in memory at every save)."""
        return None

    def file_tensors(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The file's tensors in its names (:attr:`file_keys`), cast to ``dtype``."""
        state = {k: t.detach().to("cpu") for k, t in self.controlnet.state_dict().items()}
        if dtype is not None:
            state = {k: t.to(dtype) for k, t in state.items()}
        if self.file_keys == "ldm":
            names = ldm_map(list(state), self.controlnet.config.layers_per_block)
            state = {names[k]: t for k, t in state.items()}
        return state

    def metadata(self) -> dict[str, str]:
        return {}

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        from library.files.weights import save_state_dict

        meta = {**self.metadata(), **(metadata or {})}
        save_state_dict(self.file_tensors(dtype), path, metadata=meta, wrap_ckpt=False)


def guide_image(path: str | os.PathLike, width: int, height: int, prep: Any = None) -> Tensor:
    """A guide image file as (1, 3, height, width) float32 in [0, 1], resized (LANCZOS) to the generated size as
    sd-scripts' gen_img.py does; ``prep``: a function of the (H, W, 3) uint8 RGB array (e.g. :func:`canny`)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        img = np.asarray(im.convert("RGB").resize((width, height), Image.Resampling.LANCZOS))
    if prep is not None:
        img = prep(img)
    if img.ndim == 2:  # an edge map: one channel, repeated as the ControlNet sees a grey image
        img = np.repeat(img[:, :, None], 3, axis=2)
    return (torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32)) / 255.0).permute(2, 0, 1).unsqueeze(0)
