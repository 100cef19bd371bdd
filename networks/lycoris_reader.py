"""lycoris-lora as a reader of our LyCORIS-format files (the demo and the tests' oracle).

Read an adapter file with lycoris-lora's own loader and forward pass: the consumer of LyCORIS formats (LoHa, LoKr,
DoRA, Tucker) that diffusers cannot read. Used by ``--demo`` and by the tests as an oracle.

lycoris-lora 4.1.3 needs three work-arounds on diffusers models, and one for (IA)³ files (docs/formats.md "lycoris-lora 4.1.3 on diffusers
models"): its Anima "TimestepEmbedding" target gives duplicated names on a diffusers UNet (removed while loading), it
matches text-encoder modules below a ``text_model`` attribute that transformers >= 5.6 no longer has (wrapped), and it
matches kohya names against the module tree, so a UNet whose kohya names are not its diffusers paths (SDXL's sgm
names) is shown to it under those names (a view that shares the layer objects). Its (IA)³ loader takes one tensor
where the file format has two (weight, on_input): it is given one that takes both while a file loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from torch import nn

from .layers import weight_kind

_EXTRA_TARGET = "TimestepEmbedding"  # in LyCORIS 4.1.3's class lists for a DiT family's embedders


@contextlib.contextmanager
def _without_timestep_embedding_target() -> Iterator[object]:
    """lycoris.kohya with "TimestepEmbedding" out of its class list and presets; everything restored after."""
    from lycoris import kohya

    cls = kohya.LycorisNetworkKohya
    saved = {a: getattr(cls, a) for a in ("UNET_TARGET_REPLACE_MODULE", "UNET_TARGET_REPLACE_NAME",
                                          "TEXT_ENCODER_TARGET_REPLACE_MODULE", "ENABLE_CONV")}  # fmt: skip
    presets = dict(kohya.PRESET)
    try:
        cls.UNET_TARGET_REPLACE_MODULE = [c for c in cls.UNET_TARGET_REPLACE_MODULE if c != _EXTRA_TARGET]
        for name, preset in presets.items():
            if _EXTRA_TARGET in preset.get("unet_target_module", []):
                targets = [c for c in preset["unet_target_module"] if c != _EXTRA_TARGET]
                kohya.PRESET[name] = dict(preset, unet_target_module=targets)
        yield kohya
    finally:
        for attr, value in saved.items():
            setattr(cls, attr, value)
        kohya.PRESET.clear()
        kohya.PRESET.update(presets)


@contextlib.contextmanager
def _ia3_reads_on_input() -> Iterator[None]:
    """lycoris-lora 4.1.3 passes an (IA)³ module's two file tensors (weight, on_input) to a loader that takes one
    (a TypeError: it cannot read any (IA)³ file); for the time of a load, the loader takes both and builds the module
    with ``train_on_input`` from ``on_input``. Restored after."""
    from lycoris.modules.ia3 import IA3Module

    original = IA3Module.__dict__["make_module_from_state_dict"]

    def make(cls, lora_name, orig_module, weight, on_input=None):
        module = cls(lora_name, orig_module, 1, train_on_input=on_input is not None and bool(int(on_input)))
        module.weight.data.copy_(weight)
        return module

    IA3Module.make_module_from_state_dict = classmethod(make)
    try:
        yield
    finally:
        IA3Module.make_module_from_state_dict = original


class _TextModel(nn.Module):
    """Gives a flat transformers-5 CLIPTextModel back its ``text_model.`` level for LyCORIS' name matching."""

    def __init__(self, te: nn.Module) -> None:
        super().__init__()
        self.text_model = te


def renamed_view(root: nn.Module, rename: Callable[[str], str]) -> nn.Module:
    """A module tree holding ``root``'s adaptable layers under their renamed paths (sharing the layer objects)."""
    view = nn.Module()
    for path, module in root.named_modules():
        if not path or weight_kind(module) is None:
            continue
        try:
            new = rename(path)
        except KeyError:  # no kohya name (e.g. SDXL's time_proj): no adapter can target it
            continue
        node = view
        *parents, leaf = new.split(".")
        for part in parents:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.add_module(leaf, module)
    return view


def apply_with_lycoris(path: str | Path, roots: Sequence[tuple[str, nn.Module, Callable]], multiplier: float = 1.0):
    """Load ``path`` with ``lycoris.kohya.create_network_from_weights`` and apply it (forward patching) to the
    modules of ``roots`` (a family's ``adapter_roots``: UNet first, then the text encoders). Returns lycoris'
    network; its ``unet_loras`` / ``text_encoder_loras`` list what it found."""
    (_, unet, rename), te_roots = roots[0][:3], roots[1:]
    unet_view = renamed_view(unet, rename)
    tes = [te if hasattr(te, "text_model") else _TextModel(te) for _, te, *_ in te_roots]
    te_arg = tes if len(tes) > 1 else tes[0] if tes else None  # a list means lora_te1, lora_te2 to LyCORIS
    with _without_timestep_embedding_target() as kohya, _ia3_reads_on_input():
        network, _ = kohya.create_network_from_weights(multiplier, str(path), None, te_arg, unet_view)
        network.apply_to(te_arg, unet_view, apply_text_encoder=bool(tes), apply_unet=True)
    return network
