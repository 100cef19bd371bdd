"""gen_img.py's flags (sd-scripts' names), its validated config and the plan of images to make.

Flag names, types and defaults follow sd-scripts' ``gen_img.py``. Features we do not have (img2img, inpainting,
highres fix, Deep Shrink, Gradual Latent, regional prompts, CLIP guidance, negative scale, interactive
mode) are accepted flags that raise an error naming them when used, never silent no-ops.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from library.cli.parse import add_unsupported, guidance_problems
from library.cli.problems import ConfigError
from library.families import FAMILIES, family_flags, family_title
from library.families.options import option_actions

from .config import DEFAULT_MAX_EMBEDDINGS_MULTIPLES
from .control import ControlNetConfig, add_control_net_args
from .flow_generate import DEFAULT_FLOW_SCALE, DEFAULT_GUIDANCE
from .prompts import PromptSpec, parse_prompt_line, read_prompt_file
from .schedulers import SAMPLER_NAMES

GEN_IMG_DDPM_DEFAULTS = {"steps": 50, "scale": 7.5}
"""sd-scripts gen_img.py's --steps / --scale defaults, for the DDPM families (SD1/SD2/SDXL) only: a flow-matching
model gets its sampler's defaults (``flow_generate.resolve_flow``) when the flags are not given."""

# all read as their file says; with the registered families' own modules (network_modules())
NETWORK_MODULES = ("networks.lora", "lycoris.kohya", "networks.dylora", "networks.lora_fa", "networks.oft")


def network_modules() -> tuple[str, ...]:
    """Every ``--network_module`` a generation script takes: the generic ones, then each registered family's."""
    from library.families.registry import rules_by_module

    return (*NETWORK_MODULES, *rules_by_module())


_UNSUPPORTED_STORE = {
    "--from_module": "prompter modules",
    "--prompter_module_args": "prompter modules",
    "--image_path": "img2img / inpainting",
    "--mask_path": "inpainting",
    "--strength": "img2img",
    "--vae_batch_size": "the VAE decodes each batch at once",
    "--vae_slices": "sliced VAE decoding",
    "--network_args": "adapter files are rebuilt from their own keys; no arguments are needed",
    "--network_merge_n_models": "use --network_merge to merge every network",
    "--network_regional_mask_max_color_codes": "regional networks",
    "--highres_fix_scale": "highres fix",
    "--highres_fix_strength": "highres fix",
    "--highres_fix_upscaler": "highres fix",
    "--highres_fix_upscaler_args": "highres fix",
    "--negative_scale": "a separate negative-prompt guidance scale",
    "--clip_vision_strength": "CLIP vision conditioning",
    "--ds_depth_1": "Deep Shrink",
    "--ds_timesteps_1": "Deep Shrink",
    "--ds_depth_2": "Deep Shrink",
    "--ds_timesteps_2": "Deep Shrink",
    "--ds_ratio": "Deep Shrink",
    "--gradual_latent_timesteps": "Gradual Latent",
    "--gradual_latent_ratio": "Gradual Latent",
}
_EXPLAINED = ("--vae_batch_size", "--network_args", "--network_merge_n_models")  # the reason is a sentence already
_UNSUPPORTED_FLAGS = {
    "--interactive": "interactive mode; pass --prompt or --from_file",
    "--no_preview": "interactive mode",
    "--use_original_file_name": "img2img",
    "--diffusers_xformers": "use --xformers",
    "--network_pre_calc": "use --network_merge",
    "--highres_fix_save_1st": "highres fix",
    "--highres_fix_latents_upscaling": "highres fix",
    "--highres_fix_disable_control_net": "highres fix",
}


