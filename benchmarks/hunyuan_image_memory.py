"""Device memory per phase of a whole real-size HunyuanImage 2.1 LoRA run (hunyuan_image_train_network.py), and the
host bytes of its parts, for sd-scripts' documented VRAM rows (docs/hunyuan_image_train_network.md §6.1).

    python benchmarks/hunyuan_image_memory.py --rows fp8s:9            # one row, on the simulated device (any CPU);
                                                                       # one row per process (docs/hunyuan_image.md)
    python benchmarks/hunyuan_image_memory.py --rows fp8s:37 --resolution 2048 --no_sample
    python benchmarks/hunyuan_image_memory.py --tiny                   # the same runs on the tiny model (a smoke check)

Rows ``MODE:N[:vl]``: ``bf16`` or ``fp8s`` (``--fp8_scaled``) DiT weights, ``--blocks_to_swap N``, ``:vl`` adds
``--fp8_vl``. sd-scripts' table: 40 GB+ standard (``bf16:0``), 24 GB ``--fp8_scaled --blocks_to_swap 9``, 12 GB
``--fp8_scaled --blocks_to_swap 32``, 8 GB ``--fp8_scaled --blocks_to_swap 37`` (the default rows, each with its
card; ``--fp8_vl`` on the 12 / 8 GB rows: Qwen2.5-VL in bf16 alone is 13.2 GiB while captions are cached). The
"with --text_encoder_cpu" column leaves the text caching phase out: with that flag nothing is on the device then
(tests/test_hunyuan_image_text_encoders.py); running the 7B encoder on this machine's CPU is not part of the
benchmark.

The run is hunyuan_image_train_network.run unchanged on the released architecture (the 17 B DiT: 20 double + 40
single blocks of 3584, Qwen2.5-VL-7B's language model, byT5-small Glyph, the 32x VAE), built from the family's
``reference_parts`` and ``model.VAE`` as uninitialised host memory (no resident memory until written, no file read:
only ``family.load`` is replaced; tokenizers and prompt settings are a real load's: 1024 + 34 Qwen tokens, 128
byT5 tokens). ``--fp8_scaled``'s cast is done by this loader on the meta device with the run's rule (the family's
``fp8_skip``) and a scale of 1 per weight (the same stored bytes and the same scaled copy per forward as the run's
cast; the run leaves stored layers as they are). With ``--fp8_vl`` in ``--extra`` Qwen2.5-VL is stored as
``qwen25vl.store_fp8_as_sd_scripts`` stores it.

Settings (sd-scripts' docs line): ``--mixed_precision bf16 --gradient_checkpointing --cache_latents
--cache_text_encoder_outputs --network_train_unet_only --split_attn``, ``networks.lora_hunyuan_image`` rank 16
(alpha 1), batch 1, one image at ``--resolution`` (1024 px: the docs' dataset), AdamW (the docs' AdamW8bit needs
bitsandbytes' CUDA kernels; its state would be a quarter of this one's), one sample after two steps (the resolution,
4 steps, CFG 3.5 then APG: the DiT runs twice per step), the save. On the simulated device diffusers' text-token
reordering (boolean masks) selects every token: the text is 2 x (1 + 128) tokens (the cached Qwen states are cut
to the batch's longest caption, which reads as 1 token there), about a 130-token caption's.

library/measure/simulated_device.py counts every device-resident tensor per phase (load, latent caching, text
caching, step, sampling, save) with real shapes and lifetimes, attention as the fused kernel a GPU runs. A row fits
its card when every phase's peak + 1 GiB (CUDA context) is at most the card (GB = 10^9 bytes as cards are sold).
Host bytes: the parts as loaded (bf16, or float8 where cast), and during the step the denoiser's swapped blocks
(held on the host) plus what stays there (the text encoders when sampling needs them; freed otherwise).
Prints one JSON line per row, then a table.
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

ROWS = ("bf16:0", "fp8s:9", "fp8s:32:vl", "fp8s:37:vl")
CARDS_GB = {"bf16:0": 40, "fp8s:9": 24, "fp8s:32": 12, "fp8s:37": 8}  # sd-scripts' rows
MODES = ("bf16", "fp8s")
CONTEXT_GIB = 1.0
SETTINGS = ["--mixed_precision", "bf16", "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs",
            "--split_attn", "--attn_mode", "torch"]  # fmt: skip
GIB = 1024**3


def nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


class RealSizeLoader:
    """``family.load`` that returns the released HunyuanImage 2.1 as uninitialised host memory (module docstring),
    with the tokenizers, scheduler and options of the tiny files' load. :meth:`prepare` makes the parts before the
    run, outside the simulated device."""

    def __init__(self, family) -> None:
        self.family, self.tiny_load, self.parts = family, family.load, None

    def prepare(self, dtype, fp8: bool, fp8_vl: bool) -> dict:
        from accelerate import init_empty_weights

        from library.device.fp8 import store_in_fp8
        from library.families.encoders import qwen25vl
        from library.families.hunyuan_image import model as M

        reference = self.family.reference_parts()
        with init_empty_weights(include_buffers=True):
            vae = M.vae_factory(M.VAE)()

        def empty(module, fp8_skip=None, vl=False):
            module = module.to(dtype).requires_grad_(False)
            if vl:  # --fp8_vl's cast, on meta
                qwen25vl.store_fp8_as_sd_scripts(module, dtype)
            if fp8 and fp8_skip is not None:  # --fp8_scaled's cast on meta, scale 1 (module docstring)
                store_in_fp8(module, dtype, skip=fp8_skip)
                for layer in module.modules():
                    if hasattr(layer, "_sdtrain_fp8"):
                        layer._sdtrain_fp8.scale = 1.0
            return module.to_empty(device="cpu").eval()

        qwen, byt5 = reference.text_encoders
        denoiser = empty(reference.denoiser, self.family.fp8_skip)
        encoders = [empty(qwen, vl=fp8_vl), empty(byt5)]
        self.parts = dataclasses.replace(reference, denoiser=denoiser, vae=empty(vae), text_encoders=encoders,
                                         source=f"real-size {self.family.name}")  # fmt: skip
        return {"dit": nbytes(denoiser), "qwen": nbytes(encoders[0]), "byt5": nbytes(encoders[1]),
                "vae": nbytes(self.parts.vae)}  # fmt: skip

    def __call__(self, path, *, dtype=None, device="cpu", options=None, **kwargs):
        import torch

        tiny = self.tiny_load(path, dtype=torch.float32, device=device, options=options, **kwargs)
        parts, self.parts = self.parts, None
        if parts is None:
            raise RuntimeError("RealSizeLoader: call prepare() before each run")
        if options is not None and options.text_encoder_cpu:
            from library.families.base import keep_on_host

            for te in parts.text_encoders:
                keep_on_host(te)
        return dataclasses.replace(parts, tokenizers=tiny.tokenizers, scheduler_config=tiny.scheduler_config,
                                   family=tiny.family, options=tiny.options)  # fmt: skip


def unread_fused_weights() -> None:
    """A fused adapter target's stacked weight (``networks/fused.py`` ``FusedBase.weight``: q | k | v rows ...) is
    read by the injection only for its shape, dtype and device (a rank-r LoRA never builds it in its forward). Here it
    is made without reading the leaves: the swapped blocks' host weights are uninitialised memory, which reading
    would make resident (about the swapped bytes of RAM on this machine; a real run holds them anyway)."""
    import torch

    from networks import fused

    def weight(self):
        leaf = self._leaves[self.segments[0][0]]
        hooks = getattr(leaf, "_sdtrain_fp8", None)
        dtype = hooks.compute_dtype if hooks is not None else leaf.weight.dtype
        return torch.empty(self.shape, dtype=dtype, device=leaf.weight.device)

    fused.FusedBase.weight = property(weight)


def swapped_bytes(family, denoiser, n: int) -> int:
    """Bytes of the blocks ``--blocks_to_swap n`` keeps on the host (the run's split over the family's lists)."""
    from library.run.block_swap import split_blocks_to_swap

    lists = family.swap_blocks(denoiser)
    counts = split_blocks_to_swap(n, lists) if n else [0] * len(lists)
    return sum(nbytes(block) for lst, k in zip(lists, counts) for block in list(lst.blocks)[len(lst.blocks) - k :])


def measure(row: str, args: argparse.Namespace, work: Path, files: dict) -> dict:
    import torch

    import hunyuan_image_train_network
    from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY
    from library.measure.simulated_device import simulated_device

    name, swap, *suffix = row.split(":")
    swap = int(swap)
    argv = [f"--pretrained_model_name_or_path={files['dit']}", f"--text_encoder={files['text_encoder']}",
            f"--byt5={files['byt5']}", f"--vae={files['vae']}", "--train_data_dir", str(work / "data"),
            "--caption_extension", ".txt", "--resolution", str(args.resolution), "--output_dir", str(work / "out"),
            "--output_name", f"lora-{name}{swap}", "--network_module", "networks.lora_hunyuan_image",
            "--network_dim", "16", "--network_alpha", "1", "--network_train_unet_only", "--optimizer_type", "AdamW",
            "--learning_rate", "1e-4", "--train_batch_size", "1", "--max_train_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "0", "--save_model_as", "safetensors", *SETTINGS]  # fmt: skip
    if swap:
        argv += ["--blocks_to_swap", str(swap)]
    if name == "fp8s":
        argv += ["--fp8_scaled"]
    argv += args.extra.split() + (["--fp8_vl"] if "vl" in suffix else [])
    if not args.no_sample:
        argv += ["--sample_prompts", str(work / "prompts.txt"), "--sample_every_n_steps", "2"]
    start = time.time()
    host = {}
    if isinstance(FAMILY.load, RealSizeLoader):
        host = FAMILY.load.prepare(torch.bfloat16, fp8=name == "fp8s", fp8_vl="--fp8_vl" in argv)
        host["swapped"] = swapped_bytes(FAMILY, FAMILY.load.parts.denoiser, swap)
    with simulated_device() as sim:
        hunyuan_image_train_network.run(argv)
    table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    card = CARDS_GB.get(f"{name}:{swap}")
    without_text = max(v for k, v in table.items() if k != "text caching")
    host_gib = {k: round(v / GIB, 2) for k, v in host.items()}
    kept = host.get("swapped", 0) + (
        0 if args.no_sample else host.get("qwen", 0) + host.get("byt5", 0) + host.get("vae", 0)
    )
    return {"row": row, "weights": name, "blocks_to_swap": swap, "resolution": args.resolution, "peak_gib": table,
            "highest_gib": highest, "card_gb": card,
            "fits": None if card is None else (highest + CONTEXT_GIB) * GIB <= card * 1e9,
            "fits_text_encoder_cpu": None if card is None else (without_text + CONTEXT_GIB) * GIB <= card * 1e9,
            "host_parts_gib": host_gib, "host_load_gib": round(sum(v for k, v in host.items() if k != "swapped") / GIB, 2),
            "host_step_gib": round(kept / GIB, 2), "wall_s": round(time.time() - start, 1), "extra": args.extra,
            "model": "tiny" if args.tiny else "real-size"}  # fmt: skip


def prepare_work(work: Path, resolution: int) -> dict:
    """One image and its caption at ``resolution``, the sample prompt, and the tiny files whose tokenizers and
    settings the real-size loader takes."""
    from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY
    from library.run.demo import make_example_dataset

    if not (work / "data").exists():
        make_example_dataset(work / "four", size=resolution)
        (work / "data" / "1_sks shape").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:2]:
            (work / "data" / "1_sks shape" / f.name).write_bytes(f.read_bytes())
    (work / "prompts.txt").write_text(f"a red circle --w {resolution} --h {resolution} --s 4 --n \n")
    return FAMILY.tiny.write_files(FAMILY.tiny.build(seed=0, blocks=40), work / "tiny", "tiny")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="MODE:N rows (bf16|fp8s : blocks_to_swap)")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--no_sample", action="store_true", help="leave the sampling round out")
    parser.add_argument("--extra", default="", help="flags added to every row (one string), e.g. --fp8_vl")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (checks the runs, not the memory)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    for row in args.rows:
        name, _, rest = row.partition(":")
        swap, _, suffix = rest.partition(":")
        if name not in MODES or not swap.isdigit() or suffix not in ("", "vl"):
            parser.error(f"--rows {row}: expected MODE:N[:vl] with MODE one of {', '.join(MODES)} and N >= 0")
    import torch
    from bench_block_swap import fused_attention
    from bench_flux_memory import lazy_host_copies, uncounted_swap_check

    from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hunyuanmem-"))
    files = prepare_work(work, args.resolution)
    if not args.tiny:
        if not isinstance(FAMILY.load, RealSizeLoader):
            FAMILY.load = RealSizeLoader(FAMILY)
        lazy_host_copies()
        unread_fused_weights()
    uncounted_swap_check()
    fused_attention(torch)
    rows = []
    for row in args.rows:
        result = measure(row, args, work, files)
        rows.append(result)
        print(json.dumps(result), flush=True)
    phases = list(rows[0]["peak_gib"])
    print(f"\n| row | {' | '.join(phases)} | highest + {CONTEXT_GIB:g} GiB | card | fits | with --text_encoder_cpu | "
          "host at load | host during the step |")  # fmt: skip
    print("|---" * (len(phases) + 7) + "|")
    for r in rows:
        cells = " | ".join(str(r["peak_gib"].get(p, "")) for p in phases)
        fits = {True: "yes", False: "NO", None: ""}[r["fits"]]
        cpu = {True: "yes", False: "NO", None: ""}[r["fits_text_encoder_cpu"]]
        print(f"| {r['row']} | {cells} | {r['highest_gib'] + CONTEXT_GIB:.2f} | {r['card_gb'] or ''} GB | {fits} | "
              f"{cpu} | {r['host_load_gib']} GiB | {r['host_step_gib']} GiB |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
