"""Text-to-image for SD1 / SD2 / SDXL, FLUX.1, Chroma and SD3 / SD3.5 with adapters and embeddings, with sd-scripts'
gen_img.py command line.

    python gen_img.py --ckpt model.safetensors --prompt "a (cat:1.2) --n blurry --d 42" \\
        --network_module networks.lora --network_weights my_lora.safetensors --network_mul 0.8 \\
        --textual_inversion_embeddings mychar.safetensors --sampler euler_a --steps 28 --outdir out

The family (SD1, SD2, SDXL, FLUX.1 dev / schnell, Chroma, SD3 / SD3.5) is detected from --ckpt (--v1 / --v2 / --sdxl
override). FLUX.1 / Chroma: --ckpt is a diffusers folder, or a BFL file with sd-scripts' --clip_l --t5xxl --ae; SD3:
a diffusers folder, or an SAI file with or without its text encoders (--clip_l --clip_g --t5xxl). They sample with
the flow-matching Euler sampler (FLUX: --steps 20, --scale 1.0 = no CFG, --guidance 3.5 embedded guidance; SD3:
--steps 30, --scale 7.5 true CFG with the negative prompt, shift 3.0, as sd-scripts' SD3 samples; SD models keep
gen_img's 50 steps and scale 7.5). Prompts use the sample-prompt
syntax (``library.sampling.prompts``) and A1111 weighting (``library.text.prompt_weighting``). Several adapter files of any
algorithm we train (LoRA, LoCon, LoHa, LoKr, DoRA; kohya / LyCORIS format) apply at once, each with its multiplier
(a prompt's ``--am`` overrides them). SD 1.x / 2.x / SDXL take ControlNet and ControlNet-LLLite files with guide
images (``--control_net_models`` / ``--control_net_lllite_models``, ``--guide_image_path``; library/sampling/control.py).
Each PNG carries its prompt and settings as text chunks.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from library.cli import deferred_imports
from library.cli.console import add_logging_args, console_logging
from library.cli.main_guard import main_guard
from library.cli.parse import add_config_args, parse_args
from library.families.base import Parts
from library.families.protocol import ModelFamily
from library.sampling.generate import generate_batch, resolve, same_settings
from library.sampling.images import png_info, save_png
from library.sampling.inference import GEN_IMG_DDPM_DEFAULTS, GenImgConfig, Job, add_gen_img_args, plan_images

log = logging.getLogger("gen_img")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_logging_args(parser)
    add_config_args(parser)
    add_gen_img_args(parser)
    return parser


def run(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> list[Path]:
    """Run gen_img with ``argv`` (default: the command line); returns the written image paths. ``parser``: a legacy
    entry's (gen_img_diffusers.py, sdxl_gen_img.py: this one's plus the flags they refuse)."""
    args = parse_args(parser or build_parser(), argv)
    if args is None:  # --output_config wrote the arguments
        return []
    console_logging(args.console_log_level, args.console_log_file, args.console_log_simple)
    cfg = GenImgConfig.from_args(args)
    family, parts = load_model(cfg)
    networks = load_networks(cfg, family, parts)
    control_nets = load_control_nets(cfg, family, parts)
    load_embeddings(cfg, family, parts)
    family = load_xti_embeddings(cfg, family, parts)
    specs = [resolve(s, family, parts, ddpm_defaults=GEN_IMG_DDPM_DEFAULTS, **cfg.defaults) for s in cfg.prompts]
    jobs = plan_images(cfg, specs)
    log.info("%d image(s) of %d prompt(s) with %s", len(jobs), len(specs), family.name)
    written: list[Path] = []
    with tqdm(total=len(jobs), unit="image") as bar:
        for batch in batches(jobs, cfg.batch_size):
            set_multipliers(networks, cfg, batch[0].spec.network_multipliers)
            set_guide_images(control_nets, cfg, parts, batch)
            images = generate_batch(
                family, parts, [j.spec for j in batch], [torch.Generator("cpu").manual_seed(j.seed) for j in batch],
                clip_skip=cfg.clip_skip, max_embeddings_multiples=cfg.max_embeddings_multiples,
                normalize=cfg.normalize,
            )  # fmt: skip
            for job, image in zip(batch, images):
                written.append(save_image(cfg, job, image))
            bar.update(len(batch))
    log.info("wrote %d image(s) to %s", len(written), cfg.outdir)
    return written


def load_model(cfg: GenImgConfig) -> tuple[Any, Any]:
    """The family (from the flags or detected from the file) and its loaded parts, ready for inference."""
    from library.families import detect_family, get_family
    from library.families.options import option_actions
    from library.run.runtime import set_attention

    family = get_family(cfg.family) if cfg.family else detect_family(cfg.ckpt)
    takes = {a.dest for a in option_actions(family.options, training=False)}
    refused = [f"--{flag}" for flag in cfg.load_flags if flag not in takes]
    if refused:
        raise ValueError(f"{', '.join(refused)}: {cfg.ckpt} is a {family.name} model, which does not read "
                         f"{'this flag' if len(refused) == 1 else 'these flags'}: drop "
                         f"{'it' if len(refused) == 1 else 'them'}")  # fmt: skip
    options = family.options.from_args(argparse.Namespace(**cfg.load_flags), training=False)
    parts = family.load(
        cfg.ckpt, dtype=cfg.dtype, vae=cfg.vae, v_parameterization=True if cfg.v_parameterization else None,
        tokenizer_cache_dir=cfg.tokenizer_cache_dir, device=cfg.device, options=options,
    )  # fmt: skip
    parts.vae.to(dtype=cfg.vae_dtype)
    set_attention([parts.denoiser, parts.vae], cfg.attention)
    if cfg.channels_last:
        parts.denoiser.to(memory_format=torch.channels_last)
    return family, parts


def load_networks(cfg: GenImgConfig, family: ModelFamily, parts: Parts) -> list[Any]:
    """Apply the --network_weights files at their multipliers. One file stays a live adapter (a prompt's --am can
    change its multiplier); several files, or --network_merge, are merged into the model weights one after the
    other (exact for every algorithm; their multipliers are then fixed). Returns the live networks."""
    if not cfg.networks:
        return []
    import networks as adapters
    from library.files.weights import read_metadata

    if cfg.network_show_meta:
        for net in cfg.networks:
            log.info("%s metadata: %s", net.weights, read_metadata(net.weights))
    roots = family.adapter_roots(parts)
    if cfg.network_merge or len(cfg.networks) > 1:  # GenImgConfig refused --am here
        adapters.merge_files_into_base(
            [str(n.weights) for n in cfg.networks], [n.multiplier for n in cfg.networks], roots
        )
        return []
    network = adapters.network_from_file(cfg.networks[0].weights, roots)
    network.set_multiplier(cfg.networks[0].multiplier)
    return [network]


def load_control_nets(cfg: GenImgConfig, family: ModelFamily, parts: Parts) -> list[Any]:
    """The --control_net_models (ControlNet) or --control_net_lllite_models files on the UNet, each at its
    --control_net_multipliers value (LLLite widths read from the file, as sd-scripts)."""
    if not cfg.control.enabled:
        return []
    from library.files.weights import load_state_dict

    roots = family.adapter_roots(parts)
    if not any(r.prefix == "lora_unet" for r in roots):
        raise ValueError(f"ControlNet files apply to SD 1.x / 2.x / SDXL UNets; {cfg.ckpt} is a {family.name} model")
    out = []
    for model in cfg.control.models:
        if model.kind == "controlnet":
            from networks.controlnet import ControlNet, load_controlnet

            net = ControlNet(parts.denoiser, load_controlnet(model.path, parts.denoiser), multiplier=model.multiplier)
            net.ratio = model.ratio
            net.controlnet.to(device=cfg.device, dtype=cfg.dtype).eval()
            log.info("ControlNet %s: multiplier %s, ratio %s", model.path.name, model.multiplier, model.ratio)
        else:
            from networks.lllite import LLLiteNetwork, dims_of_file, unet_root

            tensors, _ = load_state_dict(model.path)
            cond_emb_dim, mlp_dim = dims_of_file(tensors)
            net = LLLiteNetwork(unet_root(roots), cond_emb_dim, mlp_dim, multiplier=model.multiplier)
            net.load_file_tensors(tensors, str(model.path))
            net.to(device=cfg.device, dtype=cfg.dtype).eval()
            log.info("ControlNet-LLLite %s: %d modules, multiplier %s", model.path.name, len(net.names),
                     model.multiplier)  # fmt: skip
        out.append(net)
    return out


def set_guide_images(control_nets: list[Any], cfg: GenImgConfig, parts: Parts, batch: list[Job]) -> None:
    """Each image of the batch gets its guide image (``ControlNetConfig.guide_for``), resized to the batch's size
    (ControlNets: preprocessed, in [0, 1]; LLLite: in [-1, 1]); a ControlNet with a ratio below 1 gets the batch's
    sampling schedule, which tells it when to stop."""
    if not control_nets:
        return
    from library.sampling.control import preprocessor
    from library.sampling.schedulers import make_scheduler
    from networks.controlnet import guide_image
    from networks.lllite import load_guide_image

    spec = batch[0].spec
    for i, (net, model) in enumerate(zip(control_nets, cfg.control.models)):
        paths = [str(cfg.control.guide_for(j.number, i)) for j in batch]
        if model.kind == "lllite":
            net.use_guide_image(torch.cat([load_guide_image(p, spec.width, spec.height) for p in paths]))
            continue
        prep = preprocessor(model.prep)
        net.set_cond_image(torch.cat([guide_image(p, spec.width, spec.height, prep) for p in paths]))
        if model.ratio < 1.0:
            scheduler = make_scheduler(spec.sampler, parts.scheduler_config)
            scheduler.set_timesteps(spec.steps)
            net.schedule = scheduler.timesteps.float().cpu()


def set_multipliers(networks: list[Any], cfg: GenImgConfig, override: tuple[float, ...] | None) -> None:
    """Each network's multiplier: the prompt's --am values (the last one repeats, as sd-scripts), else --network_mul."""
    for i, (network, net) in enumerate(zip(networks, cfg.networks)):
        value = net.multiplier if not override else override[min(i, len(override) - 1)]
        if network.multiplier != value:
            network.set_multiplier(value)


def load_embeddings(cfg: GenImgConfig, family: ModelFamily, parts: Parts) -> None:
    from library.text.textual_inversion import add_embedding

    for path in cfg.embeddings:
        ids = add_embedding(family, parts, path)
        log.info("embedding %s: %d vector(s), token %r", path.name, len(ids[0]), path.stem)


def load_xti_embeddings(cfg: GenImgConfig, family: ModelFamily, parts: Parts) -> ModelFamily:
    """--XTI_embeddings: the files' tokens in ``parts`` and the family that encodes prompts once per cross-attention
    layer (library/run/xti.py); the family unchanged without them."""
    if not cfg.xti_embeddings:
        return family
    from library.run.xti import load_xti_files

    conditioning = load_xti_files(family, parts, cfg.xti_embeddings)
    for emb in conditioning.embeddings:
        log.info("XTI embedding %r: %d vector(s) for each of %d layers", emb.token, emb.num_vectors, len(emb.layers))
    return conditioning


def batches(jobs: list[Job], size: int) -> list[list[Job]]:
    """Consecutive jobs with the same settings, at most ``size`` per batch."""
    out: list[list[Job]] = []
    for job in jobs:
        if out and len(out[-1]) < size and same_settings(out[-1][0].spec, job.spec):
            out[-1].append(job)
        else:
            out.append([job])
    return out


def save_image(cfg: GenImgConfig, job: Job, image: Any) -> Path:
    if job.file_name:
        name = job.file_name
    elif cfg.sequential_file_name:
        name = f"im_{job.number:06d}.png"
    else:
        name = f"im_{time.strftime('%Y%m%d%H%M%S')}_{job.number:03d}_{job.seed}.png"
    path = cfg.outdir / name
    n = 1
    while path.exists():  # never overwrite an earlier image
        path = cfg.outdir / f"{Path(name).stem}_{n}{Path(name).suffix or '.png'}"
        n += 1
    extra = {"model": cfg.ckpt.name, "clip-skip": cfg.clip_skip}
    return save_png(image, path, png_info(job.spec, job.seed, **extra))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``run(argv)`` with its exit status (2 and one ``error:`` line for bad input)."""
    with deferred_imports.enabled():  # start-up: diffusers imports only the model classes a run uses
        return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
