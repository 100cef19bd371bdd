"""A tiny Lumina Image 2.0 model with the real module structure and random weights (tests, demo,
``tools/make_tiny_model.py --family lumina2``).

A ``Lumina2Transformer2DModel`` of width 32 (2 heads of 16, 1 KV head: grouped-query attention as the 2B model's 24 /
8; rope axes 4+6+6; feed-forward width rounded to the released ``multiple_of`` 256, which sd-scripts' loader
hard-codes), 2 layers and 2 noise / context refiner blocks; a 2-layer ``Gemma2Model`` of width 32 (the
transformer's caption width) over a character-level tokenizer with Gemma's special ids (``<pad>`` 0, ``<eos>`` 1,
``<bos>`` 2, ``<unk>`` 3; BOS added), built with the ``tokenizers`` library (Gemma's own tokenizer is gated); the shared
tiny 16-channel AE (FLUX's scale and shift).
"""

from __future__ import annotations

import argparse
import copy
import json
import string
from pathlib import Path
from typing import Any

import torch

from library.families.protocol import ModelFamily

from ..autoencoders import flux_ae
from ..base import Parts
from . import keys as K
from .model import SCHEDULER, TOKENIZER_FILE, gemma_factory, transformer_factory

TRANSFORMER = dict(
    sample_size=16, patch_size=2, in_channels=16, hidden_size=32, num_layers=2, num_refiner_layers=2,
    num_attention_heads=2, num_kv_heads=1, multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-5,
    scaling_factor=1.0, axes_dim_rope=[4, 6, 6], axes_lens=[300, 512, 512], cap_feat_dim=32,
)  # fmt: skip
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
CHARS = string.ascii_letters + string.digits + string.punctuation + " "
VOCAB = {tok: i for i, tok in enumerate((*SPECIALS, *CHARS))}
GEMMA = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=64, max_position_embeddings=512,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip
AE = dict(flux_ae.TINY_AE)


def tokenizer_object() -> Any:
    """The tiny character-level tokenizer (``tokenizers.Tokenizer``): one token per character, BOS first."""
    from tokenizers import Tokenizer, models, processors

    tok = Tokenizer(models.BPE(vocab=dict(VOCAB), merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", VOCAB["<bos>"])])  # fmt: skip
    return tok


def tiny_tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer_object(), bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")  # fmt: skip
    tokenizer.padding_side = "right"
    return tokenizer


def write_tokenizer(folder: str | Path) -> Path:
    """Write the tiny tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder`` (what a user's Gemma
    folder holds); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_object().save(str(folder / TOKENIZER_FILE))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "padding_side": "right", "add_bos_token": True}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def build_tiny_lumina(seed: int = 0, layers: int | None = None) -> Parts:
    """A tiny Lumina 2 model (fp32, CPU, eval, frozen) with deterministic weights; ``layers``: transformer layers
    instead of 2 (``--blocks_to_swap`` tests)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    config = dict(TRANSFORMER, **({"num_layers": layers} if layers else {}))
    denoiser = transformer_factory(config)()
    for p in denoiser.parameters():  # zero-initialised biases random too, so the tests see every path
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.1)
    vae = AutoencoderKL(**AE)
    gemma = gemma_factory(GEMMA)()
    for module in (denoiser, vae, gemma):
        module.eval().requires_grad_(False)
    return Parts(denoiser, vae, [gemma], [tiny_tokenizer()], copy.deepcopy(SCHEDULER), "lumina2", "tiny-lumina2")


def write_tiny_files(parts: Parts, folder: str | Path, *, prefix: str = "", ae_ldm: bool = True,
                     gemma_prefix: str = "model.") -> dict[str, Path]:  # fmt: skip
    """Write ``parts`` as the files sd-scripts' Lumina scripts take, without metadata: ``model`` (the Alpha-VLLM
    transformer, keys under ``prefix``), ``gemma2`` (Gemma2 keys under ``gemma_prefix``, as google's checkpoint), ``ae``
    (BFL/LDM names, or diffusers names) and the tiny tokenizer files beside them. Returns ``{name: path}``."""
    from safetensors.torch import save_file

    from ..convert import vae_to_ldm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    alpha = K.diffusers_to_alpha(parts.denoiser.state_dict(), prefix=prefix)
    vae = parts.vae
    ae = vae_to_ldm(vae.state_dict(), vae.config) if ae_ldm else dict(vae.state_dict())
    gemma = {gemma_prefix + k: v for k, v in parts.text_encoders[0].state_dict().items()}
    files = {"model": (folder / "model.safetensors", alpha), "gemma2": (folder / "gemma2.safetensors", gemma),
             "ae": (folder / "ae.safetensors", ae)}  # fmt: skip
    for path, state in files.values():
        save_file({k: v.contiguous() for k, v in state.items()}, path)
    write_tokenizer(folder)
    return {name: path for name, (path, _) in files.items()}


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lumina_layers", type=int, default=2, help="Lumina 2 transformer layers (default 2)")


class LuminaTiny:
    """The tiny model (``ModelFamily.tiny``; see ``base.TinyModel``)."""

    by_default = False
    add_tool_args = staticmethod(add_tool_args)

    def __init__(self, family: ModelFamily) -> None:
        self.family = family

    def build(self, seed: int = 0, *, layers: int | None = None) -> Parts:
        return build_tiny_lumina(seed, layers)

    def write_folder(self, parts: Parts, folder: str | Path) -> Path:
        return Path(self.family.save(parts, folder))

    def write_files(self, parts: Parts, out: str | Path, name: str) -> dict[str, Path]:
        """sd-scripts' ``--gemma2`` and ``--ae`` files beside the Alpha-VLLM transformer (and the tokenizer files)."""
        out = Path(out)
        tmp = out / f".{name}_parts"
        written = {part: path.replace(out / f"{name}_{part}.safetensors")
                   for part, path in write_tiny_files(parts, tmp).items() if part != "model"}  # fmt: skip
        (tmp / "model.safetensors").unlink()
        for extra in tmp.iterdir():
            extra.replace(out / extra.name)
        tmp.rmdir()
        return written

    def tool_options(self, args: argparse.Namespace) -> dict[str, Any]:
        return {"layers": args.lumina_layers}

    def part_configs(self) -> dict[str, Any]:
        return {"transformer": dict(TRANSFORMER), "vae": dict(AE), "text_encoder": dict(GEMMA)}
