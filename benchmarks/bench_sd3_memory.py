"""Device memory per phase of a whole real-size SD3.5 LoRA run at 1024 px with ``--fp8_base`` (sd3_train_network.py).

    python benchmarks/bench_sd3_memory.py                           # every row, on the simulated device (any CPU)
    python benchmarks/bench_sd3_memory.py --rows medium:0 large:32 --no_sample
    python benchmarks/bench_sd3_memory.py --tiny                    # the same runs on the tiny models (a smoke check)

The run is sd3_train_network.run unchanged on the released architecture of SD3.5-medium (transformer 2.5 B with dual
attention in blocks 0-12, ``pos_embed`` 384²) or SD3.5-large (8.1 B, 38 blocks), with CLIP-L, CLIP-G, T5-XXL and the
16-channel VAE, built from the family's shipped configs (``reference_parts``, ``sd3/configs.py``) as uninitialised
host memory (no resident memory until written, no file read: only ``family.load`` is replaced; the tokenizers and
prompt settings are the tiny model's, which a real load gives too). ``--fp8_base``'s float8 cast (library/run/
setup.py ``store_frozen_in_fp8``: the family's ``fp8_skip`` (none) for the transformer, "norm" for the
encoders) is done by this loader on the meta device with the same rule (the run then skips the stored layers).

Settings: sd-scripts' low-VRAM line (docs/sd3_train_network.md with the memory flags of its FLUX table):
``--fp8_base --gradient_checkpointing --cache_latents --cache_text_encoder_outputs --mixed_precision bf16 --sdpa``,
batch 1, a rank-16 LoRA (alpha 8) on the transformer (``--network_train_unet_only``), AdamW, one 1024 px image, one
sample after the step (1024 px, 4 steps, CFG 7.5 with an empty negative prompt: the denoiser runs at batch 2), the
save. Rows ``VARIANT:N`` (``--blocks_to_swap N``; 0: none): ``medium:0`` (the 8 GiB goal), ``medium:12``,
``large:0``, ``large:16``, ``large:32`` (sd-scripts' docs line for SD3.5-large).

library/measure/simulated_device.py counts every device-resident tensor per phase (load, latent caching, text caching, step,
sampling, save) with real shapes and lifetimes, attention as the fused kernel a GPU runs. A row meets the goal when
every phase's peak + 1 GiB (CUDA context) is at most 8 GiB. Prints one JSON line per row, then a table.
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

ROWS = ("medium:0", "medium:12", "large:0", "large:16", "large:32")
VARIANTS = {"medium": "sd3.5-medium", "large": "sd3.5-large"}
TINY_BLOCKS = {"sd3.5-medium": 24, "sd3.5-large": 38}  # the released block counts, so every N runs on the tiny too
GOAL_GIB, CONTEXT_GIB = 8.0, 1.0
SETTINGS = ["--mixed_precision", "bf16", "--fp8_base", "--gradient_checkpointing", "--cache_latents",
            "--cache_text_encoder_outputs", "--sdpa"]  # fmt: skip


class RealSizeLoader:
    """``family.load`` that returns the released SD3.5 architecture as uninitialised host memory (module docstring),
    with the tokenizers, scheduler and settings of the tiny model at ``path``. :meth:`prepare` makes the parts before
    the run, outside the simulated device (their meta skeletons are no device memory of the run's load phase)."""

    def __init__(self, family) -> None:
        self.family, self.tiny_load, self.parts = family, family.load, None

    def prepare(self, dtype, fp8: bool = True) -> None:
        from accelerate import init_empty_weights

        from library.device.fp8 import store_in_fp8
        from library.families.sd3.configs import released, vae_factory

        reference = self.family.reference_parts()
        with init_empty_weights(include_buffers=True):
            vae = vae_factory(released(self.family.name)["vae"])()

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
        # the settings load() installs on the transformer (position embeddings) go to the real one too
        options = tiny.options
        real = dataclasses.replace(parts, tokenizers=tiny.tokenizers, scheduler_config=tiny.scheduler_config,
                                   family=tiny.family, options=options)  # fmt: skip
        self.family.set_pos_embed(real, float(options.pos_emb_random_crop_rate), options.pos_embed_resolutions)
        return real


def measure(row: str, args: argparse.Namespace, work: Path) -> dict:
    import torch

    import sd3_train_network
    from library.families import get_family
    from library.measure.simulated_device import simulated_device

    name, swap = row.split(":")
    variant, swap = VARIANTS[name], int(swap)
    argv = ["--pretrained_model_name_or_path", str(work / "tiny" / variant), "--train_data_dir", str(work / "data"),
            "--caption_extension", ".txt", "--resolution", str(args.resolution), "--output_dir", str(work / "out"),
            "--output_name", f"lora-{name}{swap}", "--network_module", "networks.lora", "--network_dim", "16",
            "--network_alpha", "8", "--network_train_unet_only", "--optimizer_type", "AdamW",
            "--learning_rate", "1e-4", "--train_batch_size", str(args.batch), "--max_train_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "0", "--save_model_as", "safetensors",
            *SETTINGS]  # fmt: skip
    if swap:
        argv += ["--blocks_to_swap", str(swap)]
    argv += args.extra.split()
    if not args.no_sample:
        argv += ["--sample_prompts", str(work / "prompts.txt"), "--sample_every_n_steps", "2"]
    family = get_family(variant)
    start = time.time()
    if isinstance(family.load, RealSizeLoader):
        family.load.prepare(torch.bfloat16, fp8="--fp8_base" in argv)  # --mixed_precision bf16: frozen parts in bf16
    with simulated_device() as sim:
        sd3_train_network.run(argv)
    table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    return {"row": row, "variant": variant, "blocks_to_swap": swap, "batch": args.batch, "peak_gib": table,
            "highest_gib": highest, "meets_goal": highest + CONTEXT_GIB <= GOAL_GIB,
            "wall_s": round(time.time() - start, 1), "extra": args.extra,
            "model": "tiny" if args.tiny else "real-size " + variant}  # fmt: skip


def prepare_work(work: Path, variants: set[str], resolution: int) -> None:
    """Two images (one image and its caption) at ``resolution``, the sample prompt, and the tiny models whose
    tokenizers and settings the real-size loader takes (diffusers folders under ``work/tiny``)."""
    from phase_table import two_image_work

    from library.families import get_family
    from library.families.sd3.tiny import build_tiny_sd3

    two_image_work(work, resolution, f"a red circle --w {resolution} --h {resolution} --s 4 --n ")
    for variant in sorted(variants):
        if not (work / "tiny" / variant).exists():
            get_family(variant).save(build_tiny_sd3(variant, blocks=TINY_BLOCKS[variant]), work / "tiny" / variant)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="VARIANT:N rows (medium|large : blocks_to_swap)")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no_sample", action="store_true", help="leave the sampling round out")
    parser.add_argument("--extra", default="", help="flags added to every row (one string)")
    parser.add_argument("--tiny", action="store_true", help="the tiny models (checks the runs, not the memory)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    for row in args.rows:
        name, _, swap = row.partition(":")
        if name not in VARIANTS or not swap.isdigit():
            parser.error(f"--rows {row}: expected VARIANT:N with VARIANT one of {', '.join(VARIANTS)} and N >= 0")
    import torch
    from bench_block_swap import fused_attention
    from bench_flux_memory import lazy_host_copies, uncounted_swap_check
    from phase_table import print_phase_table, run_rows

    from library.families import get_family

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sd3mem-"))
    prepare_work(work, {VARIANTS[r.split(":")[0]] for r in args.rows}, args.resolution)
    if not args.tiny:
        for variant in VARIANTS.values():
            family = get_family(variant)
            if not isinstance(family.load, RealSizeLoader):
                family.load = RealSizeLoader(family)
        lazy_host_copies()
    uncounted_swap_check()  # the released block lists built on meta for the --blocks_to_swap check: no device memory
    fused_attention(torch)  # SDPA as the fused kernel a GPU runs
    rows = run_rows(args.rows, measure, args, work)
    print_phase_table(
        rows, [("model", "variant"), ("--blocks_to_swap", "blocks_to_swap"), ("batch", "batch")], CONTEXT_GIB, GOAL_GIB
    )
    return rows


if __name__ == "__main__":
    main()
