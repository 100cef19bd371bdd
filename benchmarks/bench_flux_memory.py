"""Device memory per phase of a whole real-size FLUX.1-dev LoRA run at 1024 px, for each row of sd-scripts' VRAM table.

    python benchmarks/bench_flux_memory.py                          # every row, on the simulated device (any CPU)
    python benchmarks/bench_flux_memory.py --rows 16 8 --no_sample
    python benchmarks/bench_flux_memory.py --tiny                   # the same run on the tiny model (a smoke check)

The run is the shared training loop (``train_network.run`` with the FLUX.1-dev family and a parser that reads
``--blocks_to_swap``, as flux_train_network.py does; that script, when present, is used instead) unchanged on the
released architecture: transformer 11.9 B, CLIP-L, T5-XXL, the 16-channel AE, built from the family's shipped configs
(``reference_parts``) as uninitialised host memory (no resident memory until written, no file read: only
``family.load`` is replaced). ``--fp8_base``'s float8 cast (library/run/run_setup.py ``store_frozen_in_fp8``: the
family's ``fp8_skip`` for the transformer, none of the encoders' Linears) is done by this loader on the meta device,
with the same rule: cast on the host it would write 17 GB of host memory (the run then skips the stored layers).
Settings of sd-scripts' docs/flux_train_network.md ("Recommended Settings by GPU Memory"): ``--fp8_base
--gradient_checkpointing --cache_latents --cache_text_encoder_outputs --mixed_precision bf16 --sdpa``, a rank-16
LoRA (alpha 8) on the transformer (``--network_train_unet_only``), two 1024 px images, one sample (1024 px, 4
steps, true CFG off) after two steps (the second one's backward runs beside the AdamW state the first one made), the
save. Rows:

====  ====================================  ===============================================================
card  sd-scripts' table                     this run (AdamW everywhere: fp32 state, 0.43 GiB more than 8-bit)
====  ====================================  ===============================================================
24    basic settings, batch 2               no swap, batch 2
16    batch 1, ``--blocks_to_swap`` (no N)  16, batch 1
12    ``--blocks_to_swap 16``, 8-bit AdamW  16, batch 1
10    ``--blocks_to_swap 22``, fp8 T5       22, batch 1 (T5 in float8 by ``--fp8_base``)
8     ``--blocks_to_swap 28``, fp8 T5       28, batch 1
====  ====================================  ===============================================================

library/measure/simulated_device.py counts every device-resident tensor per phase (load, latent caching, text caching,
step, sampling, save) with real shapes and lifetimes, attention as the fused kernel a GPU runs. A row fits its card
when every phase's peak + 1 GiB (CUDA context) is at most the card. Prints one JSON line per row, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

# card GiB -> (--blocks_to_swap, batch size): sd-scripts' docs table (24 GB: batch 2; 16 GB: "use --blocks_to_swap",
# no number: 16 as in benchmarks/bench_block_swap.py)
ROWS = {24: (0, 2), 16: (16, 1), 12: (16, 1), 10: (22, 1), 8: (28, 1)}
CONTEXT_GIB = 1.0
SETTINGS = ["--mixed_precision", "bf16", "--fp8_base", "--gradient_checkpointing", "--cache_latents",
            "--cache_text_encoder_outputs", "--sdpa"]  # fmt: skip


class RealSizeLoader:
    """``family.load`` that returns the released FLUX architecture as uninitialised host memory (module docstring),
    with the tokenizers and prompt settings of the tiny model at ``path`` (what a real load gives). The parts are
    made by :meth:`prepare` before the run starts, outside the simulated device: their meta skeletons (62 GiB in
    float32 while they are built) are no device memory of the run's load phase."""

    def __init__(self, family, device: str = "meta") -> None:
        self.family, self.tiny_load, self.parts, self.device = family, family.load, None, device

    def prepare(self, dtype, fp8: bool = True) -> None:
        from accelerate import init_empty_weights

        from library.device.fp8 import store_in_fp8
        from library.families.base import Parts
        from library.families.flux.configs import ae_factory, clip_l_factory, released, t5_factory, transformer_factory

        configs = released(self.family.name)
        if self.device == "cuda":  # random weights made on the GPU (fast; buffers initialised), cast there, then host
            import torch

            def made(factory, fp8_skip=None):
                previous = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                try:
                    with torch.device("cuda"):
                        module = factory().requires_grad_(False)
                finally:
                    torch.set_default_dtype(previous)
                if fp8 and fp8_skip is not None:
                    store_in_fp8(module, dtype, skip=fp8_skip)
                module = module.to("cpu").eval()
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                return module

            factories = ([] if self.family.chroma else [clip_l_factory]) + [t5_factory]
            denoiser = made(transformer_factory(configs["transformer"]), self.family.fp8_skip)
            encoders = [made(f(c), ("norm",)) for f, c in zip(factories, configs["text_encoders"])]
            vae = made(ae_factory(configs["vae"]))
            torch.cuda.reset_peak_memory_stats()  # making the weights is not part of the run's load
            self.parts = Parts(denoiser, vae, encoders, [], {}, "", f"real-size {self.family.name}")
            return
        reference = self.family.reference_parts()
        with init_empty_weights():
            vae = ae_factory(configs["vae"])()

        def empty(module, fp8_skip=None):
            module = module.to(dtype).requires_grad_(False)
            if fp8 and fp8_skip is not None:  # --fp8_base's cast, done on meta (the run's cast on the host skips
                store_in_fp8(module, dtype, skip=fp8_skip)  # stored layers)
            return module.to_empty(device="cpu").eval()

        denoiser = empty(reference.denoiser, self.family.fp8_skip)
        encoders = [empty(te, ("norm",)) for te in reference.text_encoders]
        self.parts = Parts(denoiser, empty(vae), encoders, [], {}, "", f"real-size {self.family.name}")

    def __call__(self, path, *, dtype=None, device="cpu", **options):
        import torch

        from library.families.base import PartDtypes

        tiny = self.tiny_load(path, dtype=torch.float32, **options)
        parts, self.parts = self.parts, None
        if parts is None:
            raise RuntimeError("RealSizeLoader: call prepare() before each run")
        want = PartDtypes.of(dtype)
        got = next(p.dtype for p in parts.vae.parameters())
        if str(device) != "cpu" or {want.denoiser, want.vae, want.text_encoders} != {got}:
            raise RuntimeError(f"RealSizeLoader: prepared {got} parts on the host, the run asks {want} on {device}")
        return dataclasses.replace(parts, tokenizers=tiny.tokenizers, scheduler_config=tiny.scheduler_config,
                                   family=tiny.family, options=tiny.options)  # fmt: skip


