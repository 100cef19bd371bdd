"""Lumina Image 2.0's parts: the transformer (diffusers ``Lumina2Transformer2DModel``), Gemma-2-2B (transformers
``Gemma2Model``, the config sd-scripts hard-codes in ``lumina_util.load_gemma2``) with its tokenizer, and the
prompts' rule.

Prompts (sd-scripts' ``strategy_lumina``): a caption becomes ``system_prompt + " <Prompt Start> " + caption`` (the
caption alone when the system prompt is empty; negative prompts get no system prompt), tokenized by Gemma's
tokenizer with BOS, right padding to ``--gemma2_max_token_length`` (default 256), truncation, padded to a multiple of
8; the condition is Gemma's ``hidden_states[-2]`` (B, L, 2304) with the attention mask (B, L).

Gemma's tokenizer is gated on the hub and not shipped here: :func:`load_gemma_tokenizer` reads ``tokenizer.json``
from the user's folders (the diffusers pipeline's ``tokenizer/``, the folder of the ``--gemma2`` file or the folder
given as ``--gemma2``, ``--tokenizer_cache_dir``) and names the file and the places it looked when none has it.
"""

from __future__ import annotations

import copy
import glob
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

GEMMA_ID = "google/gemma-2-2b"
PROMPT_START = "<Prompt Start>"
DEFAULT_MAX_LENGTH = 256
TOKENIZER_FILE = "tokenizer.json"

# diffusers' Lumina2Transformer2DModel defaults are the 2B model's, except cap_feat_dim (Gemma-2-2B: 2304)
TRANSFORMER = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    hidden_size=2304,
    num_layers=26,
    num_refiner_layers=2,
    num_attention_heads=24,
    num_kv_heads=8,
    multiple_of=256,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    scaling_factor=1.0,
    axes_dim_rope=[32, 32, 32],
    axes_lens=[300, 512, 512],
    cap_feat_dim=2304,
)
# sd-scripts' lumina_util.load_gemma2 (google/gemma-2-2b's config.json)
GEMMA2 = dict(
    attention_bias=False,
    attention_dropout=0.0,
    attn_logit_softcapping=50.0,
    bos_token_id=2,
    eos_token_id=1,
    final_logit_softcapping=30.0,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=2304,
    initializer_range=0.02,
    intermediate_size=9216,
    max_position_embeddings=8192,
    num_attention_heads=8,
    num_hidden_layers=26,
    num_key_value_heads=4,
    pad_token_id=0,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-06,
    rope_theta=10000.0,
    sliding_window=4096,
    vocab_size=256000,
)
# Lumina2Pipeline's scheduler (FlowMatchEulerDiscreteScheduler) with sd-scripts' sampling shift 6.0 (its
# --discrete_flow_shift default); what Parts.prediction_type reports
SCHEDULER = dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False, prediction_type="flow_matching")


def released() -> dict:
    """``{"transformer", "text_encoder", "scheduler"}`` of the released 2B model, a fresh copy."""
    return copy.deepcopy({"transformer": TRANSFORMER, "text_encoder": GEMMA2, "scheduler": SCHEDULER})


def transformer_factory(config: Mapping) -> Callable[[], nn.Module]:
    from diffusers import Lumina2Transformer2DModel

    return lambda: Lumina2Transformer2DModel.from_config(dict(config))


def gemma_factory(config: Mapping) -> Callable[[], nn.Module]:
    """``Gemma2Model`` with sd-scripts' attention (:func:`use_sd_scripts_attention`)."""
    from transformers import Gemma2Config, Gemma2Model

    def build() -> nn.Module:
        cfg = Gemma2Config(**dict(config))
        use_sd_scripts_attention(cfg)
        return Gemma2Model(cfg)

    return build


def use_sd_scripts_attention(config: Any) -> None:
    """Gemma-2's attention as sd-scripts computes it: its ``load_gemma2`` builds ``Gemma2Model._from_config`` under
    transformers 4.54 (its requirements), which picks SDPA, and SDPA there leaves out the config's attention logit
    soft-capping (tanh(x / 50) · 50). transformers 5 runs Gemma-2 with eager attention only (which applies the cap),
    so the cap is turned off in ``config`` (``attn_logit_softcapping`` None): the conditioning sd-scripts trains Lumina
    2 LoRAs on (benchmarks/lumina_vs_sdscripts.py compares the hidden states)."""
    config._attn_implementation = "eager"
    config.attn_logit_softcapping = None


