"""The Qwen2.5-VL-7B text encoder as Qwen-Image (musubi-tuner's ``qwen_image_utils``) and HunyuanImage 2.1 use it:
its tokenizer (shipped), the prompt template with its dropped template tokens, the hidden-states layer, configs and
the released file layouts.

Tokenizer: Qwen2.5's byte-level BPE vocabulary and merges equal Qwen3's, which ships with the package
(``data/qwen3_tokenizer.json.gz``, Apache-2.0); Qwen2.5-VL's added tokens are Qwen3's first 22 (ids 151643
``<|endoftext|>`` ... 151664 ``<|file_sep|>``: ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``,
``<|image_pad|>`` ...), without Qwen3's ``<tool_response>`` / ``<think>`` tokens (151665-151668), which Qwen2.5 splits
as text. Its config: ``eos_token`` ``<|im_end|>``, ``pad_token`` ``<|endoftext|>`` (Qwen/Qwen-Image ``tokenizer/``).
A folder's own tokenizer (``tokenizer.json`` or ``vocab.json`` + ``merges.txt``) is used when given.

Encoding (:func:`encode`): each caption is put into a template, tokenized with padding to the batch's longest,
run through the language model (the vision tower is not needed for text), the chosen hidden-states layer's rows of
real tokens are kept, the template's first ``drop`` tokens are dropped and the rest padded with zeros to the batch's
longest: musubi-tuner's ``get_qwen_prompt_embeds`` (Qwen-Image: :data:`QWEN_IMAGE_TEMPLATE`, drop 34, last layer,
at most 1024 caption tokens).

Weights (:func:`load`): a single file (ComfyUI's ``qwen_2.5_vl_7b.safetensors``, bf16 or fp8 with ``scale_weight``
tensors ("fp8_scaled"), split ``-00001-of-0000N`` files, a transformers file with ``model.language_model.`` names)
or a transformers folder (``text_encoder/`` of a diffusers Qwen-Image folder, sharded). The language model's keys
are found under whatever prefix holds ``embed_tokens.weight`` (``model.``, ``model.language_model.``,
``language_model.model.`` ...); ``visual.*`` / ``lm_head`` are left out for text.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..loading import KeyView, instantiate_fitting, read_weights
from ..tokenizers import _cache_root

log = logging.getLogger(__name__)

QWEN_TOKENIZER_FILE = Path(__file__).parent.parent / "data" / "qwen3_tokenizer.json.gz"  # shared with Anima
LAST_QWEN25_TOKEN = 151664  # <|file_sep|>: Qwen2.5-VL's last added token (Qwen3 adds 151665-151668)
TOKENIZER_CONFIG = {
    "add_prefix_space": False, "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
    "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    "extra_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                             "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
}  # fmt: skip

# Qwen-Image's text prompt (diffusers QwenImagePipeline / musubi-tuner get_qwen_prompt_embeds): 34 template tokens
# dropped, the last layer, captions up to 1024 tokens.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_DROP = 34
QWEN_IMAGE_MAX_LENGTH = 1024

# The released language model (Qwen2.5-VL-7B-Instruct's text_config).
RELEASED_TEXT = dict(
    vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6, rope_theta=1000000.0,
    rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [16, 24, 24]}, hidden_act="silu",
    attention_dropout=0.0, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
    max_window_layers=28, bos_token_id=151643, eos_token_id=151645,
)  # fmt: skip
# The tiny test encoder: the real vocabulary (the shipped tokenizer's ids fit), width 16, head width 8.
TINY_TEXT = dict(
    RELEASED_TEXT, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_window_layers=2,
    rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [1, 1, 2]},
)  # fmt: skip
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.", "")
TEXT_PARTS = ("embed_tokens.", "layers.", "norm.")
SPLIT_FILE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})$")


# ------------------------------------------------------------------------------------------------ tokenizer
def _bundled_folder() -> Path:
    """The Qwen2.5-VL tokenizer built from the shipped Qwen3 vocabulary, written once into the sdtrain cache
    (atomically)."""
    folder = _cache_root() / "qwen25vl_tokenizer"
    if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
        data = json.loads(gzip.decompress(QWEN_TOKENIZER_FILE.read_bytes()))
        data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] <= LAST_QWEN25_TOKEN]
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in (("tokenizer_config.json", json.dumps(TOKENIZER_CONFIG, indent=2)),
                           ("tokenizer.json", json.dumps(data, ensure_ascii=False))):  # fmt: skip
            tmp = folder / f"{name}.tmp{os.getpid()}"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, folder / name)
    return folder


@lru_cache(maxsize=4)
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>"
    tokenizer.padding_side = "right"
    return tokenizer


def load_tokenizer(folder: str | Path | None = None) -> Any:
    """A folder's own Qwen2.5-VL tokenizer (a diffusers Qwen-Image folder, its ``tokenizer/`` subfolder, or any folder
    with ``tokenizer.json`` / ``vocab.json``), else the shipped one (nothing fetched)."""
    if folder is not None:
        for candidate in (Path(folder), Path(folder) / "tokenizer"):
            if candidate.is_dir() and any((candidate / n).is_file() for n in ("tokenizer.json", "vocab.json")):
                return _tokenizer(str(candidate))
    return _tokenizer(str(_bundled_folder()))


def tokenize(tokenizer: Any, captions: Sequence[str], template: str = QWEN_IMAGE_TEMPLATE, drop: int = QWEN_IMAGE_DROP,
             max_length: int = QWEN_IMAGE_MAX_LENGTH) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(ids, attention mask) (B, L) int64 of the captions in ``template``, padded to the batch's longest, at most
    ``max_length + drop`` tokens (truncated), as musubi-tuner's ``get_qwen_prompt_embeds``."""
    texts = [template.format(c) for c in captions]
    out = tokenizer(texts, max_length=max_length + drop, padding=True, truncation=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


# ------------------------------------------------------------------------------------------------ the encoder
def hidden(model: nn.Module, ids: Tensor, mask: Tensor, layer: int = -1) -> Tensor:
    """(B, L, D) hidden states of ``layer`` (an index into transformers' ``hidden_states``; -1: the last, after the
    final norm) of the language model ``model`` (``Qwen2_5_VLTextModel``, or a ``Qwen2_5_VLModel``'s: the text
    alone takes plain positions)."""
    model = getattr(model, "language_model", model)
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=layer != -1,
                use_cache=False, return_dict=True)  # fmt: skip
    return out.last_hidden_state if layer == -1 else out.hidden_states[layer]


