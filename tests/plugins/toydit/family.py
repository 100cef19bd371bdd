"""ToyDiT: a model family that lives outside the repository's library (a plug-in registered through the
``sdtrain.families`` entry point), to show that a family is one folder plus its entry scripts.

A tiny flow-matching DiT (``model.py``) over a 4-channel diffusers ``AutoencoderKL`` (8× down, latents · 0.5: the
shared ``autoencoders.kl`` helpers), conditioned on its own byte-level text encoder; trained by the reversed-target
rectified flow of ``objective.py``; its own flags in ``options.py``.

Files: one ``.safetensors`` with its own key layout, ``dit.*`` (the transformer), ``vae.*`` (diffusers names) and,
optionally, ``text_encoder.*``; the metadata holds ``sdtrain.family`` and every part's config (``sdtrain.configs``).
A model file without its text encoder takes ``--toy_text_encoder FILE`` (the shared part resolver,
``library.families.part_files``). A folder holds that file as ``toydit.safetensors``. Adapter names: ``lora_unet``
(the transformer, module paths as they are: ``lora_unet_layers_0_attn_qkv``) and ``lora_te1`` (the text encoder).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from library.families.autoencoders import kl
from library.families.base import (
    FLOW_MATCHING,
    BlockList,
    Cond,
    FamilySpec,
    FlowSampling,
    PartDtypes,
    Parts,
    Root,
    TargetClasses,
    TextEncoderSpec,
)
from library.families.blocks import BlockLayout
from library.families.full_training import PlainFullTraining
from library.families.loading import META_CONFIGS, META_FAMILY, KeyView, check_weights_path, finish, instantiate
from library.families.part_files import ModelFiles, PartSource
from library.families.saving import atomic_dir, clean_config, with_kind
from library.files.weights import save_state_dict
from library.objectives.losses import LossConfig
from library.objectives.noising import NoiseConfig

from .model import DIT_CONFIG, SCHEDULER, TEXT_CONFIG, VAE_CONFIG, ByteTokenizer, ToyDiT, ToyTextEncoder
from .objective import ReversedFlowObjective, objective_problems, toy_objective
from .options import ToyDiTOptions
from .tiny import ToyTiny

FOLDER_FILE = "toydit.safetensors"  # a ToyDiT folder holds its model file under this name
PREFIXES = {"denoiser": "dit.", "vae": "vae.", "text_encoder": "text_encoder."}
IMPLEMENTATION = "sdtrain tests/plugins/toydit"  # modelspec.implementation: no released code elsewhere
TEXT_ENCODER = PartSource("--toy_text_encoder", "text_encoder", "ToyDiT text encoder", PREFIXES["text_encoder"])

TOY_TARGETS = TargetClasses(
    transformer=("ToyDiTBlock",),
    attention=("ToySelfAttention", "ToyCrossAttention"),
    text_encoder={"lora_te1": ("ToyTextLayer",)},
    full_names=("x_embedder", "t_embedder", "y_embedder", "context_embedder", "final_layer"),
    text_encoder_attention={"lora_te1": ("ToyTextAttention",)},
)

_RE_BLOCK = re.compile(r"lora_unet_layers_(\d+)_")


@dataclass(frozen=True)
class ToyBlocks(BlockLayout):
    """Index = the transformer block's number (``lora_unet_layers_<n>_...``); no down / mid / up weights."""

    def names_match(self, name: str) -> bool:
        return bool(_RE_BLOCK.match(name))

    def index(self, name: str) -> int:
        m = _RE_BLOCK.match(name)
        return int(m.group(1)) if m else -1


TOY_BLOCKS = ToyBlocks("toydit", 16, 0, 0, 0)


def _has_dit(sd: Mapping[str, Any], metadata: Mapping[str, str]) -> bool:
    return any(k.startswith("dit.x_embedder.") for k in sd)


def _folder_kind(folder: Path) -> str | None:
    """ "toydit" for a ToyDiT folder (it holds :data:`FOLDER_FILE`), else None."""
    return "toydit" if (Path(folder) / FOLDER_FILE).is_file() else None