def lazy_host_copies() -> None:
    """Copies from the simulated device back to the host (a part moved back after caching or sampling) come back as
    ``torch.empty`` instead of zeros when they are large: the same shapes and bytes, but not written, so the host
    holds no resident memory for them (the values of weights that only travel are never read). Zeros of the text
    encoders and swapped blocks would need ~9 GB of host RAM for nothing. The same for the pinned copies block swap
    takes of its blocks (``pin_memory()``: a copy of uninitialised memory would make it resident, 14 GB for
    HunyuanImage's 32 swapped blocks)."""
    import torch

    from library.measure import simulated_device as sd

    class LazyHostCopies(sd.SimulatedDevice):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            source = args[0] if args else None
            if (func is sd._aten._to_copy.default and isinstance(source, torch.Tensor) and source.device == sd.DEVICE
                    and sd._target_device(args, kwargs) not in (None, sd.DEVICE.type)
                    and source.numel() * source.element_size() >= 2**20):  # fmt: skip
                self._host_read()
                return torch.empty(source.shape, dtype=kwargs.get("dtype") or source.dtype, device="cpu")
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _pinned_copy(self, source):  # the pinned copy of a swapped block: its bytes counted, never written
            if source.numel() * source.element_size() < 2**20:
                return super()._pinned_copy(source)
            return torch.empty_strided(source.shape, source.stride(), dtype=source.dtype)

    sd.SimulatedDevice = LazyHostCopies


def uncounted_swap_check() -> None:
    """``--blocks_to_swap`` is checked against the released block lists, built on meta by
    ``run_config.block_swap_problems`` while the config is read: a skeleton (62 GiB in float32) that no real device
    ever holds, but which the simulated device (meta) would count as the load phase's peak. Run it uncounted."""
    from torch.utils._python_dispatch import _disable_current_modes

    from library.run import config as run_config

    check = run_config.block_swap_problems

    def uncounted(*args, **kwargs):
        with _disable_current_modes():
            return check(*args, **kwargs)

    run_config.block_swap_problems = uncounted


def flux_run():
    """flux_train_network.run if that script exists, else train_network.run with the block-swap flags read."""
    try:
        import flux_train_network

        return flux_train_network.run
    except ImportError:
        pass
    import train_network
    from library import sampling
    from library.cli.parse import add_config_args
    from library.families.flux.objective import add_flow_matching_args
    from library.run import args as arg_groups
    from library.run import demo
    from networks.config import add_network_args

    def build_parser():
        parser = argparse.ArgumentParser()
        demo.add_demo_args(parser)
        arg_groups.add_run_groups(parser, block_swap=True)
        for add in (arg_groups.add_optim_args, arg_groups.add_part_lr_args, add_network_args,
                    arg_groups.add_embedding_args, sampling.add_sample_args):  # fmt: skip
            add(parser)
        add_flow_matching_args(parser)
        add_config_args(parser)
        return parser

    train_network.build_parser = build_parser
    return lambda argv: train_network.run(argv, family_names=("flux-dev", "flux-schnell", "chroma"))


