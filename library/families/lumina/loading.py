"""Loading Lumina Image 2.0 as users have it, without the hub.

* ``path``: the Alpha-VLLM single-file transformer (``lumina_2_model_bf16.safetensors``, sd-scripts' and ComfyUI's
  layout, keys with or without ``model.diffusion_model.``; ComfyUI's all-in-one files also hold Gemma under
  ``text_encoders.gemma2_2b.transformer.model.`` and the AE under ``vae.``), a diffusers
  ``Lumina2Transformer2DModel`` single file, or a diffusers folder (a ``Lumina2Pipeline``: ``transformer/``,
  ``text_encoder/`` Gemma2, ``vae/``, ``tokenizer/``; or a transformer folder).
* ``gemma2`` / ``ae`` (sd-scripts' ``--gemma2 --ae``): Gemma-2-2B as a single file (``model.`` prefix or not,
  ComfyUI's prefix; extra keys such as ``lm_head`` / ``spiece_model`` are not read) or a transformers folder, and the
  FLUX AE (``autoencoders/flux_ae.py``: BFL / LDM or diffusers names, ``vae.`` prefix or not). A part neither a flag
  nor the model provides is an error naming the flag, before anything is read.

Configs: those stored in a file by our writer (``sdtrain.configs``), else the released 2B model's with the block
counts read from the keys (as sd-scripts builds NextDiT_2B), else the tiny test model's: the first whose shapes fit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..autoencoders import flux_ae
from ..base import PartDtypes, Parts
from ..loading import check_weights_path, finish, instantiate_fitting
from ..part_files import ModelFiles, PartSource
from . import keys as K
from .model import gemma_factory, load_gemma_tokenizer, released, transformer_factory, use_sd_scripts_attention

log = logging.getLogger(__name__)

TRANSFORMER_CLASS = "Lumina2Transformer2DModel"
GEMMA_PREFIXES = ("text_encoders.gemma2_2b.transformer.model.", "text_encoders.gemma2_2b.transformer.", "model.")
GEMMA_TOP = ("embed_tokens.", "layers.", "norm.")
SOURCES = (PartSource("--ae", "vae", "AE", "vae."),
           PartSource("--gemma2", "text_encoder", "Gemma-2", "text_encoders.gemma2_2b."))  # fmt: skip


# ------------------------------------------------------------------------------------------------ what a path is
def transformer_config_file(folder: Path) -> Path | None:
    """The ``config.json`` of a diffusers Lumina 2 transformer in ``folder`` (a pipeline or transformer folder)."""
    for candidate in (folder / "transformer" / "config.json", folder / "config.json"):
        if candidate.is_file():
            try:
                if json.loads(candidate.read_text()).get("_class_name") == TRANSFORMER_CLASS:
                    return candidate
            except json.JSONDecodeError:
                return None
    return None


def is_lumina_folder(folder: Path) -> bool:
    return transformer_config_file(Path(folder)) is not None


def is_lumina_keys(keys: list[str]) -> bool:
    return K.is_alpha(keys) or K.is_diffusers([k.removeprefix("transformer.") for k in keys])


# ------------------------------------------------------------------------------------------------ the transformer
class AlphaView(Mapping):
    """An Alpha-VLLM state dict (lazy) under diffusers names for a model of ``heads`` / ``kv_heads``: each tensor read
    when asked, ``attention.qkv`` split by rows."""

    def __init__(self, source: Mapping[str, Any], heads: int, kv_heads: int) -> None:
        self.source = source
        self.names: dict[str, tuple[str, int | None]] = {}
        self.splits: dict[str, tuple[int, int, int]] = {}
        for key in source.keys():
            name = key.removeprefix(K.PREFIX)
            module, _, param = name.rpartition(".")
            if name == K.UNUSED:
                continue
            if module.endswith("attention.qkv"):
                base = module.removesuffix("attention.qkv")
                rows = self._shape(key)[0]
                head = rows // (heads + 2 * kv_heads)
                self.splits[key] = (heads * head, kv_heads * head, kv_heads * head)
                for i, leaf in enumerate(K.QKV):
                    self.names[f"{base}{leaf}.{param}"] = (key, i)
                continue
            target = K.alpha_module_to_diffusers(module)
            self.names[f"{target}.{param}" if target else f"<unknown>.{name}"] = (key, None)

    def _shape(self, key: str) -> torch.Size:
        src = self.source
        return torch.Size(src.shape(key) if callable(getattr(src, "shape", None)) else src[key].shape)

    def shape(self, name: str) -> torch.Size:
        key, part = self.names[name]
        full = self._shape(key)
        return full if part is None else torch.Size((self.splits[key][part], *full[1:]))

    def __getitem__(self, name: str) -> Tensor:
        key, part = self.names[name]
        tensor = self.source[key]
        if part is None:
            return tensor
        return torch.split(tensor, list(self.splits[key]), dim=0)[part]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _with_counts(config: Mapping, counts: Mapping[str, int], cap_dim: int | None) -> dict:
    config = dict(config, num_layers=counts["layers"], num_refiner_layers=max(counts["noise_refiner"], 1))
    return config if cap_dim is None else dict(config, cap_feat_dim=cap_dim)


def load_transformer_file(path: Path, state: Mapping[str, Any], stored: Mapping | None, tiny: Mapping | None,
                          dtype: Any, device: Any) -> nn.Module:  # fmt: skip
    """An Alpha-VLLM or diffusers transformer single file -> ``Lumina2Transformer2DModel``."""
    keys = list(state.keys())
    transformer_keys = [k for k in keys if not k.startswith(("vae.", "text_encoders.", "first_stage_model."))]
    if K.is_alpha(transformer_keys):
        view_keys = {k: k for k in transformer_keys}
        from ..loading import KeyView

        source = KeyView(state, view_keys)
        counts = K.block_counts(transformer_keys)
        cap = next((k for k in transformer_keys if k.removeprefix(K.PREFIX) == "cap_embedder.0.weight"), None)
        cap_dim = int(_shape(state, cap)[0]) if cap else None

        def adapt(s: Mapping, model: nn.Module) -> Mapping:
            return AlphaView(s, model.config.num_attention_heads, model.config.num_kv_heads)
    elif K.is_diffusers([k.removeprefix("transformer.") for k in keys]):
        from ..convert import strip_prefix

        source = strip_prefix(state, "transformer.") if any(k.startswith("transformer.") for k in keys) else state
        counts = {"layers": 1 + max(int(k.split(".")[1]) for k in source.keys() if k.startswith("layers.")),
                  "noise_refiner": 1 + max(int(k.split(".")[1]) for k in source.keys()
                                           if k.startswith("noise_refiner."))}  # fmt: skip
        cap_dim = int(_shape(source, "time_caption_embed.caption_embedder.0.weight")[0])
        adapt = None
    else:
        raise ValueError(f"{path}: no Lumina Image 2.0 transformer found (no cap_embedder.0.weight, no diffusers "
                         "time_caption_embed.caption_embedder.0.weight); pass the Alpha-VLLM single file "
                         "(lumina_2_model_bf16.safetensors) or a diffusers Lumina2 folder")  # fmt: skip
    if stored is not None and "transformer" in stored:
        candidates = [(dict(stored["transformer"]), "the configs stored in the file")]
    else:
        candidates = [(_with_counts(released()["transformer"], counts, cap_dim), "the released 2B config")]
        if tiny is not None:
            candidates.append((_with_counts(tiny["transformer"], counts, cap_dim), "the tiny test config"))
    return instantiate_fitting(candidates, transformer_factory, source, "transformer", path, dtype, device, adapt)


def _shape(state: Mapping[str, Any], key: str) -> torch.Size:
    return torch.Size(state.shape(key) if callable(getattr(state, "shape", None)) else state[key].shape)


# ------------------------------------------------------------------------------------------------ Gemma-2
def gemma_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma2Model's keys of a Gemma file or of the Gemma inside a model file: the first of
    :data:`GEMMA_PREFIXES` under which ``embed_tokens.weight`` is, stripped; keys outside the model (``lm_head``,
    ``spiece_model``, ``logit_scale``) left out. A lazy view (tensors read when asked)."""
    from ..loading import KeyView

    keys = list(state.keys())
    prefix = next((p for p in ("", *GEMMA_PREFIXES) if p + "embed_tokens.weight" in keys), None)
    if prefix is None:
        return {}
    names = {k[len(prefix) :]: k for k in keys if k.startswith(prefix) and k[len(prefix) :].startswith(GEMMA_TOP)}
    return KeyView(state, names)  # type: ignore[return-value]


