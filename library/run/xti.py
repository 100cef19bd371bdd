"""Extended textual inversion (XTI, Alaluf et al. 2023, "A Neural Space-Time Representation for Text-to-Image
Personalization" / Voynov et al. 2023, "P+: Extended Textual Conditioning in Text-to-Image Generation"): one
embedding per cross-attention layer of the UNet.

sd-scripts' ``train_textual_inversion_XTI.py`` names the UNet's 16 cross-attention layers as the original Stable
Diffusion code numbers their blocks: ``IN01 IN02 IN04 IN05 IN07 IN08 MID OUT03 ... OUT11``. Layer ``L`` of token
``tok`` is the token ``tok_L`` (``tok1_L`` ... for more vectors); a prompt is encoded once per layer with ``tok``
replaced by that layer's token, and each layer attends to its own encoding. The file is ``{layer: (n, dim)}``, 16 keys.

How, without patching the UNet's forward: the 16 encodings are concatenated along the sequence,
``(B, 16·L, D)``, and passed as the UNet's usual ``encoder_hidden_states``; each cross-attention layer's attention
processor (:class:`LayerAttnProcessor`, wrapping the one it had) takes its own ``L``-token slice. The per-layer
encoding is :class:`LayerConditioning`, a family wrapper whose ``encode_tokens`` replaces the base token ids by each
layer's ids (so weighted prompts, long prompts and multi-vector tokens work as with plain embeddings).
:class:`XTIEmbeddings` is the Trainable (the rows of every ``tok_L``, a :class:`TokenEmbeddings`), also used by
gen_img to load files.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from library.cli.problems import ConfigError
from library.families.base import Cond, Parts
from library.families.protocol import ModelFamily
from library.run.token_embeddings import TextualInversionConfig, TokenEmbeddings, token_names
from library.text.textual_inversion import expansions_of

_BLOCK = re.compile(r"^(down_blocks|up_blocks)\.(\d+)\.attentions\.(\d+)\.")
_MID = re.compile(r"^mid_block\.attentions\.(\d+)\.")


def cross_attention_layers(denoiser: nn.Module) -> dict[str, list[nn.Module]]:
    """``{layer name: its cross-attention modules}`` of a diffusers UNet, in the order the forward pass runs them,
    named as sd-scripts' XTI (original block numbers: ``IN{(L+1)i+j+1}``, ``MID``, ``OUT{(L+1)i+j}`` for attention
    block j of level i, L = layers per block). A released SD 1.x / 2.x UNet has 16; a model without cross-attention
    blocks has none."""
    layers_per_block = getattr(getattr(denoiser, "config", None), "layers_per_block", None)
    found: dict[tuple[int, int], tuple[str, list[nn.Module]]] = {}
    for path, module in denoiser.named_modules():
        if not path.endswith(".attn2") or not hasattr(module, "set_processor"):
            continue
        block, mid = _BLOCK.match(path), _MID.match(path)
        if block and isinstance(layers_per_block, int):
            level, j, stride = int(block.group(2)), int(block.group(3)), layers_per_block + 1
            key = (0, stride * level + j + 1) if block.group(1) == "down_blocks" else (2, stride * level + j)
            name = f"IN{key[1]:02d}" if key[0] == 0 else f"OUT{key[1]:02d}"
        elif mid:
            key, name = (1, int(mid.group(1))), "MID" if mid.group(1) == "0" else f"MID{mid.group(1)}"
        else:
            continue
        found.setdefault(key, (name, []))[1].append(module)
    return dict(found[k] for k in sorted(found))


class LayerAttnProcessor:
    """The attention processor of one cross-attention layer: ``encoder_hidden_states`` (B, count·L, D) holds every
    layer's context; this layer attends to slice ``index`` (B, L, D), then runs the processor it wraps."""

    def __init__(self, inner: Any, index: int, count: int):
        self.inner, self.index, self.count = inner, index, count

    def __call__(self, attn: nn.Module, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 *args: Any, **kwargs: Any) -> Tensor:  # fmt: skip
        if encoder_hidden_states is not None:
            total = encoder_hidden_states.shape[1]
            if total % self.count:
                raise ValueError(f"XTI: the context has {total} tokens, not one block per layer of the {self.count} "
                                 "cross-attention layers; encode the prompt with LayerConditioning")  # fmt: skip
            size = total // self.count
            encoder_hidden_states = encoder_hidden_states[:, self.index * size : (self.index + 1) * size]
        return self.inner(attn, hidden_states, encoder_hidden_states, *args, **kwargs)