def measure(card: int, swap: int, batch: int, args: argparse.Namespace, work: Path, run) -> dict:
    from library.families.flux import FLUX_DEV
    from library.measure.simulated_device import simulated_device

    argv = ["--pretrained_model_name_or_path", str(work / "tiny" / "flux-dev"), "--train_data_dir", str(work / "data"),
            "--caption_extension", ".txt", "--resolution", str(args.resolution), "--output_dir", str(work / "out"),
            "--output_name", f"lora{card}", "--network_module", "networks.lora", "--network_dim", "16",
            "--network_alpha", "8", "--network_train_unet_only", "--optimizer_type", "AdamW",
            "--learning_rate", "1e-4", "--train_batch_size", str(batch), "--max_train_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "0", "--save_model_as", "safetensors",
            *SETTINGS]  # fmt: skip
    if swap:
        argv += ["--blocks_to_swap", str(swap)]
    argv += args.extra.split()
    if not args.no_sample:
        argv += ["--sample_prompts", str(work / "prompts.txt"), "--sample_every_n_steps", "2"]
    start = time.time()
    import torch

    if isinstance(FLUX_DEV.load, RealSizeLoader):
        FLUX_DEV.load.prepare(torch.bfloat16, fp8="--fp8_base" in argv)  # --mixed_precision bf16: frozen parts bf16
    measured = {}
    if args.device == "cuda":
        from library.measure.phases import cuda_phase_peaks, instrumented

        with instrumented(cuda_phase_peaks(measured)) as peaks:
            run(argv)
        table = {k: round(v / 1024, 2) for k, v in peaks.table().items()}
    else:
        with simulated_device() as sim:
            run(argv)
        table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    row = {"card_gib": card, "blocks_to_swap": swap, "batch": batch, "peak_gib": table, "highest_gib": highest,
           "fits": highest + CONTEXT_GIB <= card, "wall_s": round(time.time() - start, 1), "extra": args.extra,
           "model": "tiny" if args.tiny else "real-size " + FLUX_DEV.name, "device": args.device}  # fmt: skip
    if measured:  # what the card held: the allocator's reserved peak and the driver's used memory, per phase
        row["reserved_gib"] = {k: round(v["reserved"] / 2**30, 2) for k, v in measured.items()}
        row["device_used_gib"] = {k: round(v["device_used"] / 2**30, 2) for k, v in measured.items()}
        row["gpu"] = torch.cuda.get_device_name()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=sorted(ROWS, reverse=True), help="cards (GiB)")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--no_sample", action="store_true", help="leave the sampling round out")
    parser.add_argument("--batch", type=int, default=None, help="batch size of every row (default: the table's)")
    parser.add_argument("--extra", default="", help="flags added to every row (one string)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (checks the run, not the memory)")
    parser.add_argument("--device", choices=["meta", "cuda"], default="meta",
                        help="cuda: random weights on a real GPU; max_memory_allocated / reserved per phase")  # fmt: skip
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    from bench_block_swap import fused_attention

    from library.families.flux import FLUX_DEV
    from library.families.flux.tiny import build_tiny_flux
    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fluxmem-"))
    if not (work / "data").exists():
        make_example_dataset(work / "four", size=args.resolution)
        (work / "data" / "1_sks shape").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:4]:  # two images and their captions
            (work / "data" / "1_sks shape" / f.name).write_bytes(f.read_bytes())
    (work / "prompts.txt").write_text(f"a red circle --w {args.resolution} --h {args.resolution} --s 4\n")
    if not (work / "tiny" / "flux-dev").exists():
        FLUX_DEV.save(build_tiny_flux("flux-dev"), work / "tiny" / "flux-dev")
    if not args.tiny:
        FLUX_DEV.load = RealSizeLoader(FLUX_DEV, args.device)
        if args.device == "meta":
            lazy_host_copies()
            uncounted_swap_check()
    fused_attention(torch)  # SDPA as the fused kernel (diffusers' FLUX passes query= / key= / value=)
    run = flux_run()
    rows = []
    for card in args.rows:
        swap, batch = ROWS[card]
        row = measure(card, swap, args.batch or batch, args, work, run)
        rows.append(row)
        print(json.dumps(row), flush=True)
    phases = list(rows[0]["peak_gib"])
    print(f"\n| card (GiB) | --blocks_to_swap | batch | {' | '.join(phases)} | highest + {CONTEXT_GIB:g} GiB | fits |")
    print("|---" * (len(phases) + 5) + "|")
    for r in rows:
        cells = " | ".join(str(r["peak_gib"].get(p, "")) for p in phases)
        total = r["highest_gib"] + CONTEXT_GIB
        print(f"| {r['card_gib']} | {r['blocks_to_swap']} | {r['batch']} | {cells} | {total:.2f} | "
              f"{'yes' if r['fits'] else 'NO'} |")  # fmt: skip


if __name__ == "__main__":
    main()
