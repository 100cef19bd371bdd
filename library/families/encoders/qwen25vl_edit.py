"""Qwen2.5-VL with its vision tower, as the Qwen-Image edit models encode a prompt with its control image(s)
(musubi-tuner's ``qwen_image_utils.get_qwen_prompt_embeds_with_image``, diffusers' ``QwenImageEditPipeline`` /
``QwenImageEditPlusPipeline._get_qwen_prompt_embeds``).

Versions: ``edit`` puts the first control image in its template (:data:`EDIT_TEMPLATE`: ``<|vision_start|>
<|image_pad|><|vision_end|>`` before the caption; musubi-tuner ignores the others); ``edit-2509`` / ``edit-2511``
prefix the caption with ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` per control image
(:data:`EDIT_PLUS_TEMPLATE`). The processor (``Qwen2VLProcessor``: the image processor's resize to multiples of 28
pixels within ``min_pixels`` / ``max_pixels``, 14-pixel patches, CLIP's mean and std, one ``<|image_pad|>`` per
merged 2 x 2 patch) expands the image tokens; the whole model (``Qwen2_5_VLForConditionalGeneration``: its vision
tower, the image features in place of the pad tokens, multimodal RoPE) runs; the last hidden state's real rows are
kept without the template's first 64 tokens (:func:`qwen25vl.trim`). The control images reach the processor as
(H, W, 3) uint8 arrays already resized to the condition area (musubi-tuner: 384 x 384 by
``calculate_bucket_resolution``; the caller resizes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..loading import KeyView, instantiate_fitting
from . import qwen25vl

_SYSTEM = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n"
)
EDIT_TEMPLATE = _SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_TEMPLATE = _SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
EDIT_DROP = 64
VERSIONS = ("edit", "edit-2509", "edit-2511")
CONDITION_AREA = (384, 384)  # the control images' size for the VL model (musubi-tuner, diffusers)

# Qwen2.5-VL-7B-Instruct's preprocessor_config.json (Qwen/Qwen-Image-Edit processor/)
PROCESSOR = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2,
                 image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])  # fmt: skip
# Qwen2.5-VL-7B's vision tower (vision_config) and a tiny one for the tests (out_hidden_size: the text width)
RELEASED_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], in_chans=3, hidden_act="silu")  # fmt: skip
TINY_VISION = dict(RELEASED_VISION, depth=2, hidden_size=16, intermediate_size=32, num_heads=2,
                   out_hidden_size=qwen25vl.TINY_TEXT["hidden_size"], fullatt_block_indexes=[1])  # fmt: skip
IMAGE_PAD_ID, VISION_START_ID, VISION_END_ID = 151655, 151652, 151653


class Processor:
    """Qwen2VLProcessor's image path (transformers' own class needs torchvision for its video half): the image
    processor's ``pixel_values`` / ``image_grid_thw``, each ``<|image_pad|>`` of the texts expanded to one per merged
    patch of its image, in order, then the tokenizer (padded to the batch's longest, right)."""

    def __init__(self, tokenizer: Any = None) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil(**PROCESSOR)
        self.tokenizer = tokenizer or qwen25vl.load_tokenizer()

    def __call__(self, text: Sequence[str], images: Sequence[Any] | None = None, padding: bool = True,
                 return_tensors: str = "pt") -> Any:  # fmt: skip
        from transformers import BatchFeature

        text = [text] if isinstance(text, str) else list(text)
        vision = {}
        images = [images] if images is not None and not isinstance(images, (list, tuple)) else images
        if images:
            vision = dict(self.image_processor(images=list(images), return_tensors="pt"))
            counts = iter((vision["image_grid_thw"].prod(dim=-1) // PROCESSOR["merge_size"] ** 2).tolist())
            pad, mark = "<|image_pad|>", "<|placeholder|>"
            expanded = []
            for t in text:
                while pad in t:
                    t = t.replace(pad, mark * next(counts), 1)
                expanded.append(t.replace(mark, pad))
            text = expanded
        tokens = self.tokenizer(text, padding=padding, return_tensors=return_tensors)
        return BatchFeature({**tokens, **vision}, tensor_type=return_tensors)


def processor(tokenizer: Any = None) -> Processor:
    """The Qwen2.5-VL processor over ``tokenizer`` (default: the shipped one) with :data:`PROCESSOR`'s settings."""
    return Processor(tokenizer)


def _config(text: Mapping, vision: Mapping) -> Any:
    from transformers import Qwen2_5_VLConfig

    skip = ("architectures", "transformers_version", "torch_dtype", "dtype", "model_type")
    cfg = Qwen2_5_VLConfig(text_config={k: v for k, v in dict(text).items() if k not in skip},
                           vision_config=dict(vision), image_token_id=IMAGE_PAD_ID,
                           vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID)  # fmt: skip
    cfg.use_cache = False
    return cfg


def build(text: Mapping, vision: Mapping) -> nn.Module:
    """A ``Qwen2_5_VLForConditionalGeneration`` of the ``text`` and ``vision`` config dicts (random weights)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration(_config(text, vision))


def factory(config: Mapping) -> Any:
    """A ``Qwen2_5_VLModel`` builder (the language model and the vision tower, no ``lm_head``: only hidden states are
    read) for ``config`` = {"text": text config, "vision": vision config}."""
    from transformers import Qwen2_5_VLModel

    return lambda: Qwen2_5_VLModel(_config(config["text"], config["vision"]))


def core(model: nn.Module) -> nn.Module:
    """The ``Qwen2_5_VLModel`` of ``model`` (itself, or a ``Qwen2_5_VLForConditionalGeneration``'s ``.model``)."""
    return model.model if hasattr(model, "lm_head") else model


VISION_PREFIXES = ("visual.", "model.visual.")


def vl_names(keys: Sequence[str]) -> dict[str, str]:
    """``Qwen2_5_VLModel`` key -> file key: the language model under the prefix :func:`qwen25vl.text_names` finds,
    the vision tower under ``visual.`` (ComfyUI's and the official single file, musubi-tuner's
    ``load_qwen2_5_vl``) or ``model.visual.`` (transformers >= 4.52); ``lm_head`` is left out."""
    names = {"language_model." + k: v for k, v in qwen25vl.text_names(keys).items()}
    present = set(keys)
    prefix = next((p for p in VISION_PREFIXES if p + "patch_embed.proj.weight" in present), None)
    if prefix is not None:
        names.update({"visual." + k[len(prefix) :]: k for k in keys if k.startswith(prefix)})
    return names


def load(path: Any, dtype: Any = torch.bfloat16, device: Any = "cpu", *, where: str = "--text_encoder") -> nn.Module:
    """Qwen2.5-VL with its vision tower (``Qwen2_5_VLModel``, eval, no gradients) from the files
    :func:`qwen25vl.read` reads; the released or the tiny config, whichever fits. A file without the vision tower is
    an error naming ``where`` and what to give."""
    state, _ = qwen25vl.read(path)
    names = vl_names(list(state.keys()))
    if "language_model.layers.0.self_attn.q_proj.weight" not in names:
        raise ValueError(f"{where} {path}: no Qwen2.5-VL language model weights (expected keys such as "
                         "model.layers.0.self_attn.q_proj.weight); is this the Qwen2.5-VL text encoder?")  # fmt: skip
    if "visual.patch_embed.proj.weight" not in names:
        raise ValueError(f"{where} {path}: Qwen2.5-VL without its vision tower (no visual.* weights); the edit "
                         "models show it the control images: give the whole Qwen2.5-VL, e.g. ComfyUI's "
                         "qwen_2.5_vl_7b.safetensors or a diffusers Qwen-Image-Edit folder's text_encoder/")  # fmt: skip
    candidates = [({"text": qwen25vl.RELEASED_TEXT, "vision": RELEASED_VISION}, "Qwen2.5-VL-7B"),
                  ({"text": qwen25vl.TINY_TEXT, "vision": TINY_VISION}, "the tiny test encoder")]  # fmt: skip
    model = instantiate_fitting(candidates, factory, KeyView(state, names), "Qwen2.5-VL with its vision tower",
                                Path(path), dtype, device)  # fmt: skip
    return model.eval().requires_grad_(False)


def prompts(captions: Sequence[str], counts: Sequence[int], version: str) -> list[str]:
    """The captions in the template of ``version``, with ``counts[i]`` control images for caption i."""
    if version == "edit":
        return [EDIT_TEMPLATE.format(c) for c in captions]
    return [EDIT_PLUS_TEMPLATE.format("".join(PICTURE.format(k + 1) for k in range(n)) + c)
            for c, n in zip(captions, counts, strict=True)]  # fmt: skip


def vl_images(images: Sequence[Sequence[np.ndarray]], version: str) -> list[np.ndarray]:
    """The flat list of images the processor takes: ``edit`` the first of each caption's, the others all of them."""
    return [imgs[0] for imgs in images] if version == "edit" else [im for imgs in images for im in imgs]


def encode_with_images(model: nn.Module, proc: Any, captions: Sequence[str],
                       images: Sequence[Sequence[np.ndarray]], version: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(states (B, L, D), mask (B, L) int64) of ``captions`` with their control ``images`` ((H, W, 3) uint8 each,
    at least one per caption) for the edit model ``version`` (module docstring)."""
    if version not in VERSIONS:
        raise ValueError(f"unknown edit model version {version!r}; one of {', '.join(VERSIONS)}")
    if len(images) != len(captions) or any(len(i) == 0 for i in images):
        raise ValueError("every caption needs its control image(s)")
    flat = [np.ascontiguousarray(np.asarray(im)[..., :3]) for im in vl_images(images, version)]
    texts = prompts(captions, [len(i) for i in images], version)
    inputs = proc(text=texts, images=flat, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    dtype = next(core(model).visual.parameters()).dtype
    out = core(model)(input_ids=inputs["input_ids"].to(device), attention_mask=inputs["attention_mask"].to(device),
                pixel_values=inputs["pixel_values"].to(device, dtype), image_grid_thw=inputs["image_grid_thw"].to(device),
                output_hidden_states=True, use_cache=False)  # fmt: skip
    return qwen25vl.trim(out.hidden_states[-1], inputs["attention_mask"].to(device), EDIT_DROP)


@torch.no_grad()
def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Seeded normal weights (std 0.02; norms' weights 1) for the tiny test model."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model