# ------------------------------------------------------------------------------------------------ the tokenizer
def tokenizer_candidates(folders: Sequence[Path | None], cache_dir: str | None) -> list[Path]:
    """Where Gemma's tokenizer is looked for, in order: each folder and its ``tokenizer/``, then ``cache_dir`` as
    sd-scripts' ``--tokenizer_cache_dir`` (``<dir>/google_gemma-2-2b``, and the hub cache layout
    ``<dir>/models--google--gemma-2-2b/snapshots/*``)."""
    found: list[Path] = []
    for folder in folders:
        if folder is not None:
            found += [Path(folder) / "tokenizer", Path(folder)]
    if cache_dir:
        root = Path(cache_dir)
        found += [root / GEMMA_ID.replace("/", "_"), root]
        found += [Path(p) for p in sorted(glob.glob(str(root / "models--google--gemma-2-2b" / "snapshots" / "*")))]
    unique: list[Path] = []
    for p in found:
        if p not in unique:
            unique.append(p)
    return unique


def load_gemma_tokenizer(folders: Sequence[Path | None], cache_dir: str | None) -> Any:
    """Gemma's fast tokenizer (right padding) from the first candidate folder holding ``tokenizer.json``; a
    ``FileNotFoundError`` naming the file and every folder looked in otherwise."""
    candidates = tokenizer_candidates(folders, cache_dir)
    for folder in candidates:
        if (folder / TOKENIZER_FILE).is_file():
            tokenizer = _read_tokenizer(folder)
            tokenizer.padding_side = "right"
            log.info("Gemma tokenizer: %s", folder / TOKENIZER_FILE)
            return tokenizer
    looked = ", ".join(str(c) for c in candidates) or "(no folder given)"
    raise FileNotFoundError(
        f"Gemma-2's tokenizer file {TOKENIZER_FILE} was not found (looked in: {looked}). It is gated on the hub "
        f"({GEMMA_ID}), so sdtrain does not download it: put {TOKENIZER_FILE} (and tokenizer_config.json) from "
        f"{GEMMA_ID} next to the --gemma2 file, or pass --tokenizer_cache_dir DIR with DIR/google_gemma-2-2b/"
        f"{TOKENIZER_FILE}"
    )


def _read_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / TOKENIZER_FILE), bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")  # fmt: skip


# ------------------------------------------------------------------------------------------------ prompts
def with_system_prompt(captions: Sequence[str], system_prompt: str | None) -> list[str]:
    """sd-scripts' rule: ``f"{system_prompt} <Prompt Start> {caption}"``, the caption alone for an empty prompt."""
    head = f"{system_prompt} {PROMPT_START} " if system_prompt else ""
    return [head + c for c in captions]


def tokenize(tokenizer: Any, texts: Sequence[str], max_length: int) -> tuple[Tensor, Tensor]:
    """(ids (B, L), mask (B, L) int64): padded to ``max_length`` then to a multiple of 8, truncated, right padding."""
    out = tokenizer(list(texts), max_length=max_length, return_tensors="pt", padding="max_length", truncation=True,
                    pad_to_multiple_of=8)  # fmt: skip
    return out.input_ids, out.attention_mask


def gemma_hidden(gemma: nn.Module, ids: Tensor, mask: Tensor) -> Tensor:
    """Gemma's ``hidden_states[-2]`` (B, L, D) for ``ids`` with ``mask`` (sd-scripts' ``LuminaTextEncodingStrategy``)."""
    device = next(gemma.parameters()).device
    out = gemma(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True, return_dict=True)
    return out.hidden_states[-2]


def time_of(t: Tensor, batch: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The model time τ = 1 − t / 1000 (B,) for the step's timesteps t = 1000 σ (sd-scripts passes
    ``1 - timesteps / 1000``)."""
    return (1 - t.to(device, torch.float32) / 1000).expand(batch).to(dtype)