def add_gen_img_args(parser: argparse.ArgumentParser) -> None:
    """sd-scripts gen_img.py's flags that matter for SD1/SD2/SDXL text-to-image (and the refused ones)."""
    _add_model_args(parser)
    _add_image_args(parser)
    _add_extra_args(parser)
    add_control_net_args(parser)  # library/sampling/control.py
    g = parser.add_argument_group("not supported")
    for flag, reason in _UNSUPPORTED_STORE.items():
        add_unsupported(g, flag, reason if flag in _EXPLAINED else f"{reason} is not available in gen_img.py",
                        default=None)  # fmt: skip
    for flag, reason in _UNSUPPORTED_FLAGS.items():
        add_unsupported(g, flag, reason, action="store_true")


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model flags: ``--ckpt``, sd-scripts' family flags (``--v1 --v2 --sdxl``: the registry's), and every
    registered family's load flags (``family.options``, e.g. the part files beside a single-file model)."""
    g = parser.add_argument_group("model")
    g.add_argument("--ckpt", type=str, default=None, help="model: a diffusers folder or a single file")
    for flag, name in family_flags().items():
        g.add_argument(f"--{flag}", action="store_true",
                       help=f"the model is {family_title(name)} (default: detected from the file)")  # fmt: skip
    g.add_argument("--v_parameterization", action="store_true", help="the model predicts v (v-prediction models)")
    g.add_argument("--vae", type=str, default=None, help="replace the model's VAE")
    g.add_argument("--tokenizer_cache_dir", type=str, default=None, help="folder with tokenizers (offline use)")
    for options in dict.fromkeys(f.options for f in FAMILIES.values()):
        options.add_args(parser, training=False)


def load_flag_problems(args: argparse.Namespace) -> list[str]:
    """The given load flags checked by each family's reader that takes them (missing part files, counts below 1),
    before the model's family is read from the file (every problem once)."""
    problems: list[str] = []
    for options in dict.fromkeys(f.options for f in FAMILIES.values()):
        takes = {a.dest for a in option_actions(options, training=False)}
        given = {k: getattr(args, k) for k in takes if getattr(args, k, None) not in (None, False)}
        if not given:
            continue
        try:
            options.from_args(argparse.Namespace(**given), training=False)
        except ConfigError as e:
            problems += [p for p in e.problems if p not in problems]
    return problems


def load_flag_dests() -> list[str]:
    """The dests of every registered family's load flags (what ``_add_model_args`` added for them)."""
    dests = (a.dest for o in dict.fromkeys(f.options for f in FAMILIES.values())
             for a in option_actions(o, training=False))  # fmt: skip
    return list(dict.fromkeys(dests))


def _add_image_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prompts and images")
    g.add_argument("--prompt", type=str, default=None, help="prompt (inline options such as --n, --w, --d allowed)")
    g.add_argument("--from_file", type=str, default=None, help="prompt file: .txt (one prompt a line), .toml, .json")
    g.add_argument("--images_per_prompt", type=int, default=1, help="images per prompt")
    g.add_argument("--n_iter", type=int, default=1, help="repeat the whole prompt list this often")
    g.add_argument("--outdir", type=str, default="outputs", help="output folder")
    g.add_argument("--sequential_file_name", action="store_true", help="name images im_000000.png, im_000001.png...")
    g.add_argument("--W", type=int, default=None, help="width (default: the model's native size)")
    g.add_argument("--H", type=int, default=None, help="height (default: the model's native size)")
    for flag in ("original_height", "original_width", "original_height_negative", "original_width_negative"):
        g.add_argument(f"--{flag}", type=int, default=None, help="size conditioning (models that take it)")
    g.add_argument("--crop_top", type=int, default=None, help="crop conditioning (models that take it)")
    g.add_argument("--crop_left", type=int, default=None, help="crop conditioning (models that take it)")
    g.add_argument("--batch_size", type=int, default=1, help="images generated together")
    g.add_argument("--steps", type=int, default=None,
                   help=f"denoising steps (default: {GEN_IMG_DDPM_DEFAULTS['steps']}; flow-matching models: their "
                   "sampler's default, as sd-scripts samples them)")  # fmt: skip
    g.add_argument("--sampler", type=str, default="ddim", choices=list(SAMPLER_NAMES), help="sampler (scheduler)")
    g.add_argument("--scale", type=float, default=None,
                   help=f"classifier-free guidance scale (default: {GEN_IMG_DDPM_DEFAULTS['scale']}; flow-matching "
                   f"models: their sampler's default, {DEFAULT_FLOW_SCALE} = no CFG; else true CFG with the negative "
                   "prompt)")  # fmt: skip
    g.add_argument("--guidance", type=float, default=None,
                   help=f"embedded guidance, for models with a guidance input (default {DEFAULT_GUIDANCE}; a prompt's "
                   "--g overrides it); noted and ignored by models without it")  # fmt: skip
    g.add_argument("--seed", type=int, default=None, help="seed, or the seed of the seeds of several images")
    g.add_argument("--iter_same_seed", action="store_true", help="one seed for all prompts of an iteration")
    g.add_argument("--shuffle_prompts", action="store_true", help="shuffle the prompts of each iteration")
    g.add_argument(
        "--clip_skip", type=int, default=None, help="use the n-th last text-encoder layer (CLIP models that read it)"
    )
    g.add_argument("--max_embeddings_multiples", type=int, default=None, help="prompts up to 75 x this many tokens")
    g.add_argument("--emb_normalize_mode", type=str, default="original", choices=["original", "none", "abs"])


