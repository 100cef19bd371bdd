"""Device memory per phase of a whole real-size Lumina Image 2.0 LoRA run at 1024 px (lumina_train_network.py).

    python benchmarks/lumina_memory.py                         # every row, on the simulated device (any CPU)
    python benchmarks/lumina_memory.py --rows 0 12 --no_sample
    python benchmarks/lumina_memory.py --tiny                  # the same runs on the tiny model (a smoke check)

The run is lumina_train_network.run unchanged on the released architecture: the NextDiT 2B transformer
(``Lumina2Transformer2DModel``, 2.6 B), Gemma-2-2B (2.6 B) and the FLUX AE, built from the family's configs
(``reference_parts``, the shared AE's released config) as uninitialised host memory (no resident memory until
written, no file read: only ``family.load`` is replaced; the tokenizer and prompt settings are the tiny model's, which
a real load gives too).

Settings: sd-scripts' docs/lumina_train_network.md command line (``--mixed_precision bf16 --gradient_checkpointing
--cache_latents --cache_text_encoder_outputs``, a rank-8 LoRA with alpha 8, AdamW, ``--timestep_sampling
nextdit_shift``) with ``--network_train_unet_only`` (Gemma's adapters get no gradient over the cache anyway), one
1024 px image, one sample after two steps (1024 px, 4 steps, CFG 3.5 with an empty negative prompt: the denoiser runs
at batch 2), the save. Rows: ``--blocks_to_swap N`` (0: none) of the 26 layers.

library/measure/simulated_device.py counts every device-resident tensor per phase (load, latent caching, text
caching, step, sampling, save) with real shapes and lifetimes, attention as the fused kernel a GPU runs. A row meets
the goal when every phase's peak + 1 GiB (CUDA context) is at most 10 GiB. Prints one JSON line per row, then a
table.
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

ROWS = (0, 8, 16, 24)
GOAL_GIB, CONTEXT_GIB = 10.0, 1.0
SETTINGS = ["--mixed_precision", "bf16", "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs",
            "--network_train_unet_only", "--timestep_sampling", "nextdit_shift", "--discrete_flow_shift", "6.0",
            "--model_prediction_type", "raw"]  # fmt: skip


class RealSizeLoader:
    """``family.load`` that returns the released architecture as uninitialised host memory (module docstring), with
    the tokenizer, scheduler and options of the tiny model at ``path``."""

    def __init__(self, family) -> None:
        self.family, self.tiny_load, self.parts = family, family.load, None

    def prepare(self, dtype) -> None:
        from accelerate import init_empty_weights

        from library.families.autoencoders import flux_ae

        reference = self.family.reference_parts()
        with init_empty_weights(include_buffers=True):
            vae = flux_ae.factory(flux_ae.released_config())()

        def empty(module):
            return module.to(dtype).requires_grad_(False).to_empty(device="cpu").eval()

        self.parts = dataclasses.replace(reference, denoiser=empty(reference.denoiser), vae=empty(vae),
                                         text_encoders=[empty(te) for te in reference.text_encoders],
                                         source="real-size lumina2")  # fmt: skip

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


def measure(swap: int, args: argparse.Namespace, work: Path) -> dict:
    import torch

    import lumina_train_network
    from library.families import get_family
    from library.measure.simulated_device import simulated_device

    files = work / "tiny"
    argv = ["--pretrained_model_name_or_path", str(files / "model.safetensors"), "--gemma2",
            str(files / "gemma2.safetensors"), "--ae", str(files / "ae.safetensors"), "--train_data_dir",
            str(work / "data"), "--caption_extension", ".txt", "--resolution", str(args.resolution), "--output_dir",
            str(work / "out"), "--output_name", f"lora-{swap}", "--network_module", "networks.lora_lumina",
            "--network_dim", "8", "--network_alpha", "8", "--optimizer_type", "AdamW", "--learning_rate", "1e-4",
            "--train_batch_size", str(args.batch), "--max_train_steps", "2", "--max_data_loader_n_workers", "0",
            "--seed", "0", "--save_model_as", "safetensors", *SETTINGS]  # fmt: skip
    if swap:
        argv += ["--blocks_to_swap", str(swap)]
    argv += args.extra.split()
    if not args.no_sample:
        argv += ["--sample_prompts", str(work / "prompts.txt"), "--sample_every_n_steps", "2"]
    family = get_family("lumina2")
    start = time.time()
    if isinstance(family.load, RealSizeLoader):
        family.load.prepare(torch.bfloat16)  # --mixed_precision bf16: the frozen parts in bf16
    with simulated_device() as sim:
        lumina_train_network.run(argv)
    table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    return {"blocks_to_swap": swap, "batch": args.batch, "peak_gib": table, "highest_gib": highest,
            "peak_phase": max(table, key=table.get), "meets_goal": highest + CONTEXT_GIB <= GOAL_GIB,
            "wall_s": round(time.time() - start, 1), "extra": args.extra,
            "model": "tiny" if args.tiny else "real-size lumina2"}  # fmt: skip


def prepare_work(work: Path, resolution: int) -> None:
    """One image and its caption at ``resolution``, the sample prompt, and the tiny files whose tokenizer and settings
    the real-size loader takes (the tiny model has the released 26 layers, so every N runs on it too)."""
    from phase_table import two_image_work

    from library.families.lumina.tiny import build_tiny_lumina, write_tiny_files

    two_image_work(work, resolution, f"a red circle --w {resolution} --h {resolution} --s 4 --l 3.5 --n ")
    if not (work / "tiny").exists():
        write_tiny_files(build_tiny_lumina(layers=26), work / "tiny")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS), help="--blocks_to_swap values (0: none)")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no_sample", action="store_true", help="leave the sampling round out")
    parser.add_argument("--extra", default="", help="flags added to every row (one string)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (checks the runs, not the memory)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    import torch
    from bench_block_swap import fused_attention
    from bench_flux_memory import lazy_host_copies, uncounted_swap_check
    from phase_table import print_phase_table, run_rows

    from library.families import get_family

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="luminamem-"))
    prepare_work(work, args.resolution)
    if not args.tiny:
        family = get_family("lumina2")
        if not isinstance(family.load, RealSizeLoader):
            family.load = RealSizeLoader(family)
        lazy_host_copies()
    uncounted_swap_check()
    fused_attention(torch)
    rows = run_rows(args.rows, measure, args, work)
    print_phase_table(
        rows,
        [("--blocks_to_swap", "blocks_to_swap"), ("batch", "batch")],
        CONTEXT_GIB,
        GOAL_GIB,
        [("peak phase", "peak_phase")],
    )
    return rows


if __name__ == "__main__":
    main()