def install_processors(layers: dict[str, list[nn.Module]]) -> None:
    """Give every layer's cross-attention modules a :class:`LayerAttnProcessor` (once; the wrapped one is kept)."""
    for index, modules in enumerate(layers.values()):
        for module in modules:
            if not isinstance(module.processor, LayerAttnProcessor):
                module.set_processor(LayerAttnProcessor(module.processor, index, len(layers)))


def remove_processors(layers: dict[str, list[nn.Module]]) -> None:
    """Put the wrapped processors back."""
    for modules in layers.values():
        for module in modules:
            if isinstance(module.processor, LayerAttnProcessor):
                module.set_processor(module.processor.inner)


class LayerConditioning:
    """The family, with prompts encoded once per cross-attention layer (see the module docstring): ``encode_tokens``
    gives ``Cond`` (B, count·L, D), layer i's block having every XTI base token replaced by its layer-i token. Every
    other attribute is the family's."""

    def __init__(self, family: ModelFamily, embeddings: Sequence[XTIEmbeddings], count: int):
        self.family, self.embeddings, self.count = family, list(embeddings), count
        self.context_blocks = count  # prompt weighting weights each layer's block as a prompt of its own

    def __getattr__(self, name: str) -> Any:
        return getattr(self.family, name)

    def layer_tokens(self, ids: Tensor, layer: int) -> Tensor:
        for emb in self.embeddings:
            ids = emb.layer_ids(ids, layer)
        return ids

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Every layer's ids in one batch (count·B, L) through the text encoder, then (B, count·L, D)."""
        batch = tokens[0].shape[0]
        stacked = [torch.cat([self.layer_tokens(t, i) for i in range(self.count)]) for t in tokens]
        hidden = self.family.encode_tokens(parts, stacked, clip_skip).hidden_states
        return Cond(torch.cat(hidden.split(batch), dim=1))

    def encode_prompt(self, parts: Parts, captions: list[str], clip_skip: int | None = None,
                      max_token_length: int | None = None, *, pad: bool = True) -> Cond:  # fmt: skip
        return self.encode_tokens(parts, self.family.tokenize(parts, captions, max_token_length, pad=pad), clip_skip)


def layer_token_names(token: str, count: int, layers: Sequence[str]) -> list[str]:
    """sd-scripts' order: layer-major, ``tok_IN01 tok1_IN01 ... tok_IN02 ...``."""
    return [f"{t}_{layer}" for layer in layers for t in token_names(token, count)]


