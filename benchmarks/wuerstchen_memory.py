"""``--plan_memory`` of a real-size Würstchen 2 LoRA command at 1024 px, from a prior folder without weights.

    python benchmarks/wuerstchen_memory.py [--workdir DIR] [--dim 16] [--extra "..."]

Writes the released architecture (warp-ai/wuerstchen-prior's ``WuerstchenPrior``, c 1536, depth 32, and CLIP-bigG) as
a ``WuerstchenPriorPipeline`` folder with the EfficientNetV2-S encoder in ``effnet/``, every file holding its
safetensors header only (benchmarks/stable_cascade_memory.py's way), then plans wuerstchen_train_network.py's command
on it: ``networks.lora``, AdamW, ``--mixed_precision bf16 --gradient_checkpointing --cache_latents
--cache_text_encoder_outputs --network_train_unet_only``, batch 1, one 1024 px image. Prints one JSON line. Use a
fresh ``--workdir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

COMMON = ["--network_module", "networks.lora", "--network_alpha", "8", "--network_train_unet_only",
          "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--mixed_precision", "bf16",
          "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--sdpa",
          "--max_data_loader_n_workers", "0", "--seed", "0", "--max_train_steps", "1"]  # fmt: skip


def write_folder(folder: Path) -> Path:
    """The released prior, CLIP-bigG and the encoder as a header-only prior folder."""
    import torch
    from accelerate import init_empty_weights

    from library.families.stable_cascade import WUERSTCHEN as family
    from library.families.stable_cascade.effnet import EfficientNetEncoder
    from library.families.tokenizers import PAD_OPEN_CLIP, load_clip_tokenizer
    from library.measure.phantom import PhantomDevice, _mark, header_only_writes

    with PhantomDevice(strict=False), header_only_writes():
        parts = family.reference_parts()
        with init_empty_weights():
            effnet = EfficientNetEncoder(affine=True)
        parts = dataclasses.replace(parts, vae=effnet, tokenizers=[load_clip_tokenizer(PAD_OPEN_CLIP)])
        for module in (parts.denoiser, parts.vae, *parts.text_encoders):
            module.to(torch.bfloat16).to_empty(device="cpu")
            for t in (*module.parameters(), *module.buffers()):
                _mark(t)
        model = family.save(parts, folder / "wuerstchen-prior")
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    if written > 2**26:
        raise RuntimeError(f"{folder}: {written} bytes written; the header-only writes missed a writer")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--dim", default="16")
    parser.add_argument("--extra", default="", help="more flags for the command (e.g. '--train_batch_size 2')")
    args = parser.parse_args()

    import wuerstchen_train_network
    from library.measure.plan import plan_command
    from library.run.demo import make_example_dataset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="plan-wuerstchen-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_folder(work)
    data = make_example_dataset(work / "data1024", size=1024)
    argv = ["--pretrained_prior_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "1024", "--output_dir", str(work / "out"), "--network_dim", args.dim, *COMMON,
            *args.extra.split(), "--plan_memory"]  # fmt: skip
    plan = plan_command(lambda: wuerstchen_train_network.run(argv), out=lambda line: print(line, file=sys.stderr))
    print(json.dumps({"device_peak_mib": plan["device_peak_mib"], "card_peak_mib": plan["card_peak_mib"],
                      "host_peak_mib": plan["host_peak_mib"],
                      "phases": {p: r["device_mib"] for p, r in plan["phases"].items()}}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
