"""Device memory per phase of a whole real-size Z-Image run at 1024 px: LoRA (zimage_train_network.py, goal 10 GiB)
and the full fine-tune (zimage_train.py, goal 24 GiB), on the simulated device.

    python benchmarks/zimage_memory.py                          # every row, on the simulated device (any CPU)
    python benchmarks/zimage_memory.py --rows lora-fp8:0 --no_sample
    python benchmarks/zimage_memory.py --tiny                   # the same runs on the tiny model (a smoke check)

The runs are zimage_train_network.run / zimage_train.run unchanged on the released architecture (the 6 B DiT, 30
blocks of 3840, 2 + 2 refiners), Qwen3-4B and FLUX.1's AE, built from the family's ``reference_parts`` and
``flux_ae.released_config()`` as uninitialised host memory (no file read: only ``family.load`` is replaced; the
tokenizer is the shipped one). ``--fp8_base``'s cast (rows ``*-fp8:N``; the family's ``fp8_skip``) is done by this
loader on the meta device with the run's rule.

Settings (musubi-tuner's documented line): ``--gradient_checkpointing --mixed_precision bf16``, latents and text
outputs cached in the run, batch 1, one 1024 px image, one sample after two steps (1024 px, 4 steps, CFG with an empty
negative prompt), the save. LoRA rows ``lora-MODE:N``: ``networks.lora_zimage`` rank 32, AdamW, bf16 or fp8 base
weights, ``--blocks_to_swap N``. Full rows ``full-bf16:N``: ``--full_bf16``, Adafactor with ``--fused_backward_pass``
(musubi-tuner's documented memory options for zimage_train.py), ``--blocks_to_swap N``.

library/measure/simulated_device.py counts every device-resident tensor per phase with real shapes and lifetimes,
attention as the fused kernel a GPU runs. A row meets its goal when every phase's peak + 1 GiB (CUDA context) is at
most the goal. Prints one JSON line per row, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

ROWS = ("lora-bf16:0", "lora-fp8:0", "lora-bf16:10", "full-bf16:0", "full-bf16:20")
MODES = ("lora-bf16", "lora-fp8", "full-bf16")
TINY_BLOCKS = 30  # the released block count, so every N runs on the tiny too
GOALS_GIB, CONTEXT_GIB = {"lora": 10.0, "full": 24.0}, 1.0
SETTINGS = ["--mixed_precision", "bf16", "--gradient_checkpointing", "--cache_latents", "--timestep_sampling", "shift",
            "--discrete_flow_shift", "2.0", "--weighting_scheme", "none",
            "--cache_text_encoder_outputs"]  # fmt: skip


class RealSizeLoader:
    """``family.load`` that returns the released Z-Image architecture as uninitialised host memory (module docstring),
    with the tokenizers, scheduler and settings of the tiny model at ``path``. :meth:`prepare` makes the parts before
    the run, outside the simulated device (their meta skeletons are no device memory of the run's load phase)."""

    def __init__(self, family) -> None:
        self.family, self.tiny_load, self.parts = family, family.load, None

    def prepare(self, dtype, fp8: bool = True, fp8_llm: bool = False) -> None:
        from accelerate import init_empty_weights

        from library.device.fp8 import store_in_fp8
        from library.families.autoencoders import flux_ae

        reference = self.family.reference_parts()
        with init_empty_weights(include_buffers=True):
            vae = flux_ae.factory(flux_ae.released_config())()

        def empty(module, fp8_skip=None, cast=fp8):
            module = module.to(dtype).requires_grad_(False)
            if cast and fp8_skip is not None:  # --fp8_base's cast, on meta (the run's cast skips stored layers)
                store_in_fp8(module, dtype, skip=fp8_skip)
            return module.to_empty(device="cpu").eval()

        denoiser = empty(reference.denoiser, self.family.fp8_skip)
        # Qwen3 in float8 with --fp8_llm (the family's loader), or with --fp8_base where the run's rule stores the
        # text encoders too (a family's fp8_base_text_encoders: False for Z-Image, as musubi-tuner)
        te_fp8 = fp8_llm or fp8 and getattr(self.family, "fp8_base_text_encoders", True)
        encoders = [empty(te, ("norm",), te_fp8) for te in reference.text_encoders]
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

    import zimage_train
    import zimage_train_network
    from library.families import get_family
    from library.measure.simulated_device import simulated_device

    name, swap = row.split(":")
    kind, weights = name.split("-")
    variant, swap = "zimage", int(swap)
    argv = ["--pretrained_model_name_or_path", str(work / "tiny" / variant), "--train_data_dir", str(work / "data"),
            "--caption_extension", ".txt", "--resolution", str(args.resolution), "--output_dir", str(work / "out"),
            "--output_name", f"{name}{swap}", "--train_batch_size", str(args.batch), "--max_train_steps", "2",
            "--learning_rate", "1e-4", "--max_data_loader_n_workers", "0", "--seed", "0", *SETTINGS]  # fmt: skip
    if kind == "lora":
        argv += ["--network_module", "networks.lora_zimage", "--network_dim", "32", "--network_alpha", "32",
                 "--network_train_unet_only", "--optimizer_type", "AdamW", "--save_model_as", "safetensors"]  # fmt: skip
    else:
        argv += ["--full_bf16", "--optimizer_type", "adafactor", "--fused_backward_pass", "--optimizer_args",
                 "relative_step=False", "scale_parameter=False", "warmup_init=False", "--save_model_as", "safetensors"]  # fmt: skip
    if swap:
        argv += ["--blocks_to_swap", str(swap)]
    if weights == "fp8":
        argv += ["--fp8_base"]
    argv += args.extra.split()
    if not args.no_sample:
        argv += ["--sample_prompts", str(work / "prompts.txt"), "--sample_every_n_steps", "2"]
    family = get_family(variant)
    start = time.time()
    if isinstance(family.load, RealSizeLoader):
        family.load.prepare(
            torch.bfloat16, fp8="--fp8_base" in argv, fp8_llm="--fp8_llm" in argv
        )  # --mixed_precision bf16: frozen parts in bf16
    with simulated_device() as sim:
        (zimage_train_network if kind == "lora" else zimage_train).run(argv)
    shutil.rmtree(work / "out", ignore_errors=True)  # a real-size full fine-tune writes 12 GB of (empty) weights
    table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    return {"row": row, "variant": variant, "weights": name, "blocks_to_swap": swap, "batch": args.batch,
            "peak_gib": table, "highest_gib": highest, "goal_gib": GOALS_GIB[kind],
            "meets_goal": highest + CONTEXT_GIB <= GOALS_GIB[kind], "wall_s": round(time.time() - start, 1),
            "extra": args.extra, "model": "tiny" if args.tiny else "real-size " + variant}  # fmt: skip


def prepare_work(work: Path, variants: set[str], resolution: int) -> None:
    """Two images (one image and its caption) at ``resolution``, the sample prompt, and the tiny models whose
    tokenizers and settings the real-size loader takes (diffusers folders under ``work/tiny``)."""
    from library.families import get_family
    from library.run.demo import make_example_dataset

    if not (work / "data").exists():
        make_example_dataset(work / "four", size=resolution)
        (work / "data" / "1_sks shape").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:2]:
            (work / "data" / "1_sks shape" / f.name).write_bytes(f.read_bytes())
    (work / "prompts.txt").write_text(f"a red circle --w {resolution} --h {resolution} --s 4 --n \n")
    for variant in sorted(variants):
        if not (work / "tiny" / variant).exists():
            family = get_family(variant)
            family.save(family.tiny.build(blocks=TINY_BLOCKS), work / "tiny" / variant)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--rows", nargs="+", default=list(ROWS), help="MODE:N rows (lora-bf16|lora-fp8|full-bf16 : blocks_to_swap)"
    )
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

    from library.families import get_family

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="zimagemem-"))
    prepare_work(work, {"zimage"}, args.resolution)
    if not args.tiny:
        for variant in ("zimage",):
            family = get_family(variant)
            if not isinstance(family.load, RealSizeLoader):
                family.load = RealSizeLoader(family)
        lazy_host_copies()
    uncounted_swap_check()  # the released block lists built on meta for the --blocks_to_swap check: no device memory
    fused_attention(torch)  # SDPA as the fused kernel a GPU runs
    rows = []
    for row in args.rows:
        result = measure(row, args, work)
        rows.append(result)
        print(json.dumps(result), flush=True)
    phases = list(rows[0]["peak_gib"])
    print(f"\n| model | weights | --blocks_to_swap | batch | {' | '.join(phases)} | highest + {CONTEXT_GIB:g} GiB | "
          "meets goal |")  # fmt: skip
    print("|---" * (len(phases) + 6) + "|")
    for r in rows:
        cells = " | ".join(str(r["peak_gib"].get(p, "")) for p in phases)
        print(f"| {r['variant']} | {r['weights']} | {r['blocks_to_swap']} | {r['batch']} | {cells} | "
              f"{r['highest_gib'] + CONTEXT_GIB:.2f} | {'yes' if r['meets_goal'] else 'NO'} (<= {r['goal_gib']:g}) |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
