"""Device memory per phase of a whole real-size Anima LoRA run at 1024 px (anima_train_network.py).

    python benchmarks/anima_memory.py                               # every row, on the simulated device (any CPU)
    python benchmarks/anima_memory.py --rows bf16:0 bf16:14 --no_sample
    python benchmarks/anima_memory.py --tiny                        # the same runs on the tiny model (a smoke check)

The run is anima_train_network.run unchanged on the released architecture of Anima (the 2 B Cosmos-Predict2 DiT,
28 blocks of 2048, with its 6-layer LLM adapter), Qwen3-0.6B and the Qwen-Image VAE, built from the family's
``reference_parts`` and ``autoencoders/qwen_image.RELEASED`` as uninitialised host memory (no resident memory until
written, no file read: only ``family.load`` is replaced; the tokenizers and prompt settings are a real load's:
512 Qwen3 and 512 T5 tokens). ``--fp8_base``'s cast (rows ``fp8:N``; the family's ``fp8_skip``) is done by this
loader on the meta device with the run's rule.

Settings (sd-scripts' docs/anima_train_network.md line): ``--gradient_checkpointing --cache_latents
--cache_text_encoder_outputs --network_train_unet_only --mixed_precision bf16``, batch 1, ``networks.lora_anima``
rank 8 (alpha 1), AdamW, one 1024 px image, one sample after two steps (1024 px, 4 steps, CFG 7.5 with an empty
negative prompt: the denoiser runs twice per step), the save. Rows ``MODE:N``: bf16 or fp8 base weights,
``--blocks_to_swap N`` (0: none; at most 26).

library/measure/simulated_device.py counts every device-resident tensor per phase (load, latent caching, text
caching, step, sampling, save) with real shapes and lifetimes, attention as the fused kernel a GPU runs. A row meets
the goal when every phase's peak + 1 GiB (CUDA context) is at most 8 GiB. Prints one JSON line per row, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

ROWS = ("bf16:0", "bf16:14", "bf16:26", "fp8:0")
MODES = ("bf16", "fp8")
TINY_BLOCKS = 28  # the released block count, so every N runs on the tiny too
GOAL_GIB, CONTEXT_GIB = 8.0, 1.0
SETTINGS = ["--mixed_precision", "bf16", "--gradient_checkpointing", "--cache_latents",
            "--cache_text_encoder_outputs"]  # fmt: skip


class RealSizeLoader:
    """``family.load`` that returns the released Anima architecture as uninitialised host memory (module docstring),
    with the tokenizers, scheduler and settings of the tiny model at ``path``. :meth:`prepare` makes the parts before
    the run, outside the simulated device (their meta skeletons are no device memory of the run's load phase)."""

    def __init__(self, family) -> None:
        self.family, self.tiny_load, self.parts = family, family.load, None

    def prepare(self, dtype, fp8: bool = True) -> None:
        from accelerate import init_empty_weights

        from library.device.fp8 import store_in_fp8
        from library.families.autoencoders import qwen_image

        reference = self.family.reference_parts()
        with init_empty_weights(include_buffers=True):
            vae = qwen_image.factory(qwen_image.RELEASED)()

        def empty(module, fp8_skip=None):
            module = module.to(dtype).requires_grad_(False)
            if fp8 and fp8_skip is not None:  # --fp8_base's cast, on meta (the run's cast skips stored layers)
                store_in_fp8(module, dtype, skip=fp8_skip)
            return module.to_empty(device="cpu").eval()

        denoiser = empty(reference.denoiser, self.family.fp8_skip)
        encoders = [empty(te, ("norm",)) for te in reference.text_encoders]
        self.parts = dataclasses.replace(reference, denoiser=denoiser, vae=empty(vae), text_encoders=encoders,
                                         source=f"real-size {self.family.name}")  # fmt: skip

    def __call__(self, path, *, dtype=None, device="cpu", **options):
        import torch

        from library.families.base import PartDtypes

        tiny = self.tiny_load(path, dtype=torch.float32, device=device, **options)
        parts, self.parts = self.parts, None
        if parts is None:
            raise RuntimeError("RealSizeLoader: call prepare() before each run")
        want = PartDtypes.of(dtype)
        got = next(p.dtype for p in parts.vae.parameters())
        if str(device) != "cpu" or {want.denoiser, want.vae, want.text_encoders} != {got}:
            raise RuntimeError(f"RealSizeLoader: prepared {got} parts on the host, the run asks {want} on {device}")
        return dataclasses.replace(parts, tokenizers=tiny.tokenizers, scheduler_config=tiny.scheduler_config,
                                   family=tiny.family, options=tiny.options)  # fmt: skip


def measure(row: str, args: argparse.Namespace, work: Path) -> dict:
    import torch

    import anima_train_network
    from library.families import get_family
    from library.measure.simulated_device import simulated_device

    name, swap = row.split(":")
    variant, swap = "anima", int(swap)
    argv = ["--pretrained_model_name_or_path", str(work / "tiny" / variant), "--train_data_dir", str(work / "data"),
            "--caption_extension", ".txt", "--resolution", str(args.resolution), "--output_dir", str(work / "out"),
            "--output_name", f"lora-{name}{swap}", "--network_module", "networks.lora_anima", "--network_dim", "8",
            "--network_alpha", "1", "--network_train_unet_only", "--optimizer_type", "AdamW",
            "--learning_rate", "1e-4", "--train_batch_size", str(args.batch), "--max_train_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "0", "--save_model_as", "safetensors",
            *SETTINGS]  # fmt: skip
    if swap:
        argv += ["--blocks_to_swap", str(swap)]
    if name == "fp8":
        argv += ["--fp8_base"]
    argv += args.extra.split()
    if not args.no_sample:
        argv += ["--sample_prompts", str(work / "prompts.txt"), "--sample_every_n_steps", "2"]
    family = get_family(variant)
    start = time.time()
    if isinstance(family.load, RealSizeLoader):
        family.load.prepare(torch.bfloat16, fp8="--fp8_base" in argv)  # --mixed_precision bf16: frozen parts in bf16
    with simulated_device() as sim:
        anima_train_network.run(argv)
    table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    return {"row": row, "variant": variant, "weights": name, "blocks_to_swap": swap, "batch": args.batch, "peak_gib": table,
            "highest_gib": highest, "meets_goal": highest + CONTEXT_GIB <= GOAL_GIB,
            "wall_s": round(time.time() - start, 1), "extra": args.extra,
            "model": "tiny" if args.tiny else "real-size " + variant}  # fmt: skip


def prepare_work(work: Path, variants: set[str], resolution: int) -> None:
    """Two images (one image and its caption) at ``resolution``, the sample prompt, and the tiny models whose
    tokenizers and settings the real-size loader takes (diffusers folders under ``work/tiny``)."""
    from phase_table import two_image_work

    from library.families import get_family

    two_image_work(work, resolution, f"a red circle --w {resolution} --h {resolution} --s 4 --n ")
    for variant in sorted(variants):
        if not (work / "tiny" / variant).exists():
            family = get_family(variant)
            family.save(family.tiny.build(blocks=TINY_BLOCKS), work / "tiny" / variant)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="MODE:N rows (bf16|fp8 : blocks_to_swap)")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no_sample", action="store_true", help="leave the sampling round out")
    parser.add_argument("--extra", default="", help="flags added to every row (one string)")
    parser.add_argument("--tiny", action="store_true", help="the tiny models (checks the runs, not the memory)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    for row in args.rows:
        name, _, swap = row.partition(":")
        if name not in MODES or not swap.isdigit():
            parser.error(f"--rows {row}: expected MODE:N with MODE one of {', '.join(MODES)} and N >= 0")
    import torch
    from bench_block_swap import fused_attention
    from bench_flux_memory import lazy_host_copies, uncounted_swap_check
    from phase_table import SETTINGS, print_phase_table, run_rows

    from library.families import get_family

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="animamem-"))
    prepare_work(work, {"anima"}, args.resolution)
    if not args.tiny:
        for variant in ("anima",):
            family = get_family(variant)
            if not isinstance(family.load, RealSizeLoader):
                family.load = RealSizeLoader(family)
        lazy_host_copies()
    uncounted_swap_check()  # the released block lists built on meta for the --blocks_to_swap check: no device memory
    fused_attention(torch)  # SDPA as the fused kernel a GPU runs
    rows = run_rows(args.rows, measure, args, work)
    print_phase_table(rows, SETTINGS, CONTEXT_GIB, GOAL_GIB)
    return rows


if __name__ == "__main__":
    main()
