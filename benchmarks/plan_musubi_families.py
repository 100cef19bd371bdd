"""``--plan_memory`` on real-size Z-Image and FLUX.2 (klein 4B / 9B, dev) commands, from files without weights: the
device and host memory per phase of musubi-tuner's documented lines.

    python benchmarks/plan_musubi_families.py                          # every row
    python benchmarks/plan_musubi_families.py --rows dev:fp8:29 --vram 24

Writes each released architecture as the files users have (the DiT single file, the text encoder as the first of a
split pair, the AE; ``write_files("qwen-image", ...)``, used by benchmarks/docs_memory_tables.py: the DiT single file,
ComfyUI's Qwen2.5-VL file with its vision tower and ``lm_head``, the VAE; dev: Mistral 3's language model and a word-level tokenizer with Mistral's chat markers beside it,
Mistral's own not being shipped) holding their safetensors headers only: the real key names, shapes and dtypes
(bf16) and no tensor data. Then plans the training command on them (the script with ``--plan_memory``:
library/measure/plan.py; the simulated device counts every device tensor, the phantoms every host tensor) and prints
one JSON line per row and a table: device GiB and host GiB per phase.

Rows ``MODEL:MODE:N``: ``zimage`` (zimage_train_network.py, LoRA rank 32) or ``zimage-full`` (zimage_train.py
``--full_bf16 --fused_backward_pass``), ``klein-4b`` / ``klein-9b`` / ``dev`` (flux_2_train_network.py, rank 32);
MODE ``bf16`` or ``fp8`` (``--fp8_base --fp8_scaled``; FLUX.2 with ``--fp8_text_encoder``, Z-Image with
``--fp8_llm``); N ``--blocks_to_swap`` (0: none). Every row: 1024 px, batch 1, ``--gradient_checkpointing
--mixed_precision bf16``, latents and text outputs cached in the run (in memory: a plan of the on-disk caches
musubi-tuner's dataset config gives stopped once with "no cached latent entry" at the step's next batch, not
understood yet), AdamW, one step, one sample (4 steps), the save.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "tests"))

ROWS = ("zimage:bf16:0", "zimage-full:bf16:0", "zimage-full:bf16:20", "klein-4b:bf16:0", "klein-4b:fp8:0",
        "klein-9b:fp8:0", "klein-9b:fp8:6", "dev:fp8:0", "dev:fp8:13", "dev:fp8:29")  # fmt: skip
GOALS_GIB = {"zimage": 10.0, "zimage-full": 24.0, "klein-4b": 8.0, "klein-9b": 12.0, "dev": 24.0}
GIB = 2.0**30


def _phantom(module, dtype):
    from library.measure.phantom import _mark

    module = module.to(dtype).to_empty(device="cpu")
    for t in (*module.parameters(), *module.buffers()):
        _mark(t)
    return module.eval().requires_grad_(False)


def write_files(model: str, folder: Path) -> list[str]:
    """The model flags of a command on ``model``'s header-only files in ``folder``."""
    import torch
    from accelerate import init_empty_weights

    from library.files.weights import save_state_dict
    from library.measure.phantom import PhantomDevice, header_only_writes

    folder.mkdir(parents=True, exist_ok=True)
    with PhantomDevice(strict=False), header_only_writes():
        if model == "qwen-image":
            from library.families.autoencoders import qwen_image
            from library.families.encoders import qwen25vl, qwen25vl_edit
            from library.families.qwen_image import QWEN_IMAGE

            family, parts = QWEN_IMAGE, QWEN_IMAGE.reference_parts()
            with init_empty_weights(include_buffers=True):  # ComfyUI's qwen_2.5_vl_7b file: the vision tower, lm_head
                vae = qwen_image.factory(qwen_image.RELEASED)()
                vl = _phantom(
                    qwen25vl_edit.build(qwen25vl.RELEASED_TEXT, qwen25vl_edit.RELEASED_VISION), torch.bfloat16
                )
        elif model.startswith("zimage"):
            from library.families.autoencoders import flux_ae
            from library.families.zimage import ZIMAGE

            family, parts = ZIMAGE, ZIMAGE.reference_parts()
            with init_empty_weights(include_buffers=True):
                vae = flux_ae.factory(flux_ae.released_config())()
        else:
            from library.families.autoencoders import flux2 as ae
            from library.families.flux2 import FLUX2
            from library.families.flux2.family import reference

            family, parts = FLUX2, reference(FLUX2.name, model)
            with init_empty_weights(include_buffers=True):
                vae = ae.factory(ae.RELEASED)()
        parts = dataclasses.replace(parts, vae=vae)
        parts = dataclasses.replace(parts, denoiser=_phantom(parts.denoiser, torch.bfloat16),
                                    vae=_phantom(parts.vae, torch.bfloat16),
                                    text_encoders=[_phantom(te, torch.bfloat16) for te in parts.text_encoders])  # fmt: skip
        files = family.tiny.write_files(parts, folder, model)
        if model == "qwen-image":  # ComfyUI's names: model.layers.*, visual.*, lm_head.weight (16.6 GB in bf16)
            names = {"model.language_model.": "model.", "model.visual.": "visual."}
            state = {next((new + k[len(old) :] for old, new in names.items() if k.startswith(old)), k): v
                     for k, v in vl.state_dict().items()}  # fmt: skip
            save_state_dict(state, files["text_encoder"], {"format": "pt"})
        if model == "dev":  # Mistral 3's language model, as the released text_encoder/ split set names it
            from _flux2_helpers import tiny_mistral_tokenizer

            (folder / "text_encoder").mkdir(exist_ok=True)
            state = {"model.language_model." + k: v for k, v in parts.text_encoders[0].state_dict().items()}
            files["text_encoder"] = folder / "text_encoder" / "model-00001-of-00001.safetensors"
            save_state_dict(state, files["text_encoder"], {"format": "pt"})
            tiny_mistral_tokenizer(folder / "tokenizer")
    written = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    if written > 2**26:
        raise RuntimeError(f"{folder}: {written} bytes written; the header-only writes missed a writer")
    return ["--dit", str(files["dit"]), "--vae", str(files["vae"]), "--text_encoder", str(files["text_encoder"])]