def trim(states: Tensor, mask: Tensor, drop: int) -> tuple[Tensor, Tensor]:
    """The rows of real tokens (``mask``) of each caption, its first ``drop`` (template) tokens dropped, padded with
    zeros to the longest: (states (B, L', D), mask (B, L') int64), musubi-tuner's ``extract_masked_hidden`` and
    what follows it."""
    host = mask.detach().cpu().bool()
    lengths = host.sum(dim=1).tolist()
    if all(bool(row[:n].all()) for row, n in zip(host, lengths)):  # right padding: slices, no device-side indexing
        rows = [s[drop:n] for s, n in zip(states, lengths)]
    else:
        keep = mask.to(states.device).bool()
        rows = [s[k][drop:] for s, k in zip(states, keep)]
    longest = max(max(r.shape[0] for r in rows), 1)
    out = states.new_zeros(len(rows), longest, states.shape[-1])
    out_mask = torch.zeros(len(rows), longest, dtype=torch.long, device=states.device)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
        out_mask[i, : row.shape[0]] = 1
    return out, out_mask


def encode(model: nn.Module, tokenizer: Any, captions: Sequence[str], template: str = QWEN_IMAGE_TEMPLATE,
           drop: int = QWEN_IMAGE_DROP, layer: int = -1,
           max_length: int = QWEN_IMAGE_MAX_LENGTH) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(states (B, L, D), mask (B, L) int64) of ``captions``: :func:`tokenize`, :func:`hidden`, :func:`trim`."""
    ids, mask = tokenize(tokenizer, captions, template, drop, max_length)
    return trim(hidden(model, ids, mask, layer), mask, drop)


def factory(config: Mapping):
    """A ``Qwen2_5_VLTextModel`` builder for ``config`` (a text config dict)."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    def make() -> nn.Module:
        cfg = Qwen2_5_VLTextConfig(**{k: v for k, v in dict(config).items()
                                      if k not in ("architectures", "transformers_version", "torch_dtype", "dtype",
                                                   "model_type")})  # fmt: skip
        cfg.use_cache = False
        return Qwen2_5_VLTextModel(cfg)

    return make