SPEC = FamilySpec(
    name="toydit",
    title="ToyDiT",
    text_encoders=(TextEncoderSpec(PREFIXES["text_encoder"], "toy_bytes", False, "<pad>", "", "toy_te"),),
    configs={FLOW_MATCHING: "toydit"},
    pipeline_class="",
    training_script="toydit_train_network.py",
    scripts={"network": "toydit_train_network.py", "fine_tune": "toydit_train.py", "dreambooth": "toydit_train.py"},
    load_hint="toydit_train_network.py (with --toy_text_encoder for a model file without its text encoder)",
    detect=_has_dit,
    detect_folder=lambda folder: _folder_kind(folder) is not None,
    block_swap=True,
)


def options_of(parts: Parts) -> ToyDiTOptions:
    """The options the model was loaded with (defaults for parts built another way, e.g. the tiny model)."""
    return parts.options if isinstance(parts.options, ToyDiTOptions) else ToyDiTOptions()


def _view(state: Mapping[str, Any], prefix: str) -> KeyView:
    """``state``'s keys under ``prefix``, without it (read when asked)."""
    return KeyView(state, {k[len(prefix) :]: k for k in state.keys() if k.startswith(prefix)})


def _vae_factory(config: Mapping[str, Any]) -> Any:
    from diffusers import AutoencoderKL

    return lambda: AutoencoderKL.from_config(dict(config))