def gemma_candidates(stored: Mapping | None, tiny: Mapping | None, layers: int) -> list[tuple[dict, str]]:
    if stored is not None and "text_encoder" in stored:
        return [(dict(stored["text_encoder"]), "the configs stored in the file")]
    found = [(dict(released()["text_encoder"], num_hidden_layers=layers), "the released Gemma-2-2B config")]
    return found + ([(dict(tiny["text_encoder"], num_hidden_layers=layers), "the tiny config")] if tiny else [])


# ------------------------------------------------------------------------------------------------ the whole model
def check_lumina_path(path: str | Path) -> Path:
    return check_weights_path(
        path, "--pretrained_model_name_or_path", lambda p: "lumina2" if is_lumina_folder(p) else None,
        "a Lumina Image 2.0 .safetensors file or a diffusers Lumina2 folder",
        "not a diffusers Lumina 2 folder (no transformer/config.json of a Lumina2Transformer2DModel)",
    )  # fmt: skip


@dataclass(frozen=True)
class _Readers:
    dtypes: PartDtypes
    device: Any
    tiny: Mapping | None

    def ae(self, path: Path, state: Mapping, stored: Mapping | None, where: str) -> nn.Module:
        candidates = flux_ae.candidates(stored, flux_ae.released_config(), self.tiny and self.tiny["vae"])
        return flux_ae.load(path, state, candidates, self.dtypes.vae, self.device, where=where, what="AE (--ae)",
                            this="Lumina 2's AE (FLUX's)")  # fmt: skip

    def gemma(self, path: Path, state: Mapping, stored: Mapping | None, where: str) -> nn.Module:
        named = gemma_state(state)
        if not named:
            raise ValueError(f"{where} {path}: no Gemma-2 weights found (expected transformers Gemma2 keys such as "
                             "model.layers.0.self_attn.q_proj.weight or embed_tokens.weight)")  # fmt: skip
        layers = 1 + max(int(k.split(".")[1]) for k in named.keys() if k.startswith("layers."))
        return instantiate_fitting(gemma_candidates(stored, self.tiny, layers), gemma_factory, named,
                                   "Gemma-2 (--gemma2)", path, self.dtypes.text_encoders, self.device)  # fmt: skip

    def vae_folder(self, folder: Path) -> nn.Module:
        from diffusers import AutoencoderKL

        return AutoencoderKL.from_pretrained(folder, torch_dtype=self.dtypes.vae).to(self.device)

    def gemma_folder(self, folder: Path) -> nn.Module:
        from transformers import AutoConfig, Gemma2Model

        from ..loading import _tf_dtype

        config = AutoConfig.from_pretrained(folder)
        use_sd_scripts_attention(config)
        model = Gemma2Model.from_pretrained(folder, config=config, **_tf_dtype(self.dtypes.text_encoders))
        return model.to(self.device)