# ------------------------------------------------------------------------------------------------ files
class MergedWeights(Mapping):
    """Several weight files (split / sharded) read as one lazy mapping."""

    def __init__(self, sources: Sequence[Mapping[str, Any]]) -> None:
        self.where = {k: s for s in sources for k in s.keys()}

    def __getitem__(self, key: str) -> Tensor:
        return self.where[key][key]

    def shape(self, key: str) -> torch.Size:
        source = self.where[key]
        return torch.Size(source.shape(key) if callable(getattr(source, "shape", None)) else source[key].shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


class Dequantized(Mapping):
    """ComfyUI's "fp8_scaled" files: ``<name>.weight`` (fp8) times ``<name>.scale_weight``, read as float32 weights;
    the scales and the ``scaled_fp8`` marker are left out."""

    def __init__(self, source: Mapping[str, Any]) -> None:
        self.source = source
        self.keys_ = [k for k in source.keys() if not k.endswith((".scale_weight", ".scale_input")) and
                      k != "scaled_fp8"]  # fmt: skip

    def __getitem__(self, key: str) -> Tensor:
        value = self.source[key]
        scale = key[: -len("weight")] + "scale_weight" if key.endswith(".weight") else None
        if scale is not None and scale in self.source:
            return value.float() * self.source[scale].float()
        return value

    def shape(self, key: str) -> torch.Size:
        source = self.source
        return torch.Size(source.shape(key) if callable(getattr(source, "shape", None)) else source[key].shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def weight_files(path: str | Path) -> list[Path]:
    """The files that hold the weights at ``path``: a folder's (or its ``text_encoder/``'s) ``.safetensors`` files,
    all parts of a ``-0000k-of-0000N`` split file, else the file itself. ``FileNotFoundError`` naming what is
    missing."""
    path = Path(path)
    if path.is_dir():
        folder = path / "text_encoder" if (path / "text_encoder").is_dir() else path
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no .safetensors files in this Qwen2.5-VL folder")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Qwen2.5-VL file or folder")
    match = SPLIT_FILE.match(path.stem)
    if match is None:
        return [path]
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}{path.suffix}") for i in range(1, count + 1)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: a split file whose parts are missing: {', '.join(missing)}")
    return files


def read(path: str | Path) -> tuple[Mapping[str, Any], dict[str, str]]:
    """The (lazy) weights of ``path`` (:func:`weight_files`, merged, fp8-scaled files dequantized) and the first
    file's metadata."""
    readers = [read_weights(f) for f in weight_files(path)]
    state = readers[0][0] if len(readers) == 1 else MergedWeights([r for r, _ in readers])
    if "scaled_fp8" in state.keys() or any(k.endswith(".scale_weight") for k in state.keys()):
        state = Dequantized(state)
    return state, readers[0][1]


def text_names(keys: Sequence[str]) -> dict[str, str]:
    """``Qwen2_5_VLTextModel`` key -> file key: the keys under the prefix that holds ``embed_tokens.weight`` (not the
    vision tower's), limited to the language model's parts; {} when there is none."""
    keys = list(keys)
    present = set(keys)
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in present), None)
    if prefix is None:
        found = [k for k in keys if k.endswith("embed_tokens.weight") and "visual" not in k]
        if not found:
            return {}
        prefix = found[0][: -len("embed_tokens.weight")]
    return {k[len(prefix) :]: k for k in keys if k.startswith(prefix) and k[len(prefix) :].startswith(TEXT_PARTS)}


def config_from_shapes(state: Mapping[str, Any], shape, candidates: list[dict]) -> dict | None:
    """A text config read from the weights' shapes (vocabulary, width, depth, MLP width, key/value heads); the head
    width and the rest from the first candidate. None when a tensor it reads is absent."""
    keys = list(state.keys())
    if not candidates or not all(k in keys for k in ("embed_tokens.weight", "layers.0.self_attn.k_proj.weight",
                                                     "layers.0.mlp.gate_proj.weight")):  # fmt: skip
        return None
    base = candidates[0]
    head = base["hidden_size"] // base["num_attention_heads"]
    vocab, width = shape("embed_tokens.weight")
    depth = 1 + max(int(k.split(".")[1]) for k in keys if k.startswith("layers."))
    return dict(base, vocab_size=vocab, hidden_size=width, num_attention_heads=width // head,
                num_key_value_heads=shape("layers.0.self_attn.k_proj.weight")[0] // head,
                intermediate_size=shape("layers.0.mlp.gate_proj.weight")[0], num_hidden_layers=depth,
                max_window_layers=depth)  # fmt: skip


def folder_config(path: str | Path) -> dict | None:
    """The text config of a transformers folder's ``config.json`` (its ``text_config``, or the top level), or
    None."""
    path = Path(path)
    for folder in (path / "text_encoder", path):
        if (folder / "config.json").is_file():
            config = json.loads((folder / "config.json").read_text())
            text = config.get("text_config") or config
            return {k: v for k, v in text.items() if k in RELEASED_TEXT}
    return None


