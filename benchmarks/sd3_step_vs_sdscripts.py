"""One SD3.5-medium LoRA step beside sd-scripts on the same batch: which input or output differs (run by hand).

    python tools/make_tiny_model.py --out M --family sd3.5-medium --sd3_blocks 2      # + M/tiny_config.json, below
    cd <sd-scripts> && PYTHONPATH=<peer kit>/helpers/sds_shims <sd-scripts venv>/bin/python \
        <this repo>/benchmarks/sd3_step_vs_sdscripts.py sdscripts M [--steps 10]
    python benchmarks/sd3_step_vs_sdscripts.py ours M [--steps 10]

``sdscripts``: sd-scripts' own sd3_train_network.py (through the peer kit's run_sdscripts_tiny.py, which patches its
hard-coded widths from ``M/tiny_config.json``) trains ``--steps`` steps on ``M/data`` with the flags below, recording
its first step's latents, noise, σ, noisy input, MMDiT inputs (context, pooled) and output, and every step's σ, in
``M/sds_dump.pt``. ``ours``: sd3_train_network.py here trains the same steps (recording σ and the losses), then feeds
sd-scripts' first-step inputs to our loaded model and text encoders: context, pooled vector and transformer output
against sd-scripts', and both preconditioned losses on that batch.

Measured (tiny SD3.5-medium, 64 px, batch 1, --weighting_scheme uniform; 2026-11): context max |diff| 7.6e-6, pooled
0, transformer output 2.0e-2 of 1.98 (sd-scripts' attn2 head width: benchmarks/sd3_attn2_vs_sdscripts.py), the
first step's loss 0.37824 (sd-scripts) vs 0.37830 (ours) at σ = 0.298. Averages over steps follow the σ each side drew
(their random streams differ): per step the loss is about 4.1 σ² on both sides. With the peer kit's 8 images and 10
steps sd-scripts drew mean σ² 0.164 and showed avr_loss 0.692, ours drew 0.417 and averaged 1.780 (sd-scripts'
avr_loss is the mean over the current epoch's steps).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

import torch

FLAGS = ["--resolution", "64", "--train_batch_size", "1", "--optimizer_type", "AdamW", "--learning_rate", "1e-4",
         "--mixed_precision", "no", "--max_data_loader_n_workers", "0", "--output_name", "lora",
         "--save_model_as", "safetensors", "--network_module", "networks.lora_sd3", "--network_dim", "4",
         "--network_alpha", "2", "--seed", "1", "--network_train_unet_only", "--weighting_scheme", "uniform",
         "--cache_latents", "--cache_text_encoder_outputs", "--sdpa", "--caption_extension", ".txt"]  # fmt: skip
CAPTION = "a photo of a red cube"


def model_flags(m: str) -> list[str]:
    return ["--pretrained_model_name_or_path", f"{m}/sd3.5-medium_dit.safetensors",
            "--clip_l", f"{m}/sd3.5-medium_clip_l.safetensors", "--clip_g", f"{m}/sd3.5-medium_clip_g.safetensors",
            "--t5xxl", f"{m}/sd3.5-medium_t5xxl.safetensors"]  # fmt: skip


def sdscripts(m: str, steps: int, kit: str) -> None:
    sys.path.insert(0, os.getcwd())
    from library import sd3_models, sd3_train_utils

    dump: dict = {"sigmas": []}
    forward, noisy = sd3_models.MMDiT.forward, sd3_train_utils.get_noisy_model_input_and_timesteps

    def spy_forward(self, x, t, y=None, context=None, **kw):
        out = forward(self, x, t, y=y, context=context, **kw)
        if "out" not in dump:
            dump.update(x=x.detach().clone(), t=t.detach().clone(), y=y.detach().clone(),
                        context=context.detach().clone(), out=out.detach().clone())  # fmt: skip
        return out

    def spy_noisy(*a, **kw):
        r = noisy(*a, **kw)
        dump["sigmas"] += r[2].detach().flatten().tolist()
        if "latents" not in dump:
            dump.update(latents=a[1].detach().clone(), noise=a[2].detach().clone(), noisy=r[0].detach().clone(),
                        sigma=r[2].detach().clone())  # fmt: skip
        return r

    sd3_models.MMDiT.forward, sd3_train_utils.get_noisy_model_input_and_timesteps = spy_forward, spy_noisy
    sys.argv = ["run_sdscripts_tiny.py", "sd3_train_network.py", *model_flags(m), "--tokenizer_cache_dir",
                os.path.expanduser("~/sdtrain-peer/tokcache"), "--train_data_dir", f"{m}/data", "--output_dir",
                f"{m}/sds_out", "--max_train_steps", str(steps), *FLAGS]  # fmt: skip
    runpy.run_path(os.path.join(kit, "run_sdscripts_tiny.py"), run_name="__main__")
    torch.save(dump, f"{m}/sds_dump.pt")
    print("sd-scripts σ:", [round(s, 3) for s in dump["sigmas"]])


def ours(m: str, steps: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import sd3_train_network
    from library.families import get_family
    from library.families.base import Cond
    from library.families.sd3.options import SD3Options
    from library.objectives import flow as fm

    sigmas: list[float] = []
    draw = fm.draw_noise_and_sigmas

    def spy(*a, **kw):
        r = draw(*a, **kw)
        sigmas.extend(x.flatten().tolist() for x in r if torch.is_tensor(x) and x.ndim <= 1)
        return r

    fm.draw_noise_and_sigmas = spy
    result = sd3_train_network.run([*model_flags(m), "--train_data_dir", f"{m}/data", "--output_dir", f"{m}/our_out",
                                    "--max_train_steps", str(steps), *FLAGS])  # fmt: skip
    losses = result.losses
    print(f"ours: losses {[round(x, 3) for x in losses]} mean {sum(losses) / len(losses):.3f}")
    d = torch.load(f"{m}/sds_dump.pt", weights_only=True)
    print(f"sd-scripts σ² mean {sum(s * s for s in d['sigmas']) / len(d['sigmas']):.3f}")
    args = sd3_train_network.build_parser().parse_args(model_flags(m))
    family = get_family("sd3.5-medium")
    parts = family.load(f"{m}/sd3.5-medium_dit.safetensors", options=SD3Options.from_args(args, training=True))
    with torch.no_grad():
        cond = family.encode_prompt(parts, [CAPTION])
        print("context max |diff|", (cond.hidden_states - d["context"]).abs().max().item(),
              "pooled max |diff|", (cond.pooled - d["y"]).abs().max().item())  # fmt: skip
        out = family.predict(parts.denoiser, d["x"], d["t"], Cond(d["context"], d["y"], None))
        print("transformer output max |diff|", (out - d["out"]).abs().max().item(), "of", d["out"].abs().max().item())
        sigma = d["sigma"].view(-1, 1, 1, 1)
        for side, o in (("sd-scripts", d["out"]), ("ours", out)):
            loss = torch.nn.functional.mse_loss(o * -sigma + d["noisy"], d["latents"]).item()
            print(f"{side}: preconditioned loss {loss:.5f} at σ {d['sigma'].flatten().tolist()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("side", choices=["sdscripts", "ours"])
    ap.add_argument("models", help="folder of make_tiny_model.py's sd3.5-medium files, tiny_config.json and data/")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--kit", default="/work/shared/peer/helpers", help="the peer kit's helpers folder")
    a = ap.parse_args()
    if a.side == "sdscripts":
        sdscripts(a.models, a.steps, a.kit)
    else:
        ours(a.models, a.steps)


if __name__ == "__main__":
    main()
