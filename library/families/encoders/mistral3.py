"""Mistral 3 (Mistral-Small-3.1-24B's language model) as FLUX.2 dev's text encoder: the model builder (transformers'
``MistralModel``; the vision tower and the projector are not needed for text), key names, the released file layouts
and the tokenizer found beside the weights.

Weights (:func:`load`): a transformers ``Mistral3ForConditionalGeneration`` file or split set (BFL's FLUX.2-dev
``text_encoder/model-00001-of-00010.safetensors`` ...; give the first part), its language model under
``model.language_model.`` (transformers >= 4.52), ``language_model.model.`` (older) or ``model.``; ``lm_head``, the
vision tower and the projector are left out.

Tokenizer (:func:`load_tokenizer`): Mistral's tokenizer is not shipped (its licence and size), and nothing is
downloaded: the folder given, its ``tokenizer/``, or the ``tokenizer/`` beside the weights' folder (the layout of
black-forest-labs/FLUX.2-dev). Prompts (:func:`tokenize`): the system message and the caption as the chat
template's turns, padded to 512 tokens (diffusers' ``Flux2Pipeline._get_mistral_3_small_prompt_embeds``,
musubi-tuner's ``Mistral3Embedder``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..loading import KeyView, instantiate_fitting
from . import qwen3

PREFIXES = ("model.language_model.", "language_model.model.", "model.")
SYSTEM_MESSAGE = ("You are an AI that reasons about image descriptions. You give structured responses focusing on "
                  "object relationships, object\nattribution and actions without speculation.")  # fmt: skip
# Mistral-Small-3.1-24B's text_config (musubi-tuner's M3_CONFIG_JSON)
RELEASED = dict(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1000000000.0, sliding_window=None,
                tie_word_embeddings=False)  # fmt: skip
# the tiny test encoder: the real vocabulary, 30 layers (FLUX.2 reads hidden states 10, 20, 30) at width 16
TINY = dict(RELEASED, hidden_size=16, intermediate_size=32, num_hidden_layers=30, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8)  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tekken.json", "tokenizer.model")


def factory(config: Mapping):
    """A ``MistralModel`` builder for ``config`` (a text config dict)."""
    from transformers import MistralConfig, MistralModel

    def make() -> nn.Module:
        cfg = MistralConfig(**{k: v for k, v in dict(config).items()
                               if k not in ("architectures", "transformers_version", "torch_dtype", "dtype",
                                            "model_type")})  # fmt: skip
        cfg.use_cache = False
        return MistralModel(cfg)

    return make


def names(keys: Sequence[str]) -> dict[str, str]:
    """``MistralModel`` key -> file key: the keys under the prefix that holds ``embed_tokens.weight``."""
    keys = list(keys)
    present = set(keys)
    prefix = next((p for p in PREFIXES if p + "embed_tokens.weight" in present), "")
    return {k[len(prefix) :]: k for k in keys if k.startswith(prefix) and k[len(prefix) :].startswith(
        ("embed_tokens.", "layers.", "norm."))}  # fmt: skip


def load(path: str | Path, candidates: Sequence[tuple[dict, str]], dtype: Any = torch.bfloat16, device: Any = "cpu",
         *, where: str = "--text_encoder") -> nn.Module:  # fmt: skip
    """The ``MistralModel`` (eval mode, no gradients) of ``path`` (a file, a split set's first part or a folder):
    the first of ``candidates`` that fits."""
    state = qwen3.read(path, where)
    view = KeyView(state, names(list(state.keys())))
    if "layers.0.self_attn.q_proj.weight" not in view.names or "layers.0.self_attn.q_norm.weight" in view.names:
        raise ValueError(f"{where} {path}: no Mistral 3 language model weights (expected "
                         "model.language_model.layers.0.self_attn.q_proj.weight); FLUX.2 dev's text encoder is "
                         "Mistral-Small-3.1's")  # fmt: skip
    model = instantiate_fitting(list(candidates), factory, view, "Mistral 3", Path(path), dtype, device)
    return model.eval().requires_grad_(False)


@lru_cache(maxsize=4)
def _tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.padding_side = "right"
    return tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """Mistral's tokenizer beside the text encoder ``path`` (module docstring); ``ValueError`` saying where it was
    looked for."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    candidates = [folder, folder / "tokenizer", folder.parent / "tokenizer"]
    for c in candidates:
        if any((c / n).is_file() for n in TOKENIZER_FILES):
            return _tokenizer(str(c))
    raise ValueError(f"--text_encoder {path}: FLUX.2 dev's Mistral tokenizer was not found (looked in "
                     f"{', '.join(str(c) for c in candidates)}); it is not shipped and nothing is downloaded: keep "
                     "black-forest-labs/FLUX.2-dev's tokenizer/ folder beside text_encoder/")  # fmt: skip


def tokenize(tokenizer: Any, captions: Sequence[str], length: int) -> tuple[Tensor, Tensor]:
    """(ids, mask) (B, ``length``) of each caption as the user turn after the system message, padded and truncated
    to ``length`` (diffusers' ``format_input`` + ``apply_chat_template``; ``[IMG]`` removed from captions)."""
    messages = [[{"role": "system", "content": [{"type": "text", "text": SYSTEM_MESSAGE}]},
                 {"role": "user", "content": [{"type": "text", "text": c.replace("[IMG]", "")}]}]
                for c in captions]  # fmt: skip
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True,
                                        return_tensors="pt", padding="max_length", truncation=True,
                                        max_length=length)  # fmt: skip
    return out["input_ids"], out["attention_mask"]
