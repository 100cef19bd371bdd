"""ControlNet-LLLite (kohya-ss, sd-scripts ``networks/control_net_lllite.py``): a small conditioning network per
attention projection of the UNet's input and middle blocks.

Each adapted Linear (``attn1.to_q/k/v`` and ``attn2.to_q`` of the transformer blocks, as sd-scripts selects them)
gets an :class:`LLLiteLayer` in its place that holds it (peft style, no patched ``forward``): the conditioning
image, embedded once per image by ``conditioning1`` (strided convs down to that block's latent size: ``depth`` 1, 2
or 3 = 1/8, 1/16, 1/32 of the image), is joined to ``down(x)`` along channels, mixed by ``mid`` and projected back
by ``up`` (zero-initialised, so a fresh network leaves the UNet unchanged); the base Linear then runs on
``x + up(...) * multiplier``.

The file keys are sd-scripts': ``lllite_unet_<original module path with _>.{conditioning1.N,down.0,mid.0,up.0}
.{weight,bias}`` (the original, sgm, UNet names, which the family's ``lora_unet`` root gives through its rename).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from library.families.base import Root

PREFIX = "lllite_unet"
# (attention, projection) pairs sd-scripts adapts: attn1's q, k, v and attn2's q (attn2's k / v see the text)
_TARGET = re.compile(r"\.(attn1\.to_[qkv]|attn2\.to_q)$")
_BLOCK = re.compile(r"^(input_blocks|middle_block)\.(\d+)\.")


def depth_of(sgm_path: str) -> int | None:
    """sd-scripts' depth of a module by its original path: input blocks 0-2 -> 1, 3-5 -> 2, later -> 3, the middle
    block 3; None for the output blocks (sd-scripts skips them)."""
    m = _BLOCK.match(sgm_path)
    if m is None:
        return None
    if m.group(1) == "middle_block":
        return 3
    index = int(m.group(2))
    return 1 if index <= 2 else (2 if index <= 5 else 3)


def conditioning_stack(depth: int, cond_emb_dim: int) -> nn.Sequential:
    """``conditioning1``: (B, 3, H, W) image -> (B, cond_emb_dim, H/f, W/f), f = 8, 16, 32 for depth 1, 2, 3."""
    half = cond_emb_dim // 2
    layers: list[nn.Module] = [nn.Conv2d(3, half, kernel_size=4, stride=4)]
    if depth == 1:
        layers += [nn.ReLU(inplace=True), nn.Conv2d(half, cond_emb_dim, kernel_size=2, stride=2)]
    elif depth == 2:
        layers += [nn.ReLU(inplace=True), nn.Conv2d(half, cond_emb_dim, kernel_size=4, stride=4)]
    elif depth == 3:
        layers += [nn.ReLU(inplace=True), nn.Conv2d(half, half, kernel_size=4, stride=4)]
        layers += [nn.ReLU(inplace=True), nn.Conv2d(half, cond_emb_dim, kernel_size=2, stride=2)]
    else:
        raise ValueError(f"LLLite depth must be 1, 2 or 3, got {depth}")
    return nn.Sequential(*layers)


class LLLiteWeights(nn.Module):
    """The trained tensors of one LLLite module (``conditioning1``, ``down``, ``mid``, ``up``: the file's names)."""

    def __init__(self, in_dim: int, depth: int, cond_emb_dim: int, mlp_dim: int) -> None:
        super().__init__()
        self.depth = depth
        self.conditioning1 = conditioning_stack(depth, cond_emb_dim)
        self.down = nn.Sequential(nn.Linear(in_dim, mlp_dim), nn.ReLU(inplace=True))
        self.mid = nn.Sequential(nn.Linear(mlp_dim + cond_emb_dim, mlp_dim), nn.ReLU(inplace=True))
        self.up = nn.Sequential(nn.Linear(mlp_dim, in_dim))
        # zero "conv": a fresh module adds nothing. sd-scripts zeroes only the weight, so its fresh network adds
        # up's random bias (up to 1/sqrt(mlp_dim)) to every projection's input; zeroing the bias too makes step 0
        # the base model exactly (ControlNet's zero convolutions zero both), the file layout is unchanged
        nn.init.zeros_(self.up[0].weight)
        nn.init.zeros_(self.up[0].bias)

    def embed(self, image: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, h*w, cond_emb_dim) tokens, row-major as the attention's sequence."""
        cx = self.conditioning1(image)
        return cx.flatten(2).transpose(1, 2)


class LLLiteLayer(nn.Module):
    """A Linear with its LLLite module: ``base(x + up(mid([emb, down(x)])) * multiplier)``."""

    def __init__(self, base: nn.Linear, weights: LLLiteWeights, dropout: float | None = None) -> None:
        super().__init__()
        self.base_layer = base
        self.lllite = weights
        self.dropout = dropout
        self.multiplier = 1.0
        self.cond_emb: Tensor | None = None

    def set_cond_image(self, image: Tensor | None) -> None:
        """Embed the conditioning image (B, 3, H, W) in [-1, 1] once for every step of a prediction (with autograd
        when it is enabled, so training reaches ``conditioning1``); None switches the module off."""
        self.cond_emb = None if image is None else self.lllite.embed(image)

    def forward(self, x: Tensor) -> Tensor:
        if self.multiplier == 0.0 or self.cond_emb is None:
            return self.base_layer(x)
        cx = self.cond_emb
        if x.shape[0] == 2 * cx.shape[0]:  # classifier-free guidance: (uncond, cond) halves share the image
            cx = cx.repeat(2, 1, 1)
        cx = torch.cat([cx.to(x.dtype), self.lllite.down(x)], dim=2)
        cx = self.lllite.mid(cx)
        if self.dropout is not None and self.training:
            cx = nn.functional.dropout(cx, p=self.dropout)
        cx = self.lllite.up(cx) * self.multiplier
        return self.base_layer(x + cx)


@dataclass(frozen=True)
class LLLiteTarget:
    name: str  # lllite_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q
    path: str  # the module's path in the model
    depth: int
    in_dim: int


def find_targets(root: Root) -> list[LLLiteTarget]:
    """The Linears sd-scripts' ControlNet-LLLite adapts, by their original names (``root``: the UNet's root)."""
    out = []
    for path, module in root.module.named_modules():
        if not isinstance(module, (nn.Linear, LLLiteLayer)) or not _TARGET.search(path):
            continue  # an LLLiteLayer: a second network wraps the first (gen_img.py with several files)
        try:
            sgm = root.rename(path)
        except KeyError:
            continue
        depth = depth_of(sgm)
        if depth is not None:
            in_dim = module.in_features if isinstance(module, nn.Linear) else module.lllite.down[0].in_features
            out.append(LLLiteTarget(PREFIX + "_" + sgm.replace(".", "_"), path, depth, in_dim))
    return out


def unet_root(roots: Sequence[Root]) -> Root:
    for root in roots:
        if root.prefix == "lora_unet":
            return root
    raise ValueError("ControlNet-LLLite needs the model's UNet (a lora_unet adapter root); this model has none")


def dims_of_file(tensors: dict[str, Tensor]) -> tuple[int, int]:
    """(cond_emb_dim, mlp_dim) of an LLLite file, read from its shapes as sd-scripts' gen_img.py does."""
    cond = next((t for k, t in tensors.items() if k.endswith(".conditioning1.0.weight")), None)
    down = next((t for k, t in tensors.items() if k.endswith(".down.0.weight")), None)
    if cond is None or down is None:
        raise ValueError("not a ControlNet-LLLite file: no *.conditioning1.0.weight / *.down.0.weight tensors")
    return cond.shape[0] * 2, down.shape[0]


def load_guide_image(path: str, width: int, height: int) -> Tensor:
    """A guide (conditioning) image file as (1, 3, height, width) float32 in [-1, 1] (resized, as sd-scripts'
    gen_img.py resizes guide images to the generated size)."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        img = im.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
    arr = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1)
    return (arr / 127.5 - 1.0).unsqueeze(0)


def parent_of(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, attr = path.rpartition(".")
    return (model.get_submodule(head) if head else model), attr


class LLLiteNetwork(nn.Module):
    """The LLLite modules injected into a UNet, keyed by file name; a ``Trainable`` for the run layer.

    ``network.set_cond_image(image)`` before each prediction (the training step does it through ``step_models``);
    ``state_dict_for_file()`` holds only LLLite tensors, in sd-scripts' key names."""

    kind = "network"
    modelspec_kind = "control-net-lllite"
    gradient_sync = "manual"
    sparse_gradients = False

    def __init__(
        self, root: Root, cond_emb_dim: int, mlp_dim: int, dropout: float | None = None, multiplier: float = 1.0
    ) -> None:
        super().__init__()
        if cond_emb_dim < 2 or cond_emb_dim % 2:
            raise ValueError(f"--cond_emb_dim must be an even number >= 2, got {cond_emb_dim}")
        if mlp_dim < 1:
            raise ValueError(f"--network_dim must be >= 1, got {mlp_dim}")
        self.cond_emb_dim, self.mlp_dim, self.dropout = cond_emb_dim, mlp_dim, dropout
        targets = find_targets(root)
        if not targets:
            raise ValueError("ControlNet-LLLite found no attn1 / attn2 projections in the UNet's input blocks")
        self.weights = nn.ModuleDict()
        self._layers: dict[str, LLLiteLayer] = {}
        self._model = (root.module,)  # a tuple: the UNet is not this network's submodule (nor in its state)
        for t in targets:
            parent, attr = parent_of(root.module, t.path)
            base = getattr(parent, attr)
            device = next(base.parameters()).device
            w = LLLiteWeights(t.in_dim, t.depth, cond_emb_dim, mlp_dim).to(device)
            layer = LLLiteLayer(base, w, dropout)
            layer.multiplier = multiplier
            setattr(parent, attr, layer)
            self.weights[t.name] = w
            self._layers[t.name] = layer
        self._paths = {t.name: t.path for t in targets}

    @property
    def names(self) -> list[str]:
        return list(self._layers)

    def set_cond_image(self, image: Tensor | None) -> None:
        for layer in self._layers.values():
            layer.set_cond_image(image)

    def set_multiplier(self, multiplier: float) -> None:
        for layer in self._layers.values():
            layer.multiplier = float(multiplier)

    def eject(self) -> None:
        """Put the original Linears back."""
        for name, layer in self._layers.items():
            parent, attr = parent_of(self._model[0], self._paths[name])
            setattr(parent, attr, layer.base_layer)
        self._layers = {}

    # ------------------------------------------------------------------------------------------ the Trainable seam
    def set_training(self, mode: bool) -> None:
        for layer in self._layers.values():
            layer.train(mode)

    def step_models(self, models: Any) -> Any:
        """The step sets each batch's conditioning images on the network before the prediction."""
        import dataclasses

        return dataclasses.replace(models, conditioning=self.set_cond_image)

    def after_step(self) -> dict[str, float]:
        """The step's conditioning ends with its optimizer step (kept through the backward: gradient checkpointing
        runs the UNet again there): a sample prompt without ``--cn`` after it must not see the last batch's
        images, and their embeddings' graph is not held until the next step."""
        self.set_cond_image(None)
        return {}

    @contextlib.contextmanager
    def sample_control(self, spec: Any) -> Iterator[None]:
        """Sample ``spec`` (a prompt with ``--cn <image>``) with that image as the condition: resized to the
        prompt's size, in [-1, 1] as in training; the network is off again afterwards."""
        self.use_guide_image(load_guide_image(spec.control_image, spec.width, spec.height))
        try:
            yield
        finally:
            self.set_cond_image(None)

    def use_guide_image(self, image: Tensor) -> None:
        """Embed a (B, 3, H, W) guide image in [-1, 1] for inference (no autograd), on the modules' device/dtype."""
        p = next(self.weights.parameters())
        with torch.no_grad():
            self.set_cond_image(image.to(p.device, p.dtype))

    def prepare(self, accelerator: Any) -> LLLiteNetwork:
        return self

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": list(self.weights.parameters()), "lr": lr, "name": "lllite"}]

    # ----------------------------------------------------------------------------------------------------- files
    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        out = {}
        for name, w in self.weights.items():
            for key, t in w.state_dict().items():
                t = t.detach().to("cpu")
                out[f"{name}.{key}"] = t.to(dtype) if dtype is not None else t
        return out

    def metadata(self) -> dict[str, str]:
        """sd-scripts writes ModelSpec keys only (the run adds them); the shapes tell a reader the dims."""
        return {}

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype: Any = None) -> None:
        from library.files.weights import save_state_dict

        meta = {**self.metadata(), **(metadata or {})}
        save_state_dict(self.state_dict_for_file(dtype), path, metadata=meta, wrap_ckpt=False)

    def load_file_tensors(self, tensors: dict[str, Tensor], source: str) -> None:
        """Load an LLLite file's tensors (``--network_weights``, gen_img.py); every key must match by name and shape."""
        own = {f"{name}.{k}": t for name, w in self.weights.items() for k, t in w.state_dict().items()}
        missing = sorted(set(own) - set(tensors))
        extra = sorted(set(tensors) - set(own))
        wrong = [k for k in own if k in tensors and tensors[k].shape != own[k].shape]
        if missing or extra or wrong:
            raise ValueError(
                f"{source}: not this network's ControlNet-LLLite layout ({len(missing)} keys missing, e.g. "
                f"{missing[:2]}; {len(extra)} unexpected, e.g. {extra[:2]}; {len(wrong)} of another shape, e.g. "
                f"{wrong[:2]}); check --cond_emb_dim / --network_dim and that it was trained for this model"
            )
        with torch.no_grad():
            for key, t in own.items():
                t.copy_(tensors[key].to(t.dtype))

    def load_file(self, path: str | os.PathLike) -> None:
        from library.files.weights import load_state_dict

        tensors, _ = load_state_dict(path)
        self.load_file_tensors(tensors, str(path))
