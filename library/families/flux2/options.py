"""FLUX.2's own flags (musubi-tuner's ``flux_2_train_network.py`` / ``flux2_setup_parser`` and the musubi-tuner
common flags that train_network.py has no name for) next to their one reader :class:`Flux2Options`
(``Flux2Family.options``).

Read: ``--dit`` (the DiT: another name of ``--pretrained_model_name_or_path``), ``--vae`` (the shared flag: BFL's
``ae.safetensors``), ``--text_encoder`` (Qwen3-4B / -8B for klein, Mistral 3 for dev: one file, a split file's first
part, or a folder), ``--model_version`` (dev, klein-4b, klein-base-4b, klein-9b, klein-base-9b; musubi-tuner's
default is dev, here the architecture is read from the weights and a given version must agree with them),
``--vae_dtype`` (the AE's dtype; musubi-tuner's default float32), ``--split_attn`` (SDPA gives the same values).
``--fp8_scaled`` is the shared flag; ``--fp8_base`` stores the DiT alone in float8 as musubi-tuner's, with
``--fp8_text_encoder`` the text encoder too (:func:`musubi_argv`). Refused with a message: ``--fp8_text_encoder``
without ``--fp8_base``, and the musubi-tuner common flags with no counterpart here (:data:`MUSUBI_ONLY`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Any, ClassVar

from library.cli.parse import add_unsupported
from library.cli.problems import ConfigError

from ..base import FamilySpec
from ..musubi_flags import musubi_refused
from ..options import add_once, mark_no_effect, musubi_caching
from .objective import Flux2FlowConfig, add_flow_args

log = logging.getLogger(__name__)

FAMILY_NAMES = ("flux2",)
MODEL_VERSIONS = ("dev", "klein-4b", "klein-base-4b", "klein-9b", "klein-base-9b")
SD_ONLY_FLAGS = {
    "--v2": "FLUX.2 is read from the weights",
    "--v_parameterization": "FLUX.2 is a flow-matching model",
    "--clip_skip": "FLUX.2 reads fixed hidden-state layers of its text encoder",
    "--max_token_length": "FLUX.2 takes 512 text tokens (musubi-tuner's fixed length)",
}
# musubi-tuner flags with no counterpart here: flag -> (argparse kwargs, why refused)
MUSUBI_ONLY: dict[str, tuple[dict, str]] = musubi_refused("FLUX.2", {
    "--fp8_text_encoder": ({"action": "store_true"}, "alone (without --fp8_base); with --fp8_base the DiT and the "
                           "text encoder are both stored in float8 (musubi-tuner's --fp8_base --fp8_scaled "
                           "--fp8_text_encoder)"),
    "--num_layers": ({"type": int, "default": None}, "a DiT with fewer blocks is read from its file's shapes; give the "
                     "pruned file instead"),
    "--guidance_scale": ({"type": float, "default": None}, "training passes guidance 1.0 to dev, as musubi-tuner; the "
                         "sampling guidance is the prompt's --g"),
    "--mem_eff_save": ({"action": "store_true"}, "the saves here write tensor by tensor already; drop it"),
})  # fmt: skip


@dataclass(frozen=True)
class Flux2Options:
    """The FLUX.2 flags of a run or a load; ``flow``: the objective's settings (training only).

    Raises:
        ConfigError: every bad value at once, each naming its flag.
    """

    text_encoder: str | None = None
    model_version: str | None = None
    split_attn: bool = False
    vae_dtype: str | None = None
    text_encoder_batch_size: int | None = None
    flow: Flux2FlowConfig | None = None
    # the dataset's control_directory: reference images, as musubi-tuner's flux_2 trains edits (every variant)
    takes_control_images: ClassVar[bool] = True

    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, training: bool) -> argparse.ArgumentParser:
        if training:
            add_flow_args(parser)
        g = parser.add_argument_group("FLUX.2 model", "FLUX.2 dev / klein (musubi-tuner's flux_2_* scripts)")
        if "--dit" not in parser._option_string_actions:
            g.add_argument("--dit", dest="pretrained_model_name_or_path", type=str, default=None,
                           help="the FLUX.2 DiT (flux2-dev.safetensors, flux2-klein-4b.safetensors ... or a diffusers "
                           "folder): musubi-tuner's name of --pretrained_model_name_or_path")  # fmt: skip
        add_once(g, parser, "--text_encoder", type=str, default=None,
                 help="Qwen3-4B / -8B (klein) or Mistral 3 (dev): one .safetensors, the first part of a split file "
                 "(00001-of-0000N), or a folder")  # fmt: skip
        add_once(g, parser, "--model_version", type=str, default=None,
                 help=f"one of {', '.join(MODEL_VERSIONS)} (default: read from the weights; klein base only by this "
                 "flag or a file name with 'base')")  # fmt: skip
        add_once(g, parser, "--split_attn", action="store_true",
                 help="musubi-tuner attends sample by sample; SDPA over the batch gives the same values")  # fmt: skip
        add_once(g, parser, "--vae_dtype", type=str, default=None, help="the AE's dtype (musubi-tuner: float32)")
        if training:
            add_once(g, parser, "--text_encoder_batch_size", type=int, default=None,
                     help="captions per text-encoder call when caching (default: the training batch size)")  # fmt: skip
        for flag, (kwargs, reason) in MUSUBI_ONLY.items() if training else ():
            if flag not in parser._option_string_actions:
                add_unsupported(g, flag, reason, **kwargs)
        if training:
            mark_no_effect(parser, SD_ONLY_FLAGS)
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, training: bool) -> Flux2Options:
        from library.cli.parse import from_namespace, missing_path_problems, positive_count_problems

        problems = missing_path_problems(args, ("text_encoder",), folders=True)
        problems += positive_count_problems(args, ("text_encoder_batch_size",))
        version = getattr(args, "model_version", None)
        if version is not None:
            version = version.lower()
            if version not in MODEL_VERSIONS:
                problems.append(f"--model_version {version}: unknown; one of {', '.join(MODEL_VERSIONS)}")
        value = getattr(args, "vae_dtype", None)
        if value is not None and value not in ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16"):
            problems.append(f"--vae_dtype {value}: one of float32, float16, bfloat16")
        if training and getattr(args, "weighted_captions", False):
            problems.append("--weighted_captions is not supported for FLUX.2: A1111-style weights are for CLIP "
                            "prompts; drop the flag")  # fmt: skip
        flow = None
        if training:
            try:
                flow = Flux2FlowConfig.from_args(args)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        if getattr(args, "split_attn", False):
            log.info("--split_attn: PyTorch SDPA attends the whole batch; the values are the same")
        return from_namespace(cls, args, flow=flow, model_version=version)

    def problems(self, spec: FamilySpec, path: str | None) -> list[str]:
        if spec.name not in FAMILY_NAMES:
            return [f"--dit {path}: a {spec.title} model; the FLUX.2 scripts train FLUX.2"]
        return []

    def metadata(self) -> dict[str, Any]:
        return {"ss_model_version": self.model_version or ""}

    def prompt_identity(self) -> str:
        """Nothing beyond the text encoder's weights: they tell Mistral 3 (dev, its template) from Qwen3 (klein),
        and klein and klein base encode alike, so flux_2_cache_text_encoder_outputs.py's entries (its
        ``--model_version`` defaults to dev) are found by a run whose version is read from the weights."""
        return ""


def musubi_argv(argv: Any, network: bool = True) -> list[str]:
    """musubi-tuner's meanings on our flags: it trains from cached latents and text-encoder outputs, so the run
    caches both unless told otherwise (:func:`..options.musubi_caching`: on disk in musubi-tuner's
    ``cache_directory``, where flux_2_cache_*.py write); it trains the DiT's adapters only; its
    ``--fp8_base`` stores the DiT alone in float8 (ours: ``--fp8_base_unet``) and ``--fp8_text_encoder`` the text
    encoder too (with ``--fp8_base``: ours, both; alone it is refused by name)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--fp8_base" in args:
        if "--fp8_text_encoder" in args:
            args.remove("--fp8_text_encoder")
        else:
            args[args.index("--fp8_base")] = "--fp8_base_unet"
    args = musubi_caching(args)  # on disk in the dataset config's cache_directory, where the caching scripts write
    if network and not any(a.startswith(("--network_train_unet_only", "--network_train_text_encoder_only"))
                           for a in args):  # fmt: skip
        args.append("--network_train_unet_only")
    return args
