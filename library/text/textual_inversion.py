"""Textual-inversion embeddings for inference: read any common file layout, add the tokens to the model.

File layouts (docs/formats.md "Textual-inversion embeddings"), detected from the keys:

* A1111 ``.pt``: ``{"string_to_param": {"*": (n, dim)}, "name": ..., ...}``
* sd-scripts SD1/SD2: ``{"emb_params": (n, dim)}`` (.safetensors or .pt)
* sd-scripts / A1111 SDXL: ``{"clip_l": (n, 768), "clip_g": (n, 1280)}``
* diffusers: ``{"<token>": (n, dim)}`` (``learned_embeds.safetensors`` / ``.bin``); 1-D tensors are one vector.

Which key feeds which text encoder is the family's (``family.ti_embedding_keys``: ``("emb_params",)`` for SD1/SD2,
``("clip_l", "clip_g")`` for SDXL). The token written in prompts is the file name without extension, as in A1111,
sd-scripts' gen_img and ComfyUI (``embedding:<name>`` works too). An embedding with n vectors adds the tokens
``name, name_1, ..., name_{n-1}`` (diffusers' naming) to every tokenizer and their rows to the encoders' token
embedding matrices; :func:`token_expansions` tells the prompt encoder (:mod:`library.text.prompt_weighting`) to expand
``name`` to all n ids. Loaded rows equal diffusers' ``load_textual_inversion`` (tested).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from library.families import ti_keys_of_other_families
from library.families.base import Parts
from library.families.protocol import ModelFamily

_COMFY_PREFIX = re.compile(r"\bembedding:(?=\S)")


def read_embedding(path: str | Path, family: ModelFamily) -> list[Tensor]:
    """One (n, dim) float tensor per text encoder of ``family``, from any layout in the module docstring.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file, what it holds and what the family needs.
    """
    path = Path(path)
    raw = _load(path)
    keys: tuple[str, ...] = tuple(family.ti_embedding_keys)
    if isinstance(raw.get("string_to_param"), Mapping):
        params = list(raw["string_to_param"].values())
        if len(params) != 1:
            raise ValueError(f"{path}: string_to_param holds {len(params)} embeddings; expected exactly one")
        raw = {keys[0]: params[0]} if len(keys) == 1 else {"string_to_param": params[0]}
    tensors = {k: v for k, v in raw.items() if isinstance(v, Tensor)}
    if all(k in tensors for k in keys):
        found = [tensors[k] for k in keys]
    elif len(keys) == 1 and len(tensors) == 1 and not ti_keys_of_other_families(family) & set(tensors):
        found = list(tensors.values())
    else:
        raise ValueError(
            f"{path}: holds {sorted(tensors) or 'no tensors'}, but a {family.name} embedding needs "
            f"{' + '.join(keys) if len(keys) > 1 else 'one tensor'}; is it an embedding for another model family?"
        )
    return [(t.unsqueeze(0) if t.ndim == 1 else t).detach().float() for t in found]


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"--textual_inversion_embeddings {path}: no such file")
    if path.suffix.lower() == ".safetensors":
        from library.files.weights import load_state_dict

        return load_state_dict(path)[0]
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path}: holds Python objects besides tensors, so it was not loaded (it could run code); convert it "
            "to .safetensors in a trusted environment"
        ) from e
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected a dict of tensors, found {type(obj).__name__}")
    return dict(obj)


def add_embedding(family: ModelFamily, parts: Parts, path: str | Path, token: str | None = None) -> list[list[int]]:
    """Load the embedding file at ``path`` into ``parts`` (tokenizers and text encoders, in place).

    Returns the new token ids per text encoder. ``token`` defaults to the file name without extension.
    """
    path = Path(path)
    token = token or path.stem
    vectors = read_embedding(path, family)
    counts = {v.shape[0] for v in vectors}
    if len(counts) != 1:
        raise ValueError(f"{path}: the encoders' parts have different vector counts {sorted(counts)}")
    names = [token] + [f"{token}_{i}" for i in range(1, counts.pop())]
    all_ids = []
    for i, (tokenizer, encoder, rows) in enumerate(zip(parts.tokenizers, parts.text_encoders, vectors)):
        table = encoder.get_input_embeddings()
        if rows.shape[1] != table.weight.shape[1]:
            raise ValueError(
                f"{path}: vectors of width {rows.shape[1]}, but text encoder {i + 1} of this {family.name} model "
                f"has width {table.weight.shape[1]}; the embedding was trained for another model"
            )
        if tokenizer.add_tokens(names) != len(names):
            raise ValueError(f"{path}: token {token!r} is already in the tokenizer; rename the file or load it once")
        ids = tokenizer.convert_tokens_to_ids(names)
        encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        table = encoder.get_input_embeddings()
        with torch.no_grad():
            table.weight[ids] = rows.to(table.weight.device, table.weight.dtype)
        expansions_of(parts)[i][ids[0]] = list(ids)
        all_ids.append(list(ids))
    return all_ids


def token_expansions(parts: Parts) -> list[dict[int, list[int]]]:
    """Per tokenizer, ``{first id of an embedding: all its ids}`` (empty dicts when no embedding is loaded)."""
    return parts.token_expansions or [{} for _ in parts.tokenizers]


def expansions_of(parts: Parts) -> list[dict[int, list[int]]]:
    """``parts.token_expansions``, one (empty) dict per tokenizer made the first time, to add an embedding's ids to."""
    if not parts.token_expansions:
        parts.token_expansions = [{} for _ in parts.tokenizers]
    return parts.token_expansions


def strip_embedding_prefix(prompt: str) -> str:
    """ComfyUI writes embeddings as ``embedding:<name>``; the token is ``<name>``."""
    return _COMFY_PREFIX.sub("", prompt)
