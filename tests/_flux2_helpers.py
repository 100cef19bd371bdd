"""The tiny FLUX.2 files the FLUX.2 tests share: written once per session from ``FLUX2.tiny.build(seed=0)``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def flux2_files(tmp_path_factory) -> dict:
    """{"parts": the tiny model, "dit" (BFL names), "text_encoder" (the first of a split Qwen3 pair), "vae" (BFL
    names), "root": their folder}."""
    from library.families.flux2 import FLUX2

    root = tmp_path_factory.mktemp("flux2_tiny")
    parts = FLUX2.tiny.build(seed=0)
    files = {k: str(v) for k, v in FLUX2.tiny.write_files(parts, root, "tiny").items()}
    return {"parts": parts, "root": Path(root), **files}


def tiny_mistral_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer with Mistral's chat markers and a chat template of Mistral's shape (``<s>[SYSTEM_PROMPT]
    ...[/SYSTEM_PROMPT][INST]...[/INST]``), saved as a transformers folder: Mistral's own is not shipped."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]
    words = "a red cube on the table sks shape you are an ai that reasons about image descriptions".split()
    vocab = {w: i for i, w in enumerate(special + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=special[4:])  # fmt: skip
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content[0].text }}"
        "[/SYSTEM_PROMPT]{% else %}[INST]{{ m.content[0].text }}[/INST]{% endif %}{% endfor %}"
    )
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def flux2_dev_files(tmp_path_factory) -> dict:
    """A tiny FLUX.2 dev: the DiT with its guidance embedding (BFL names), Mistral 3's language model as the released
    split ``text_encoder/model-0000k-of-00002.safetensors`` (``model.language_model.`` names, with a vision-tower key
    and ``lm_head`` that are not read) and ``tokenizer/`` beside it, the klein tiny's AE."""
    import torch

    from library.families.encoders import mistral3
    from library.families.flux2 import FLUX2
    from library.families.flux2 import model as M
    from library.families.flux2.saving import save_vae
    from library.families.flux2.tiny import randomize
    from library.files.weights import save_state_dict

    root = tmp_path_factory.mktemp("flux2_dev_tiny")
    klein = FLUX2.tiny.build(seed=0)
    denoiser = M.build(dict(M.TINY, guidance_embeds=True))
    randomize(denoiser, 4)
    encoder = mistral3.factory(mistral3.TINY)()
    randomize(encoder, 5)
    for m in (denoiser, encoder):
        m.eval().requires_grad_(False)
    (root / "text_encoder").mkdir()
    state = {"model.language_model." + k: v for k, v in encoder.state_dict().items()}
    state |= {"model.vision_tower.patch_conv.weight": torch.zeros(2, 3, 1, 1), "lm_head.weight": torch.zeros(4, 16)}
    names = sorted(state)
    shards = [root / "text_encoder" / f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for shard, part in zip(shards, (names[: len(names) // 2], names[len(names) // 2 :])):
        save_state_dict({k: state[k] for k in part}, shard, {"format": "pt"})
    tiny_mistral_tokenizer(root / "tokenizer")
    parts = dataclasses.replace(klein, denoiser=denoiser, text_encoders=[encoder])
    from library.families.flux2.saving import save_dit

    dit = save_dit(parts, root / "flux2-dev.safetensors", FLUX2)
    vae = save_vae(parts, root / "ae.safetensors")
    return {
        "denoiser": denoiser,
        "encoder": encoder,
        "dit": str(dit),
        "vae": str(vae),
        "text_encoder": str(shards[0]),
        "tokenizer": root / "tokenizer",
        "root": root,
    }
