"""CLIP text encoders (CLIP-L, OpenCLIP-bigG "CLIP-G") as several families use them: the transformers classes and
configs, their single files, and the 77-token prompts of the DiT families.

The tokenizers (the bundled CLIP vocabulary, per-encoder pad tokens) are in ``tokenizers.py``; HF <-> single-file key
names in ``convert.py``. The SD families' chunked prompts (``--max_token_length`` 150 / 225) are their own
(``sd/text.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn

from ..convert import clip_from_ldm, strip_prefix
from ..loading import shipped_configs

LENGTH = 77  # CLIP's context: <BOS> 75 tokens <EOS>

# The tiny test encoders (the families' tiny models): 2 layers of 4 heads and the real vocabulary, so prompts
# tokenize as with the released models. CLIP-G is wider than CLIP-L, as bigG (1280) is wider than CLIP-L (768):
# diffusers' single-file loader tells SDXL's two encoders apart by width.
TINY_COMMON = dict(
    vocab_size=49408,
    max_position_embeddings=77,
    num_attention_heads=4,
    num_hidden_layers=2,
    bos_token_id=49406,
    eos_token_id=49407,
)
TINY_CLIP_L = dict(hidden_size=32, intermediate_size=64, projection_dim=32, hidden_act="quick_gelu")
TINY_CLIP_G = dict(hidden_size=48, intermediate_size=96, projection_dim=48, hidden_act="gelu")
PAD_ID_CLIP_L, PAD_ID_OPEN_CLIP = 49407, 0  # <|endoftext|>, "!"


def released_config(index: int) -> dict:
    """The released CLIP-L (``index`` 0) or CLIP-G (1) config (``CLIPTextModelWithProjection``; as SDXL base's shipped
    configs hold them), a fresh copy."""
    return shipped_configs("sdxl-base")["text_encoders"][index]


def text_encoder_class(with_projection: bool) -> type:
    """``CLIPTextModelWithProjection`` (a projected pooled output: SDXL's CLIP-G, SD3's CLIP-L and CLIP-G) or
    ``CLIPTextModel``."""
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection if with_projection else CLIPTextModel


def factory(config: Mapping, with_projection: bool = False) -> Callable[[], nn.Module]:
    """A function that builds the encoder of ``config`` (a ``CLIPTextConfig`` as a dict)."""
    from transformers import CLIPTextConfig

    cls = text_encoder_class(with_projection)
    return lambda: cls(CLIPTextConfig.from_dict(dict(config)))


def config_from_shapes(state: Mapping[str, Any], shape: Callable[[str], tuple[int, ...]],
                       candidates: list[dict]) -> dict | None:  # fmt: skip
    """A CLIP text config read from canonical weights (``loading.Derive``): vocabulary, width, positions, depth, MLP
    width and projection from the shapes; the head count from a head width of 64 (every released CLIP) or of a
    candidate that divides the width; the rest (activation, token ids) from the first candidate. None when no head
    width fits."""
    p = "text_model."
    keys = list(state.keys())
    if p + "embeddings.token_embedding.weight" not in keys or not candidates:
        return None
    vocab, width = shape(p + "embeddings.token_embedding.weight")
    head_widths = [64] + [c["hidden_size"] // c["num_attention_heads"] for c in candidates]
    head = next((h for h in head_widths if h > 0 and width % h == 0), None)
    if head is None:
        return None
    depth = 1 + max(int(k.split(".")[3]) for k in keys if k.startswith(p + "encoder.layers."))
    config = dict(candidates[0], vocab_size=vocab, hidden_size=width, num_attention_heads=width // head,
                  num_hidden_layers=depth, intermediate_size=shape(p + "encoder.layers.0.mlp.fc1.weight")[0],
                  max_position_embeddings=shape(p + "embeddings.position_embedding.weight")[0])  # fmt: skip
    if "text_projection.weight" in keys:
        config["projection_dim"] = shape("text_projection.weight")[0]
    return config


def canonical_weights(state: Mapping[str, Any], prefixes: Iterable[str]) -> dict[str, Tensor] | None:
    """A CLIP single file's (or a model file part's) tensors under canonical HF names (``text_model.`` level, see
    ``convert.hf_state_dict``), each of ``prefixes`` the keys carry removed in turn; None when it holds no CLIP
    encoder layers."""
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in state.keys()):
            state = strip_prefix(state, prefix)
    if not any("encoder.layers.0.self_attn.q_proj.weight" in k for k in state.keys()):
        return None
    return clip_from_ldm(dict(state.items()))


def tokenize(tokenizer, captions: list[str]) -> tuple[Tensor, Tensor]:
    """(ids (B, 77), attention mask (B, 77)): ``<BOS> tokens <EOS> <pad>...``, truncated (``--max_token_length`` does
    not apply)."""
    out = tokenizer(list(captions), max_length=LENGTH, padding="max_length", truncation=True, return_tensors="pt")
    return out.input_ids, out.attention_mask


def pooled(clip: nn.Module, ids: Tensor) -> Tensor:
    """(B, D) ``pooler_output`` (the final-normed state at the EOS token, no projection)."""
    device = next(clip.parameters()).device
    return clip(ids.to(device), return_dict=True).pooler_output


def penultimate_and_projected(clip: nn.Module, ids: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(penultimate hidden state (B, 77, D), projected pooled ``text_embeds`` (B, P)) of a
    ``CLIPTextModelWithProjection``; ``mask`` is its attention mask when given."""
    device = next(clip.parameters()).device
    out = clip(ids.to(device), attention_mask=None if mask is None else mask.to(device), output_hidden_states=True,
               return_dict=True)  # fmt: skip
    return out.hidden_states[-2], out.text_embeds
