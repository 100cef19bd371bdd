"""Device memory per phase of a real-size FLUX.1-dev full fine-tune (flux_train.py) at 1024 px, bf16, Adafactor with
``--fused_backward_pass``, for several ``--blocks_to_swap`` settings.

    python benchmarks/bench_flux_finetune_memory.py                       # swap 0, 18, 25, 30 on the simulated device
    python benchmarks/bench_flux_finetune_memory.py --swaps 18 --extra=--cpu_offload_checkpointing
    python benchmarks/bench_flux_finetune_memory.py --tiny                # the same run on the tiny model (a smoke check)

The run is flux_train.run unchanged on the released architecture (transformer 11.9 B, CLIP-L, T5-XXL, AE), built as
uninitialised host memory by bench_flux_memory.py's ``RealSizeLoader`` (no file read) without its float8 cast. Settings: sd-scripts'
docs/fine_tune.md FLUX line (``--blocks_to_swap N``) with its memory flags: ``--mixed_precision bf16 --full_bf16
--optimizer_type adafactor --optimizer_args relative_step=False scale_parameter=False warmup_init=False
--fused_backward_pass --gradient_checkpointing --cache_latents --cache_text_encoder_outputs --sdpa``, batch 1, one
step, the save (``--mem_eff_save``: the BFL file written tensor by tensor; the bytes go to /dev/null, the device side
is what is measured). library/measure/simulated_device.py counts every device-resident tensor per phase (load, latent caching,
text caching, step, save). A setting fits a card when its highest phase + 1 GiB (CUDA context) is at most the card.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

CONTEXT_GIB = 1.0
SETTINGS = ["--mixed_precision", "bf16", "--full_bf16", "--optimizer_type", "adafactor", "--optimizer_args",
            "relative_step=False", "scale_parameter=False", "warmup_init=False", "--fused_backward_pass",
            "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--sdpa", "--mem_eff_save",
            "--learning_rate", "1e-5", "--max_grad_norm", "0"]  # fmt: skip


def files_to_devnull() -> None:
    """The streamed writer sends the bytes to /dev/null (a 22 GiB file is not what this measures), and the file's
    ``sshs_*`` hashes are left out: library/files/metadata.py ``sshs_hashes`` serialises the whole model in host
    memory (22 GiB for the FLUX transformer), more than this machine's host RAM; host memory, not device memory."""
    from library.files import metadata as metadata_format
    from library.files import weights as weight_files

    metadata_format.with_hashes = lambda tensors, metadata: dict(metadata)

    write = weight_files.write_safetensors_streamed
    weight_files.write_safetensors_streamed = lambda state, path, meta, dtype: write(state, Path(os.devnull), meta,
                                                                                      dtype)  # fmt: skip


def full_precision_loader(family):
    """bench_flux_memory.py's ``RealSizeLoader`` without its ``--fp8_base`` cast: every part in the run's dtype (this
    run trains the transformer, and its text encoders are not stored in float8 without --fp8_base)."""
    from bench_flux_memory import RealSizeLoader

    class FullPrecision(RealSizeLoader):
        def prepare(self, dtype) -> None:
            from accelerate import init_empty_weights

            from library.families.base import Parts
            from library.families.flux.configs import ae_factory, released

            reference = self.family.reference_parts()
            with init_empty_weights():
                vae = ae_factory(released(self.family.name)["vae"])()

            def empty(module):
                return module.to(dtype).requires_grad_(False).to_empty(device="cpu").eval()

            encoders = [empty(te) for te in reference.text_encoders]
            self.parts = Parts(empty(reference.denoiser), empty(vae), encoders, [], {}, "",
                               f"real-size {self.family.name}")  # fmt: skip

    return FullPrecision(family)


def measure(swap: int, args: argparse.Namespace, work: Path) -> dict:
    import torch
    from bench_flux_memory import RealSizeLoader

    import flux_train
    from library.families.flux import FLUX_DEV
    from library.measure.simulated_device import simulated_device

    argv = ["--pretrained_model_name_or_path", str(work / "tiny" / "flux-dev"), "--train_data_dir", str(work / "data"),
            "--caption_extension", ".txt", "--resolution", str(args.resolution), "--output_dir", str(work / "out"),
            "--output_name", f"ft{swap}", "--train_batch_size", "1", "--max_train_steps", "1",
            "--max_data_loader_n_workers", "0", "--seed", "0", "--save_model_as", "safetensors",
            "--blocks_to_swap", str(swap), *SETTINGS, *args.extra.split()]  # fmt: skip
    start = time.time()
    if isinstance(FLUX_DEV.load, RealSizeLoader):
        FLUX_DEV.load.prepare(torch.bfloat16)  # --full_bf16: every part in bf16
    with simulated_device() as sim:
        flux_train.run(argv)
    table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    return {"blocks_to_swap": swap, "peak_gib": table, "highest_gib": highest, "wall_s": round(time.time() - start, 1),
            "extra": args.extra, "model": "tiny" if args.tiny else "real-size " + FLUX_DEV.name}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, nargs="+", default=[0, 18, 25, 30], help="--blocks_to_swap values")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--extra", default="", help="flags added to every run (one string)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (checks the run, not the memory)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    import torch
    from bench_block_swap import fused_attention
    from bench_flux_memory import lazy_host_copies, uncounted_swap_check

    from library.families.flux import FLUX_DEV
    from library.families.flux.tiny import build_tiny_flux
    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fluxftmem-"))
    if not (work / "data").exists():
        make_example_dataset(work / "four", size=args.resolution)
        (work / "data" / "1_sks shape").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:2]:  # one image and its caption
            (work / "data" / "1_sks shape" / f.name).write_bytes(f.read_bytes())
    if not (work / "tiny" / "flux-dev").exists():  # (tiny: enough blocks for --blocks_to_swap 30)
        FLUX_DEV.save(build_tiny_flux("flux-dev", blocks=(19, 38)), work / "tiny" / "flux-dev")
    if not args.tiny:
        FLUX_DEV.load = full_precision_loader(FLUX_DEV)
        lazy_host_copies()
        uncounted_swap_check()
    files_to_devnull()
    fused_attention(torch)
    rows = []
    for swap in args.swaps:
        row = measure(swap, args, work)
        rows.append(row)
        print(json.dumps(row), flush=True)
    phases = list(rows[0]["peak_gib"])
    print(f"\n| --blocks_to_swap | {' | '.join(phases)} | highest + {CONTEXT_GIB:g} GiB | <= 24 GiB | <= 16 GiB |")
    print("|---" * (len(phases) + 4) + "|")
    for r in rows:
        total = r["highest_gib"] + CONTEXT_GIB
        cells = " | ".join(str(r["peak_gib"].get(p, "")) for p in phases)
        print(f"| {r['blocks_to_swap']} | {cells} | {total:.2f} | {'yes' if total <= 24 else 'no'} | "
              f"{'yes' if total <= 16 else 'no'} |")  # fmt: skip


if __name__ == "__main__":
    main()
