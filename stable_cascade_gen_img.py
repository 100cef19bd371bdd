"""Generate images with Stable Cascade: stage C by our sampler (with LoRA files applied), then the user's stage B / A
through diffusers' decoder pipeline, as sd-scripts' stable-cascade branch's ``stable_cascade_gen_img.py``; or with
Würstchen 2: its prior (a ``WuerstchenPriorPipeline`` folder, told from its ``model_index.json``) by the same sampler,
then ``--decoder``, a diffusers ``WuerstchenDecoderPipeline`` folder (warp-ai/wuerstchen).

    python stable_cascade_gen_img.py --stage_c_checkpoint_path stage_c_bf16.safetensors \
        --text_model_checkpoint_path text_model.safetensors --decoder stable-cascade/ \
        --prompt "a cat in a hat" --negative_prompt "blurry" --h 1024 --w 1024 --steps 20 --guidance_scale 4 \
        --seed 1 --network_weights sc_lora.safetensors --outdir out

    python stable_cascade_gen_img.py --pretrained_model_name_or_path wuerstchen-prior --decoder wuerstchen/ \
        --prompt "a cat in a hat" --h 1024 --w 1024 --steps 30 --guidance_scale 4 --seed 1 \
        --network_weights w2_lora.safetensors --outdir out

``--decoder``: a diffusers ``StableCascadeDecoderPipeline`` folder (stabilityai/stable-cascade: stage B and stage A),
or for Würstchen 2 a ``WuerstchenDecoderPipeline`` folder; ``--decoder_steps`` / ``--decoder_guidance_scale``: its
steps (default 10 for stage B, 12 for Würstchen 2's, diffusers') and guidance (default 0: none).
The branch's ``--stage_b_checkpoint_path`` / ``--stage_a_checkpoint_path`` (Stability's single files) are refused
with that fix: diffusers reads stage B / A from a folder. ``--save_latents``: also write the stage C latents.
``--previewer_checkpoint_path``: also write the Previewer's low-resolution image of them (``*_preview.png``, 8x the
latents' size: what the samples during training show), with or without ``--decoder``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from library.cli.main_guard import main_guard


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage_c_checkpoint_path", "--pretrained_model_name_or_path", dest="stage_c", required=True,
                   help="stage C .safetensors (Stability's names) or a diffusers StableCascadePriorPipeline folder; "
                        "or a Würstchen 2 WuerstchenPriorPipeline folder")  # fmt: skip
    p.add_argument("--text_model_checkpoint_path", default=None, help="CLIP-bigG with projection (.safetensors)")
    p.add_argument("--decoder", default=None, help="diffusers StableCascadeDecoderPipeline folder (stage B / A); "
                   "Würstchen 2: a WuerstchenDecoderPipeline folder")  # fmt: skip
    p.add_argument("--previewer_checkpoint_path", default=None,
                   help="Stability's previewer.safetensors: also write its preview of the stage C latents")  # fmt: skip
    p.add_argument("--stage_b_checkpoint_path", default=None, help="refused: give --decoder")
    p.add_argument("--stage_a_checkpoint_path", default=None, help="refused: give --decoder")
    p.add_argument("--network_weights", nargs="*", default=[], help="LoRA / LyCORIS files for stage C")
    p.add_argument("--network_mul", nargs="*", type=float, default=[], help="their multipliers (default 1)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative_prompt", default="")
    p.add_argument("--h", type=int, default=1024)
    p.add_argument("--w", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20, help="stage C steps (the branch's default 20)")
    p.add_argument("--guidance_scale", type=float, default=4.0, help="stage C CFG (the branch's default 4)")
    p.add_argument("--decoder_steps", type=int, default=None, help="default 10 (stage B), 12 (Würstchen 2)")
    p.add_argument("--decoder_guidance_scale", type=float, default=0.0, help="the decoder's CFG (default 0: none)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--images_per_prompt", type=int, default=1)
    p.add_argument("--outdir", required=True)
    p.add_argument("--save_latents", action="store_true")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true", help="stage C in bfloat16")
    return p


def run(argv: Sequence[str] | None = None) -> list[Path]:
    """Generate; the written files."""
    from library.families.stable_cascade import STABLE_CASCADE, WUERSTCHEN
    from library.families.stable_cascade.sampling import encode_pair, latent_shape, sample_stage_c
    from library.families.stable_cascade.wuerstchen import is_prior_folder
    from networks.inject import network_from_file

    args = build_parser().parse_args(argv)
    family = WUERSTCHEN if is_prior_folder(Path(args.stage_c)) else STABLE_CASCADE
    problems = [f"--{flag}: Stability's stage B / A single files are not read; give --decoder with a diffusers "
                "StableCascadeDecoderPipeline folder (stabilityai/stable-cascade)"
                for flag in ("stage_b_checkpoint_path", "stage_a_checkpoint_path") if getattr(args, flag)]  # fmt: skip
    if args.h % 32 or args.w % 32:
        problems.append(f"--h {args.h} / --w {args.w}: give multiples of 32")
    if family is WUERSTCHEN:
        problems += wuerstchen_problems(args)
    if problems:
        raise ValueError("; ".join(problems))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    options = {} if family is WUERSTCHEN else {"text_model_checkpoint_path": args.text_model_checkpoint_path}
    parts = family.load(args.stage_c, dtype=dtype, device=args.device, options=family.options(**options))
    for i, path in enumerate(args.network_weights):
        network = network_from_file(path, family.adapter_roots(parts))
        network.set_multiplier(args.network_mul[i] if i < len(args.network_mul) else 1.0)
    generator = torch.Generator().manual_seed(args.seed if args.seed is not None else torch.seed() % 2**32)
    n = args.images_per_prompt
    with torch.no_grad():
        cond, uncond = encode_pair(family, parts, args.prompt, args.negative_prompt, n)
        latents = sample_stage_c(family, parts.denoiser, cond, uncond, latent_shape(n, args.h, args.w),
                                 steps=args.steps, guidance=args.guidance_scale, generator=generator)  # fmt: skip
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.previewer_checkpoint_path:
        from library.families.stable_cascade.previewer import load_previewer, preview
        from library.sampling.generate import to_pil

        pixels = preview(load_previewer(args.previewer_checkpoint_path), latents.float().cpu()) * 2 - 1
        for i, image in enumerate(to_pil(pixels)):
            written.append(out / f"stable_cascade_{args.seed}_{i:02d}_preview.png")
            image.save(written[-1])
    if args.save_latents or (args.decoder is None and not args.previewer_checkpoint_path):
        from library.files.weights import save_state_dict

        key = "prior_latents" if family is WUERSTCHEN else "stage_c_latents"
        written.append(save_state_dict({key: latents.float().cpu()}, out / f"{key}.safetensors", {}, None))
    if args.decoder is not None:
        for i, image in enumerate(decode_images(family, args, latents, generator)):
            path = out / f"{family.name}_{args.seed}_{i:02d}.png"
            image.save(path)
            written.append(path)
    return written


def wuerstchen_problems(args: argparse.Namespace) -> list[str]:
    """The flags a Würstchen 2 prior does not take, and its ``--decoder`` folder's problems."""
    from library.families.stable_cascade.wuerstchen_decoder import decoder_problems, size_problems

    problems = [f"--{flag}: not for Würstchen 2 ({why})" for flag, why in (
        ("text_model_checkpoint_path", "its text model is the prior folder's text_encoder/"),
        ("previewer_checkpoint_path", "Stability's previewer reads Stable Cascade stage C latents; give --decoder"),
    ) if getattr(args, flag)]  # fmt: skip
    if args.decoder:
        problems += decoder_problems(args.decoder) or size_problems(args.decoder, [("--w", args.w), ("--h", args.h)])
    return problems


def decode_images(family: object, args: argparse.Namespace, latents: torch.Tensor, generator: torch.Generator) -> list:
    """PIL images of the prior's latents through ``--decoder`` (the generator continues from the prior's draws)."""
    from library.families.stable_cascade import WUERSTCHEN
    from library.families.stable_cascade.sampling import decode_with_stage_b
    from library.families.stable_cascade.wuerstchen_decoder import DECODER_STEPS, decode, load_decoder

    if family is WUERSTCHEN:
        return decode(load_decoder(args.decoder), latents.float(), args.prompt, args.negative_prompt,
                      steps=args.decoder_steps or DECODER_STEPS, guidance=args.decoder_guidance_scale,
                      generator=generator, device=args.device)  # fmt: skip
    return decode_with_stage_b(args.decoder, latents.float(), args.prompt, args.negative_prompt,
                               steps=args.decoder_steps or 10, guidance=args.decoder_guidance_scale,
                               generator=generator, device=args.device)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    return main_guard(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main())