class ToyDiTFamily:
    """The ToyDiT family (module docstring; ``library.families.base.ModelFamily``)."""

    vae_scale = 0.5
    size_multiple = 16  # 8× VAE, 2×2 patches
    num_text_encoders = 1
    ss_v2 = False
    adapter_prefixes = ("lora_unet", "lora_te1")
    blocks = TOY_BLOCKS
    denoiser_name = "transformer"
    partial_text_cache = None  # one encoder: its cached outputs cannot train its adapters
    fp8_skip = ()
    target_classes = TOY_TARGETS
    options = ToyDiTOptions
    full_training = PlainFullTraining()
    adapter_rules = MappingProxyType({})  # the generic network modules (networks.lora, lycoris.kohya ...) only

    def __init__(self, spec: FamilySpec, *, version: str, architecture: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.ti_embedding_keys = tuple(te.ti_key for te in spec.text_encoders)
        self._version = version
        self._architecture = architecture
        self.tiny = ToyTiny(self)

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------- files
    def load(
        self,
        path: str | Path,
        *,
        dtype: torch.dtype | PartDtypes = torch.float32,
        vae: str | Path | None = None,
        v_parameterization: bool | None = None,
        tokenizer_cache_dir: str | None = None,
        device: Any = "cpu",
        options: ToyDiTOptions | None = None,
    ) -> Parts:
        """A ToyDiT file or folder (+ ``options.toy_text_encoder``); ``ValueError`` naming the flag or the file."""
        options = options or ToyDiTOptions()
        if v_parameterization:
            raise ValueError("--v_parameterization does not apply to ToyDiT: it is a flow-matching model")
        if vae is not None:
            raise ValueError(f"--vae {vae}: ToyDiT's VAE is part of its model file")
        path = check_weights_path(path, "--pretrained_model_name_or_path", _folder_kind,
                                  "a ToyDiT .safetensors file or folder", f"no {FOLDER_FILE} in it")  # fmt: skip
        file = path / FOLDER_FILE if path.is_dir() else path
        files = ModelFiles(
            file, (TEXT_ENCODER,), {TEXT_ENCODER.flag: options.toy_text_encoder}, not_found="no such file"
        )
        files.require(lambda missing: f"{file} holds no ToyDiT text encoder; pass it with --toy_text_encoder FILE")
        configs = files.stored or {}
        dtypes = PartDtypes.of(dtype)
        denoiser = instantiate(lambda: ToyDiT(configs.get("dit", DIT_CONFIG)), _view(files.state, "dit."),
                               "transformer", file, "its stored config", dtypes.denoiser, device=device)  # fmt: skip
        vae_model = instantiate(_vae_factory(configs.get("vae", VAE_CONFIG)), _view(files.state, "vae."), "VAE", file,
                                "its stored config", dtypes.vae, device=device)  # fmt: skip

        def read_text_encoder(
            where_path: Path, state: Mapping[str, Any], stored: Mapping | None, where: str
        ) -> nn.Module:
            prefix = TEXT_ENCODER.prefix if any(k.startswith(TEXT_ENCODER.prefix) for k in state.keys()) else ""
            config = (stored or {}).get("text_encoder", TEXT_CONFIG)
            return instantiate(lambda: ToyTextEncoder(config), _view(state, prefix), f"text encoder ({where})",
                               where_path, "its stored config", dtypes.text_encoders, device=device)  # fmt: skip

        def no_folder(folder: Path) -> nn.Module:
            raise ValueError(f"--toy_text_encoder {folder}: give the text encoder's .safetensors file")

        encoder = files.load(TEXT_ENCODER.flag, read_text_encoder, no_folder)
        scheduler = dict(SCHEDULER, **configs.get("scheduler", {}))
        parts = Parts(denoiser, vae_model, [encoder], [ByteTokenizer()], scheduler, self.name, str(path), options)
        return finish(parts, device)

    def save(
        self,
        parts: Parts,
        path: str | Path,
        *,
        dtype: torch.dtype | None = None,
        metadata: Mapping[str, str] | None = None,
        safetensors: bool = True,
        text_encoder: bool = True,
    ) -> Path:
        """``*.safetensors``: the model file (``text_encoder`` False: without its text encoder); a pickle suffix is
        refused; any other path: a folder holding the model file."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".ckpt", ".pt", ".pth", ".bin"):
            raise ValueError(f"{path}: ToyDiT models are saved as .safetensors or a folder, not pickles")
        if suffix != ".safetensors":
            with atomic_dir(path) as tmp:
                self.save(parts, tmp / FOLDER_FILE, dtype=dtype, metadata=metadata, text_encoder=text_encoder)
            return path
        modules = {"denoiser": parts.denoiser, "vae": parts.vae}
        if text_encoder:
            modules["text_encoder"] = parts.text_encoders[0]
        state = {PREFIXES[part] + k: v for part, module in modules.items() for k, v in module.state_dict().items()}
        meta = {META_FAMILY: self.name, META_CONFIGS: json.dumps(model_configs(parts)),
                **self._modelspec(path.stem), **(metadata or {})}  # fmt: skip
        return save_state_dict(state, path, meta, dtype)

    def _modelspec(self, title: str) -> dict[str, str]:
        from library.files.metadata import modelspec

        spec = modelspec(architecture=self.modelspec_architecture(), implementation=self.modelspec_implementation(),
                         title=title, resolution=self.default_resolution())  # fmt: skip
        return spec

    def reference_parts(self) -> Parts:
        """The released architecture (the tiny configs: ToyDiT has no other) on the meta device; ``vae`` None."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=True):
            denoiser, encoder = ToyDiT(DIT_CONFIG), ToyTextEncoder(TEXT_CONFIG)
        return Parts(denoiser, None, [encoder], [], dict(SCHEDULER), self.name)

    # ------------------------------------------------------------------------------------------- prompts
    def tokenize(self, parts: Parts, captions: list[str], max_token_length: int | None = None) -> list[Tensor]:
        """``[ids (B, L), mask (B, L)]``, L = ``--toy_max_length`` (``max_token_length``, a CLIP setting, is not
        read)."""
        ids, mask = parts.tokenizers[0](list(captions), options_of(parts).toy_max_length)
        return [ids, mask]

    def encode_tokens(self, parts: Parts, tokens: list[Tensor], clip_skip: int | None = None) -> Cond:
        """Cond(hidden states (B, L, 16), pooled (B, 16), mask (B, L)); ``clip_skip`` is not read."""
        ids, mask = tokens
        hidden, pooled = parts.text_encoders[0](ids, mask)
        return Cond(hidden, pooled, mask.to(hidden.device))

    def encode_prompt(
        self, parts: Parts, captions: list[str], clip_skip: int | None = None, max_token_length: int | None = None
    ) -> Cond:
        return self.encode_tokens(parts, self.tokenize(parts, captions, max_token_length), clip_skip)

    def size_conditioning(self, original_sizes: Any, crop_top_lefts: Any, target_sizes: Any) -> None:
        return None

    def cond_with_trained_encoders(self, parts: Parts, captions: list[str], cached: Cond) -> Cond:
        raise ValueError("ToyDiT has one text encoder: its cached outputs cannot train its adapters")

    # ------------------------------------------------------------------------------------------- denoising
    def predict(
        self, denoiser: nn.Module, noisy: Tensor, t: Tensor, cond: Cond, *, time_ids: Tensor | None = None
    ) -> Tensor:
        """The velocity ε − x0 (B, 4, h, w) at t = 1000 σ (B,): the network runs on τ = 1 − σ and predicts x0 − ε,
        so its output is negated (``objective.py``)."""
        if time_ids is not None:
            raise ValueError("ToyDiT takes no size/crop time_ids")
        if cond.pooled is None:
            raise ValueError("ToyDiT needs the pooled text embedding (cond.pooled) to predict")
        tau = (1 - t.to(noisy.device, torch.float32) / 1000).expand(noisy.shape[0])
        return -denoiser(noisy, tau.to(noisy.dtype), cond.hidden_states, cond.pooled, cond.mask)

    def objective(self, parts: Parts) -> str:
        return FLOW_MATCHING

    def objective_problems(self, noise: NoiseConfig, loss: LossConfig, options: ToyDiTOptions) -> list[str]:
        return objective_problems(self.spec.title, noise, loss)

    def training_objective(self, parts: Parts, noise: NoiseConfig, loss: LossConfig) -> ReversedFlowObjective:
        """``objective.ReversedFlowObjective`` with the run's ``--toy_sigma_law --toy_shift`` (``parts.options``);
        ValueError when the model was loaded without them."""
        flow = options_of(parts).flow
        if flow is None:
            raise ValueError("ToyDiT trains by flow matching, but the model was loaded without the objective's flags "
                             "(ToyDiTOptions.from_args(args, training=True))")  # fmt: skip
        return toy_objective(self.spec.title, flow, noise, loss)

    def swap_blocks(self, denoiser: nn.Module) -> list[BlockList]:
        return [BlockList(denoiser.layers, 1)]

    def encode_latents(self, parts: Parts, pixels: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return kl.encode_latents(parts.vae, pixels, self.vae_scale, generator)

    def decode_latents(self, parts: Parts, latents: Tensor) -> Tensor:
        return kl.decode_latents(parts.vae, latents, self.vae_scale)

    # ------------------------------------------------------------------------------------------- names
    def adapter_roots(self, parts: Parts) -> list[Root]:
        """``lora_unet``: the transformer, ``lora_te1``: the text encoder, both under their module paths."""
        return [Root("lora_unet", parts.denoiser, _identity), Root("lora_te1", parts.text_encoders[0], _identity)]

    def base_model_version(self, prediction_type: str = FLOW_MATCHING) -> str:
        return self._version

    def modelspec_architecture(self, kind: str = "", prediction_type: str = FLOW_MATCHING) -> str:
        return with_kind(self._architecture, kind)

    def modelspec_implementation(self, kind: str = "") -> str:
        return IMPLEMENTATION

    def pipeline(self, parts: Parts, scheduler: Any) -> Any:
        raise ValueError("ToyDiT has no diffusers pipeline: it samples with the flow-matching Euler sampler")

    def flow_sampling(self, parts: Parts) -> FlowSampling:
        """No embedded guidance, the static shift of its scheduler config (2.0), noise drawn unpacked; 4 steps and no
        CFG by default."""
        channels = int(parts.denoiser.config["in_channels"])
        shift = float(parts.scheduler_config.get("shift", 2.0))
        return FlowSampling(embedded_guidance=False, shift=False, latent_channels=channels, static_shift=shift,
                            packed_noise=False, default_steps=4, default_scale=1.0)  # fmt: skip

    def default_resolution(self, prediction_type: str = FLOW_MATCHING) -> int:
        return 64


def _identity(path: str) -> str:
    return path


def model_configs(parts: Parts) -> dict[str, Any]:
    """Every part's config as JSON-able data (``sdtrain.configs``)."""
    return {"dit": dict(parts.denoiser.config), "vae": clean_config(parts.vae.config),
            "text_encoder": dict(parts.text_encoders[0].config), "scheduler": dict(parts.scheduler_config)}  # fmt: skip


TOYDIT = ToyDiTFamily(SPEC, version="toydit_v1", architecture="toydit-v1")