def load(path: str | Path, dtype: Any = torch.bfloat16, device: Any = "cpu", *, where: str = "--text_encoder",
         candidates: Sequence[tuple[dict, str]] | None = None) -> nn.Module:  # fmt: skip
    """The Qwen2.5-VL language model (``Qwen2_5_VLTextModel``, eval mode, no gradients) of ``path`` (module
    docstring's layouts), read tensor by tensor, cast to ``dtype`` on ``device``; built from the folder's config,
    else the first of ``candidates`` (default: released, tiny) that fits, else the weights' shapes. Messages name
    ``where`` (the flag)."""
    state, _ = read(path)
    names = text_names(list(state.keys()))
    if "layers.0.self_attn.q_proj.weight" not in names:
        raise ValueError(f"{where} {path}: no Qwen2.5-VL language model weights (expected keys such as "
                         "model.layers.0.self_attn.q_proj.weight); is this the Qwen2.5-VL text encoder?")  # fmt: skip
    options = list(candidates or [(RELEASED_TEXT, "Qwen2.5-VL-7B"), (TINY_TEXT, "the tiny test encoder")])
    config = folder_config(path) if Path(path).is_dir() else None
    if config is not None:
        options.insert(0, (dict(RELEASED_TEXT, **config), f"{path}'s config.json"))
    model = instantiate_fitting(options, factory, KeyView(state, names), "Qwen2.5-VL", Path(path), dtype, device,
                                derive=config_from_shapes)  # fmt: skip
    return model.eval().requires_grad_(False)


def store_fp8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """``--fp8_vl`` (musubi-tuner's meaning): the language model's Linear weights stored in float8_e4m3fn by a plain
    cast (musubi-tuner's ``load_qwen2_5_vl`` with a float8 dtype; no scale), each computed in ``compute_dtype`` (the
    shared float8 storage, ``library/device/fp8.py``: norms and the token embedding stay in ``compute_dtype``).
    Halves the 15 GB of bf16 weights to about 8 GB; the outputs differ from bf16's by float8's rounding. Returns
    how many layers were stored."""
    from library.device.fp8 import store_in_fp8

    return store_in_fp8(model, compute_dtype)


# ------------------------------------------------------------------------------------------------ float8 storage
FP8 = torch.float8_e4m3fn


class Fp8Linear(nn.Module):
    """A frozen Linear whose weight and bias are stored in float8 (e4m3fn, cast without a scale) and computed in
    ``compute_dtype``: what ``F.linear`` under sd-scripts' bf16 autocast computes with its float8 weights."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = linear.in_features, linear.out_features, compute_dtype
        self.weight = nn.Parameter(linear.weight.detach().to(FP8), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(FP8), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        dtype = self.compute_dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)


class Fp8RMSNorm(nn.Module):
    """An RMS norm whose weight is stored in float8 and applied in float32: ``(w · x / rms(x))`` computed in float32,
    then cast to the input's dtype (sd-scripts' ``--fp8_vl`` norm forward)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.variance_epsilon = float(norm.variance_epsilon)
        self.weight = nn.Parameter(norm.weight.detach().to(FP8), requires_grad=False)

    def forward(self, hidden_states: Tensor) -> Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x).to(hidden_states.dtype)


def store_fp8_as_sd_scripts(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> int:
    """``--fp8_vl`` as sd-scripts' HunyuanImage ``load_qwen2_5_vl`` with ``dtype=float8_e4m3fn`` does it (unlike
    :func:`store_fp8`, musubi-tuner's meaning, the norms and biases are stored in float8 too): the Qwen2.5-VL
    language model's Linear weights and biases and its RMS norm weights stored in float8
    (e4m3fn, no scale), the Linears computed in ``compute_dtype`` (bf16), the norms in float32; the token embedding
    keeps its dtype (sd-scripts puts it back to bf16). About half the bf16 size: 7.6 GB instead of 15.2 GB for the
    7B language model. In place (parameter names unchanged); returns how many modules were replaced.

    On purpose unlike sd-scripts: its ``model.to(float8)`` also rounds the rotary embedding's ``inv_freq`` buffer
    to float8 (its smallest frequencies become 0); here it stays float32. Its float32 residual add after attention
    is what a bf16 add gives (one rounding of the exact sum), so nothing replaces the decoder layer."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Fp8Linear(child, compute_dtype))
            elif type(child).__name__.endswith("RMSNorm") and hasattr(child, "variance_epsilon"):
                setattr(parent, name, Fp8RMSNorm(child))
            else:
                continue
            count += 1
    return count