def load_lumina(path: str | Path, *, dtype: Any = torch.float32, device: Any = "cpu", gemma2: str | Path | None = None,
                ae: str | Path | None = None, tokenizer_cache_dir: str | None = None,
                tiny: Mapping | None = None) -> Parts:  # fmt: skip
    """Load a Lumina 2 model from ``path`` and the part files (module docstring); ``dtype``: one dtype or
    :class:`PartDtypes`. ``tiny``: the tiny model's part configs, tried after the released ones."""
    dtypes = PartDtypes.of(dtype)
    path = check_lumina_path(path)
    files = ModelFiles(path, SOURCES, {"--gemma2": gemma2, "--ae": ae}, not_found="no such file")
    files.require(lambda missing: _missing(path, files, missing))
    if files.folder is None:
        denoiser = load_transformer_file(path, files.state, files.stored, tiny, dtypes.denoiser, device)
    else:
        from diffusers import Lumina2Transformer2DModel

        sub = transformer_config_file(path).parent
        denoiser = Lumina2Transformer2DModel.from_pretrained(sub, torch_dtype=dtypes.denoiser).to(device)
    read = _Readers(dtypes, device, tiny)
    vae = files.load("--ae", read.ae, read.vae_folder)
    gemma = files.load("--gemma2", read.gemma, read.gemma_folder)
    given = files.given.get("--gemma2")
    folders = [files.root, given if given is not None and given.is_dir() else None,
               given.parent if given is not None and given.is_file() else None,
               path.parent if files.folder is None else path]  # fmt: skip
    tokenizer = load_gemma_tokenizer(folders, tokenizer_cache_dir)
    scheduler = files.scheduler_config(released()["scheduler"])
    parts = Parts(denoiser, vae, [gemma], [tokenizer], scheduler, "lumina2", str(path))
    return finish(parts, device)


def _missing(path: Path, files: ModelFiles, missing: list[str]) -> str:
    where = "the single-file transformer" if files.folder is None else f"the diffusers folder {path}"
    return (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required with {where}: Lumina 2 needs "
            "Gemma-2-2B and the FLUX AE; pass them as sd-scripts does (--gemma2 gemma_2_2b_fp16.safetensors "
            "--ae ae.safetensors)")  # fmt: skip
