"""A real-size SD1.5 or SDXL model with random weights, as a diffusers folder (for memory and speed benchmarks).

    python benchmarks/real_size_model.py OUT --family sd1|sdxl [--dtype fp32|fp16|bf16]

The architecture is the released model's (the component configs shipped in library/families/configs: SD1.5 UNet
860 M, CLIP-L 123 M, VAE 84 M; SDXL UNet 2.57 G, CLIP-L + OpenCLIP-bigG 817 M); the tokenizers are the real CLIP
tokenizers. Only the weights are random, so timings and memory are those of the real model, and no download is
needed. Weights are made directly in ``--dtype`` (bf16 halves the disk and the memory needed to build SDXL).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
CONFIGS = {"sd1": "sd15", "sdxl": "sdxl-base"}


def build(family_name: str, folder: str | Path, dtype_name: str = "fp32", seed: int = 0) -> Path:
    """Write the random-weight real-size model of ``family_name`` ("sd1" | "sdxl") to ``folder``; returns it.
    Nothing is written when ``folder`` already holds a model."""
    sys.path.insert(0, str(ROOT))
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig

    from library.families import get_family
    from library.families.base import Parts
    from library.families.encoders.clip import text_encoder_class
    from library.families.loading import shipped_configs
    from library.families.sd.tiny import save_diffusers
    from library.families.tokenizers import load_clip_tokenizer

    folder = Path(folder)
    if (folder / "model_index.json").exists():
        return folder
    family = get_family(family_name)
    configs = shipped_configs(CONFIGS[family_name])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, DTYPES[dtype_name]))  # weights made in the asked dtype: no fp32 copy
    try:
        torch.manual_seed(seed)
        unet = UNet2DConditionModel.from_config(configs["unet"])
        vae = AutoencoderKL.from_config(configs["vae"])
        encoders = [
            text_encoder_class(spec.with_projection)(CLIPTextConfig.from_dict(config))
            for spec, config in zip(family.spec.text_encoders, configs["text_encoders"])
        ]
    finally:
        torch.set_default_dtype(previous)
    tokenizers = [load_clip_tokenizer(spec.pad_token) for spec in family.spec.text_encoders]
    scheduler = {k: v for k, v in configs["scheduler"].items() if not k.startswith("_")}
    parts = Parts(unet, vae, encoders, tokenizers, scheduler, family=family_name, source=f"random-{family_name}")
    return save_diffusers(parts, folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--family", choices=sorted(CONFIGS), default="sd1")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.time()
    folder = build(args.family, args.out, args.dtype, args.seed)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"{args.family} ({args.dtype}) in {folder}: {size / 2**30:.2f} GiB, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