def _add_extra_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("adapters and embeddings")
    g.add_argument("--network_module", type=str, default=None, nargs="*", help="one module name per network")
    g.add_argument("--network_weights", type=str, default=None, nargs="*", help="adapter files (any algorithm)")
    g.add_argument("--network_mul", type=float, default=None, nargs="*", help="one multiplier per network (1.0)")
    g.add_argument("--network_merge", action="store_true", help="merge the networks into the model weights")
    g.add_argument("--network_show_meta", action="store_true", help="print each network file's metadata")
    g.add_argument("--textual_inversion_embeddings", type=str, default=None, nargs="*", help="embedding files")
    g.add_argument("--XTI_embeddings", type=str, default=None, nargs="*",
                   help="extended textual-inversion (XTI) files: one embedding per cross-attention layer")  # fmt: skip
    g = parser.add_argument_group("precision and attention")
    g.add_argument("--fp16", action="store_true", help="run the model in float16")
    g.add_argument("--bf16", action="store_true", help="run the model in bfloat16")
    g.add_argument("--no_half_vae", action="store_true", help="keep the VAE in float32")
    g.add_argument("--xformers", action="store_true", help="xformers attention")
    g.add_argument("--sdpa", action="store_true", help="torch SDPA attention (the default)")
    g.add_argument("--opt_channels_last", action="store_true", help="channels-last memory format for the UNet")
    g.add_argument("--device", type=str, default=None, help="cuda / cpu (default: cuda when available)")


@dataclass(frozen=True)
class NetworkSpec:
    module: str
    weights: Path
    multiplier: float