def command(row: str, model_flags: list[str], work: Path) -> tuple[str, list[str]]:
    model, mode, swap = row.split(":")
    argv = [*model_flags, "--dataset_config", str(work / "dataset.toml"), "--output_dir", str(work / "out"),
            "--output_name", "plan", "--sdpa", "--mixed_precision", "bf16", "--gradient_checkpointing",
            "--optimizer_type", "AdamW", "--learning_rate", "1e-5", "--max_train_steps", "1",
            "--max_data_loader_n_workers", "0", "--seed", "0", "--sample_prompts", str(work / "prompts.txt"),
            "--sample_every_n_steps", "1", "--cache_latents", "--cache_text_encoder_outputs"]  # fmt: skip
    if model == "zimage-full":
        script = "zimage_train"
        argv += ["--full_bf16", "--fused_backward_pass", "--optimizer_type", "Adafactor", "--optimizer_args",
                 "relative_step=False", "scale_parameter=False", "warmup_init=False"]  # fmt: skip
    else:
        script = "zimage_train_network" if model == "zimage" else "flux_2_train_network"
        module = "networks.lora_zimage" if model == "zimage" else "networks.lora_flux_2"
        argv += ["--network_module", module, "--network_dim", "32", "--network_alpha", "32"]
    if script.startswith("zimage"):
        argv += ["--timestep_sampling", "shift", "--discrete_flow_shift", "2.0", "--weighting_scheme", "none"]
    else:
        argv += ["--model_version", model.replace("klein-", "klein-base-"), "--timestep_sampling", "flux2_shift",
                 "--weighting_scheme", "none"]  # fmt: skip
    if mode == "fp8":
        argv += ["--fp8_base", "--fp8_scaled"]
        argv += ["--fp8_llm"] if script.startswith("zimage") else ["--fp8_text_encoder"]
    if int(swap):
        argv += ["--blocks_to_swap", swap]
    return script, argv


def prepare(work: Path, resolution: int) -> None:
    from library.run.demo import make_example_dataset

    if not (work / "data").exists():
        make_example_dataset(work / "four", size=resolution)
        (work / "data").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:2]:
            (work / "data" / f.name).write_bytes(f.read_bytes())
    (work / "dataset.toml").write_text(
        f'[general]\nresolution = [{resolution}, {resolution}]\ncaption_extension = ".txt"\nbatch_size = 1\n\n'
        f'[[datasets]]\nimage_directory = "{(work / "data").as_posix()}"\nnum_repeats = 1\n'
    )
    (work / "prompts.txt").write_text(f"a red circle --w {resolution} --h {resolution} --s 4\n")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="MODEL:MODE:N rows")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--vram", default=None, help="--vram for every plan (advice when a row does not fit)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    import importlib

    from library.measure.plan import plan_command

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan-musubi-"))
    prepare(work, args.resolution)
    rows = []
    for row in args.rows:
        model = row.split(":")[0]
        folder = work / model.replace("-full", "")
        flags = write_files(model.replace("-full", ""), folder)
        script, cmd = command(row, flags, work)
        cmd += ["--plan_memory", *(["--vram", args.vram] if args.vram else [])]
        run = importlib.import_module(script).run
        start = time.time()
        plan = plan_command(lambda run=run, cmd=cmd: run(cmd), out=lambda line: print(line, file=sys.stderr),
                            script=f"{script}.py")  # fmt: skip
        phases = plan["phases"]
        result = {"row": row, "script": script, "plan_s": round(time.time() - start, 1),
                  "device_gib": {p: round(r["device_mib"] / 1024, 2) for p, r in phases.items()},
                  "host_gib": {p: round(r["host_mib"] / 1024, 2) for p, r in phases.items()},
                  "card_peak_gib": round(plan["card_peak_mib"] / 1024, 2), "goal_gib": GOALS_GIB[model],
                  "fits_goal": plan["card_peak_mib"] / 1024 <= GOALS_GIB[model],
                  "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}  # fmt: skip
        rows.append(result)
        print(json.dumps(result), flush=True)
    phases = list(rows[0]["device_gib"])
    print(f"\n| row | {' | '.join(phases)} | card peak | goal | host: {' | '.join(phases)} |")
    print("|---" * (2 * len(phases) + 3) + "|")
    for r in rows:
        dev = " | ".join(str(r["device_gib"].get(p, "")) for p in phases)
        host = " | ".join(str(r["host_gib"].get(p, "")) for p in phases)
        print(f"| {r['row']} | {dev} | {r['card_peak_gib']} | {'<=' if r['fits_goal'] else 'OVER'} {r['goal_gib']:g} "
              f"| {host} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