class XTIEmbeddings(TokenEmbeddings):
    """One XTI token: ``vectors`` (layers, n, dim) for the single text encoder of ``parts``. Adds the base tokens
    ``tok tok1 ...`` (what prompts say; their rows are layer 0's and are never trained) and the layer tokens, whose
    rows are the trained tensor ``rows[0]`` (layers·n, dim), layer-major as sd-scripts."""

    def __init__(self, family: ModelFamily, parts: Parts, token: str, vectors: Tensor, layers: Sequence[str],
                 init_word: str | None = None):  # fmt: skip
        if len(parts.text_encoders) != 1:
            raise ValueError(f"XTI: {family.name} has {len(parts.text_encoders)} text encoders; XTI trains and reads "
                             "embeddings for models with one (Stable Diffusion 1.x / 2.x)")  # fmt: skip
        count, dim = vectors.shape[1], vectors.shape[2]
        self.base_ids = _add_base_tokens(parts, token, vectors[0])
        super().__init__(family, parts, token, [vectors.reshape(-1, dim)], init_word,
                         names=layer_token_names(token, count, layers))  # fmt: skip
        self.layers, self.vectors_per_token = list(layers), count
        expansions = expansions_of(parts)[0]
        expansions.pop(self.ids[0][0], None)  # prompts say the base token, never a layer's
        expansions[self.base_ids[0]] = list(self.base_ids)

    @property
    def num_vectors(self) -> int:
        return self.vectors_per_token

    def layer_ids(self, ids: Tensor, layer: int) -> Tensor:
        """``ids`` with this token's base ids replaced by layer ``layer``'s ids."""
        first, n = self.base_ids[0], self.vectors_per_token
        base = (ids >= first) & (ids < first + n)
        return torch.where(base, ids - first + self.ids[0][0] + layer * n, ids)

    def caption(self, text: str) -> str:
        """``tok`` -> ``tok tok1 ...`` (the base tokens; each layer's encoding replaces them by its own)."""
        names = token_names(self.token, self.vectors_per_token)
        return text.replace(self.token, " ".join(names)) if len(names) > 1 else text

    def step_models(self, models: Any) -> Any:
        """The step encodes per layer (:class:`LayerConditioning`) after the caption rewrite."""
        models = super().step_models(models)
        return dataclasses.replace(models, family=LayerConditioning(models.family, [self], len(self.layers)))

    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """sd-scripts' XTI file: ``{layer: (n, dim)}`` for every layer."""
        rows = self.rows[0].detach().to("cpu").reshape(len(self.layers), self.vectors_per_token, -1)
        return {name: (r.to(dtype) if dtype is not None else r).clone() for name, r in zip(self.layers, rows)}

    def bundle_tensors(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        raise ValueError("XTI embeddings cannot be bundled into an adapter file")

    def metadata(self) -> dict[str, str]:
        return {**super().metadata(), "ss_xti_layers": ",".join(self.layers)}


def _add_base_tokens(parts: Parts, token: str, rows: Tensor) -> list[int]:
    """Add ``tok tok1 ...`` to the tokenizer with ``rows`` (n, dim) as their (frozen) rows; their ids."""
    tokenizer, encoder = parts.tokenizers[0], parts.text_encoders[0]
    names = token_names(token, rows.shape[0])
    vocab = tokenizer.get_vocab()
    if any(n in vocab or f"{n}</w>" in vocab for n in names):
        raise ValueError(f"token {token!r} is already in the tokenizer's vocabulary, so it cannot be an XTI token; "
                         "choose a string that is not a word (or rename the file)")  # fmt: skip
    tokenizer.add_tokens(names)
    ids = tokenizer.convert_tokens_to_ids(names)
    old = encoder.get_input_embeddings()
    weight = torch.cat([old.weight.detach(), rows.detach().to(old.weight)])
    encoder.set_input_embeddings(nn.Embedding.from_pretrained(weight, freeze=True, padding_idx=old.padding_idx))
    encoder.config.vocab_size = weight.shape[0]
    return list(ids)


def read_xti(path: str | Path, layers: Sequence[str]) -> Tensor:
    """The (layers, n, dim) rows of an XTI file (sd-scripts' ``{layer: (n, dim)}``, .safetensors or .pt), in the
    order of ``layers`` (the model's). Raises ``FileNotFoundError`` / ``ValueError`` naming the file."""
    from library.text.textual_inversion import _load

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"XTI embedding {path}: no such file")
    raw = {k: v for k, v in _load(path).items() if isinstance(v, Tensor)}
    if set(raw) != set(layers):
        raise ValueError(f"{path}: holds {sorted(raw)}, but an XTI embedding for this model needs one tensor per "
                         f"cross-attention layer: {list(layers)}; a plain textual-inversion file goes to "
                         "--textual_inversion_embeddings, and an XTI file fits the model it was trained for")  # fmt: skip
    shapes = {tuple(t.shape) for t in raw.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"{path}: the layers' tensors must all be (vectors, dim); found {sorted(shapes)}")
    return torch.stack([raw[name].float() for name in layers])


def load_xti_files(family: ModelFamily, parts: Parts, paths: Sequence[Path]) -> LayerConditioning:
    """gen_img's ``--XTI_embeddings``: each file's token (its name without extension) in ``parts``, the UNet's
    cross-attention layers given their processors; the family that encodes prompts per layer."""
    layers = cross_attention_layers(parts.denoiser)
    if not layers or len(parts.text_encoders) != 1:
        raise ValueError(f"--XTI_embeddings: the model is {family.name}; XTI embeddings are for models with one "
                         "text encoder and a UNet with cross-attention (Stable Diffusion 1.x / 2.x)")  # fmt: skip
    embeddings = [XTIEmbeddings(family, parts, Path(p).stem, read_xti(p, list(layers)), list(layers)) for p in paths]
    install_processors(layers)
    return LayerConditioning(family, embeddings, len(layers))


# the sampling flags (and their defaults) train_textual_inversion_XTI.py refuses
SAMPLE_FLAGS = {"sample_every_n_steps": None, "sample_every_n_epochs": None, "sample_at_first": False,
                "sample_prompts": None, "sample_sampler": "ddim", "sample_vae_tiling": "auto"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class XTIConfig(TextualInversionConfig):
    """train_textual_inversion_XTI.py: textual inversion's flags; ``--weights`` is an XTI file."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> XTIConfig:
        problems = []
        for flag, default in SAMPLE_FLAGS.items():
            if getattr(args, flag, default) not in (default, None, False):
                problems.append(f"--{flag}: samples during XTI training are not supported (sd-scripts ignores them "
                                "too); sample the saved file with gen_img_diffusers.py --XTI_embeddings")  # fmt: skip
        try:
            ti = TextualInversionConfig.from_args(args)
        except ConfigError as e:
            problems = list(e.problems) + problems
        if problems:
            raise ConfigError(problems, "XTI options")
        return cls(**{f.name: getattr(ti, f.name) for f in dataclasses.fields(TextualInversionConfig)})