@dataclass(frozen=True)
class GenImgConfig:
    """Validated gen_img settings. ``family``: "sd1" | "sd2" | "sdxl", or None to detect it from ``ckpt``."""

    ckpt: Path
    family: str | None
    v_parameterization: bool
    vae: str | None
    tokenizer_cache_dir: str | None
    prompts: tuple[PromptSpec, ...]
    defaults: dict
    images_per_prompt: int
    n_iter: int
    batch_size: int
    seed: int | None
    iter_same_seed: bool
    shuffle_prompts: bool
    outdir: Path
    sequential_file_name: bool
    clip_skip: int | None
    max_embeddings_multiples: int
    normalize: str
    networks: tuple[NetworkSpec, ...]
    network_merge: bool
    network_show_meta: bool
    embeddings: tuple[Path, ...]
    xti_embeddings: tuple[Path, ...]
    dtype: torch.dtype
    vae_dtype: torch.dtype
    attention: str
    channels_last: bool
    device: str
    load_flags: dict = dataclasses.field(default_factory=dict)
    control: ControlNetConfig = ControlNetConfig()  # --control_net_(lllite_)models / --guide_image_path
    """The families' load flags given on the command line (:func:`load_flag_dests`; unset ones left out): the
    model's family reads them into its options (gen_img.load_model), and refuses those it does not take."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GenImgConfig:
        """Check every flag (all problems at once, as ``ConfigError``) and read the prompts."""
        problems: list[str] = []
        prompts = _prompts(args, problems)
        networks = _networks(args, problems)
        control = ControlNetConfig.from_args(args, problems)
        _check_model(args, problems)
        _check_numbers(args, problems)
        if problems:
            raise ConfigError(problems)
        dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
        families = [name for flag, name in family_flags().items() if getattr(args, flag, False)]
        defaults = dict(
            width=args.W, height=args.H, steps=args.steps, scale=args.scale, sampler=args.sampler,
            guidance=args.guidance,
            original_width=args.original_width, original_height=args.original_height,
            original_width_negative=args.original_width_negative,
            original_height_negative=args.original_height_negative, crop_top=args.crop_top, crop_left=args.crop_left,
        )  # fmt: skip
        return cls(
            ckpt=Path(args.ckpt), family=families[0] if families else None,
            v_parameterization=args.v_parameterization, vae=args.vae, tokenizer_cache_dir=args.tokenizer_cache_dir,
            prompts=tuple(prompts), defaults=defaults, images_per_prompt=args.images_per_prompt,
            n_iter=args.n_iter, batch_size=args.batch_size, seed=args.seed, iter_same_seed=args.iter_same_seed,
            shuffle_prompts=args.shuffle_prompts, outdir=Path(args.outdir),
            sequential_file_name=args.sequential_file_name, clip_skip=args.clip_skip,
            max_embeddings_multiples=args.max_embeddings_multiples or DEFAULT_MAX_EMBEDDINGS_MULTIPLES,
            normalize=args.emb_normalize_mode, networks=tuple(networks), network_merge=args.network_merge,
            network_show_meta=args.network_show_meta,
            embeddings=tuple(Path(p) for p in args.textual_inversion_embeddings or ()),
            xti_embeddings=tuple(Path(p) for p in args.XTI_embeddings or ()),
            dtype=dtype, vae_dtype=torch.float32 if args.no_half_vae else dtype,
            attention="xformers" if args.xformers else "sdpa", channels_last=args.opt_channels_last,
            device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
            load_flags={k: getattr(args, k) for k in load_flag_dests() if getattr(args, k) not in (None, False, "")},
            control=control,
        )  # fmt: skip


def _prompts(args: argparse.Namespace, problems: list[str]) -> list[PromptSpec]:
    if (args.prompt is None) == (args.from_file is None):
        problems.append("give either --prompt 'text' or --from_file prompts.txt (exactly one of them)")
        return []
    try:
        if args.prompt is not None:
            return [parse_prompt_line(args.prompt, where="--prompt")]
        return read_prompt_file(args.from_file)
    except (FileNotFoundError, ConfigError) as e:
        problems.extend(getattr(e, "problems", [str(e)]))
        return []


def _networks(args: argparse.Namespace, problems: list[str]) -> list[NetworkSpec]:
    modules, weights = args.network_module or [], args.network_weights or []
    muls = list(args.network_mul or [])
    if len(modules) != len(weights):
        problems.append(
            f"--network_module has {len(modules)} value(s) but --network_weights has {len(weights)}; give one "
            "module per weights file (e.g. --network_module networks.lora networks.lora --network_weights a b)"
        )
        return []
    if len(muls) > len(weights):
        problems.append(f"--network_mul has {len(muls)} values for {len(weights)} network(s)")
    known = network_modules()
    for module in modules:
        if module not in known:
            problems.append(f"--network_module {module!r}: use one of {', '.join(known)}")
    for path in weights:
        if not Path(path).is_file():
            problems.append(f"--network_weights {path}: no such file")
    if (args.network_merge or len(weights) > 1) and _uses_am(args):
        problems.append(
            "a prompt sets --am (per-prompt network multipliers), which needs a single unmerged network; use one "
            "--network_weights file without --network_merge, or drop --am"
        )
    muls += [1.0] * (len(weights) - len(muls))
    return [NetworkSpec(m, Path(w), float(x)) for m, w, x in zip(modules, weights, muls)]


def _uses_am(args: argparse.Namespace) -> bool:
    try:
        specs = [parse_prompt_line(args.prompt)] if args.prompt is not None else read_prompt_file(args.from_file)
    except (FileNotFoundError, ConfigError, TypeError):
        return False  # reported by _prompts
    return any(s.network_multipliers for s in specs)


def _check_model(args: argparse.Namespace, problems: list[str]) -> None:
    if not args.ckpt:
        problems.append("--ckpt is required: a diffusers folder or a .safetensors / .ckpt model file")
    elif not Path(args.ckpt).exists():
        problems.append(f"--ckpt {args.ckpt}: no such file or folder")
    if sum(bool(getattr(args, f, False)) for f in family_flags()) > 1:
        flags = ", ".join(f"--{f}" for f in family_flags())
        problems.append(f"give at most one of {flags} (or none: the family is detected from --ckpt)")
    problems += load_flag_problems(args)
    if args.fp16 and args.bf16:
        problems.append("give one of --fp16 / --bf16")
    if args.xformers and args.sdpa:
        problems.append("give one of --xformers / --sdpa")
    for path in args.textual_inversion_embeddings or ():
        if not Path(path).is_file():
            problems.append(f"--textual_inversion_embeddings {path}: no such file")


def _check_numbers(args: argparse.Namespace, problems: list[str]) -> None:
    for flag in ("images_per_prompt", "n_iter", "batch_size", "steps", "max_embeddings_multiples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            problems.append(f"--{flag} must be >= 1, got {value}")
    problems += guidance_problems("--guidance", args.guidance)
    for flag in ("W", "H"):
        value = getattr(args, flag)
        if value is not None and (value < 64 or value % 8):
            problems.append(f"--{flag} {value}: must be a multiple of 8 and at least 64; try {max(64, value // 8 * 8)}")


@dataclass(frozen=True)
class Job:
    """One image: its resolved prompt, seed and running number."""

    spec: PromptSpec
    seed: int
    number: int
    file_name: str | None


def plan_images(cfg: GenImgConfig, specs: list[PromptSpec]) -> list[Job]:
    """Every image to make, in order: ``n_iter`` passes over the (optionally shuffled) prompts, ``images_per_prompt``
    each. Seeds (sd-scripts' rules): a prompt's ``--d`` seeds first; else with ``--seed`` one image uses it as is,
    several draw their seeds from ``random.Random(seed)``; without ``--seed``, random seeds."""
    rng = random.Random(cfg.seed) if cfg.seed is not None else random.SystemRandom()
    total = cfg.n_iter * len(specs) * cfg.images_per_prompt
    jobs: list[Job] = []
    for _ in range(cfg.n_iter):
        order = list(specs)
        if cfg.shuffle_prompts:
            rng.shuffle(order)
        shared = rng.randrange(2**31)
        for spec in order:
            for i in range(cfg.images_per_prompt):
                seed = spec.seed_for(i)
                if seed is None:
                    seed = cfg.seed if total == 1 and cfg.seed is not None else shared if cfg.iter_same_seed else None
                    seed = rng.randrange(2**31) if seed is None else seed
                name = spec.file_name
                if name and (cfg.images_per_prompt > 1 or cfg.n_iter > 1):
                    stem, dot, ext = name.rpartition(".")
                    name = f"{stem}_{len(jobs)}.{ext}" if dot else f"{name}_{len(jobs)}"
                jobs.append(Job(spec, seed, len(jobs), name))
    return jobs
