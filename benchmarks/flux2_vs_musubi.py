"""FLUX.2 (klein) beside kohya-ss/musubi-tuner's own code on the same tiny files and the same draws (by hand; CI has
no musubi-tuner).

    cd /work/wt-flux2 && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/flux2_vs_musubi.py

Our side (this venv) writes the tiny FLUX.2 files, trains a LoRA one step with musubi-tuner's documented command line
and computes, for fixed inputs: the DiT's velocity (with one reference image), the noisy input / timesteps / target /
loss of every ``--timestep_sampling`` we take (seeded), the Qwen3 prompt embeddings. Then musubi-tuner's side runs in
its venv (``--musubi_python``, default ~/sdtrain-peer/sdsvenv; ``PYTHONPATH`` ~/musubi/src + the torchvision shims):
its ``flux2_models.Flux2`` loads our BFL DiT file strictly and runs on the same inputs with its own ``prc_img`` /
``prc_txt`` / ``pack_control_latent`` ids; its ``NetworkTrainer.get_noisy_model_input_and_timesteps`` runs on the
same noise draws and seeds; its ``Qwen3Embedder`` runs over a transformers ``Qwen3ForCausalLM`` holding our tiny
Qwen3; its ``AutoEncoder`` (at its 32-group width) loads our BFL ``ae.safetensors`` strictly and encodes / decodes
the same pixels; its ``lora_flux_2.create_arch_network`` names its modules. Prints each comparison's max |difference|.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

SAMPLINGS = ("uniform", "sigmoid", "shift", "flux_shift", "flux2_shift", "qwen_shift", "logsnr")
CAPTIONS = ["a red cube on a table", "sks shape", ""]
B, C, H, W = 2, 128, 4, 6
TINY_QWEN3 = dict(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=27,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=1000000,
                  max_position_embeddings=40960, tie_word_embeddings=True)  # fmt: skip


def ours(out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    import flux_2_train_network
    from library.families.encoders import qwen3
    from library.families.flux2 import FLUX2
    from library.families.flux2 import model as M
    from library.families.flux2.objective import Flux2FlowConfig, Flux2FlowObjective
    from library.objectives.losses import LossConfig
    from library.run.demo import make_example_dataset

    parts = FLUX2.tiny.build(seed=0)
    files = FLUX2.tiny.write_files(parts, out, "tiny")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, C, H, W, generator=g)
    ctx = torch.randn(B, 5, 48, generator=g)
    ref = torch.randn(B, C, 2, 4, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    res = {"x": x, "ctx": ctx, "ref": ref, "sigma": sigma}
    with torch.no_grad():
        res["velocity"] = M.forward(parts.denoiser, x, sigma, ctx)
        res["velocity_ref"] = M.forward(parts.denoiser, x, sigma, ctx, references=[ref])
        for kind in SAMPLINGS:
            obj = Flux2FlowObjective(Flux2FlowConfig(timestep_sampling=kind, discrete_flow_shift=2.2), LossConfig())
            ex = obj.example(x, torch.Generator().manual_seed(7))
            res[f"{kind}.noisy"], res[f"{kind}.timesteps"], res[f"{kind}.target"] = ex.noisy, ex.timesteps, ex.target
            res[f"{kind}.loss"] = obj.loss_per_sample(torch.zeros_like(x), ex).mean().reshape(1)
        res["embeds"] = FLUX2.encode_prompt(parts, CAPTIONS).hidden_states
    # the AE at musubi-tuner's GroupNorm width (32 groups): BFL names written by us, encode / decode by us
    from library.families.autoencoders import flux2 as ae
    from library.families.flux2.saving import save_vae
    from library.families.flux2.tiny import randomize

    vae = ae.factory(dict(ae.RELEASED, block_out_channels=[32, 32, 32, 32], layers_per_block=1))().eval()
    randomize(vae, 11)
    vae.bn.running_mean.normal_(0, 0.3, generator=g)
    vae.bn.running_var.uniform_(0.5, 1.5, generator=g)
    save_vae(dataclasses.replace(parts, vae=vae), out / "ae32.safetensors")
    pixels = torch.rand(1, 3, 64, 32, generator=g) * 2 - 1
    with torch.no_grad():
        res["pixels"] = pixels
        res["ae_latents"] = ae.encode(vae, pixels)
        mean, std = ae._stats(vae, res["ae_latents"])  # decode without the clamp (musubi-tuner's does not clamp)
        res["ae_decoded"] = vae.decode(ae.unpatchify(res["ae_latents"] * std + mean)).sample
    save_file({k: v.contiguous() for k, v in res.items()}, str(out / "ours.safetensors"))
    ds = make_example_dataset(out / "data")
    toml = out / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\nbatch_size = 1\n\n[[datasets]]\n'
                    f'image_directory = "{(ds / "10_sks shape").as_posix()}"\nnum_repeats = 1\n')  # fmt: skip
    rc = flux_2_train_network.main([
        "--model_version", "klein-base-4b", "--dit", str(files["dit"]), "--vae", str(files["vae"]), "--text_encoder",
        str(files["text_encoder"]), "--dataset_config", str(toml), "--sdpa", "--mixed_precision", "bf16",
        "--timestep_sampling", "flux2_shift", "--weighting_scheme", "none", "--optimizer_type", "adamw8bit",
        "--learning_rate", "1e-4", "--gradient_checkpointing", "--max_data_loader_n_workers", "2",
        "--persistent_data_loader_workers", "--network_module", "networks.lora_flux_2", "--network_dim", "32",
        "--max_train_steps", "1", "--save_every_n_epochs", "1", "--seed", "42", "--output_dir", str(out / "lora"),
        "--output_name", "tiny-lora"])  # fmt: skip
    assert rc == 0, rc
    names = sorted({k.split(".")[0] for k in load_file(str(out / "lora" / "tiny-lora.safetensors"))})
    (out / "our_lora_names.json").write_text(json.dumps(names))
    (out / "tokenizer_dir.txt").write_text(str(qwen3.bundled_folder()))
    (out / "chat_template.txt").write_text(qwen3.chat_template())
    (out / "te_files.json").write_text(json.dumps([str(files["text_encoder"]), str(files["text_encoder"]).replace(
        "00001-of", "00002-of")]))  # fmt: skip


def musubi(out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2TokenizerFast, Qwen3Config, Qwen3ForCausalLM

    sys.modules.setdefault("av", types.ModuleType("av"))  # musubi-tuner's video decoding, not used here

    from musubi_tuner.flux_2 import flux2_models, flux2_utils
    from musubi_tuner.networks import lora_flux_2
    from musubi_tuner.training.trainer_base import NetworkTrainer

    ours_ = load_file(str(out / "ours.safetensors"))
    res = {}
    params = flux2_models.Flux2Params(in_channels=C, context_in_dim=48, hidden_size=32, num_heads=2, depth=1,
                                      depth_single_blocks=2, axes_dim=[4, 4, 4, 4], theta=2000, mlp_ratio=3.0,
                                      use_guidance_embed=False)  # fmt: skip
    dit = flux2_models.Flux2(params, attn_mode="torch").eval()
    info = dit.load_state_dict(load_file(str(out / "tiny-base_dit.safetensors")), strict=True)
    print("musubi DiT strict load:", info)
    x, ctx, ref, sigma = ours_["x"], ours_["ctx"], ours_["ref"], ours_["sigma"]
    with torch.no_grad():
        img, img_ids = flux2_utils.prc_img(x)
        txt, txt_ids = flux2_utils.prc_txt(ctx)
        out_ = dit(x=img, x_ids=img_ids, timesteps=sigma, ctx=txt, ctx_ids=txt_ids, guidance=None)
        res["velocity"] = out_.transpose(1, 2).reshape(x.shape)
        ref_tokens, ref_ids = flux2_utils.pack_control_latent([ref])
        out_ = dit(x=torch.cat([img, ref_tokens], 1), x_ids=torch.cat([img_ids, ref_ids], 1), timesteps=sigma,
                   ctx=txt, ctx_ids=txt_ids, guidance=None)[:, : H * W]  # fmt: skip
        res["velocity_ref"] = out_.transpose(1, 2).reshape(x.shape)
    ae_model = flux2_models.AutoEncoder(flux2_models.AutoEncoderParams(ch=32, ch_mult=[1, 1, 1, 1], num_res_blocks=1))
    print("musubi AE strict load:", ae_model.load_state_dict(load_file(str(out / "ae32.safetensors")), strict=True))
    with torch.no_grad():
        res["ae_latents"] = ae_model.encode(ours_["pixels"])
        res["ae_decoded"] = ae_model.decode(res["ae_latents"])
    trainer = NetworkTrainer.__new__(NetworkTrainer)
    trainer.num_timestep_buckets = None
    for kind in SAMPLINGS:
        args = argparse.Namespace(timestep_sampling=kind, discrete_flow_shift=2.2, sigmoid_scale=1.0, logit_mean=0.0,
                                  logit_std=1.0, mode_scale=1.29, weighting_scheme="none", min_timestep=None,
                                  max_timestep=None, preserve_distribution_shape=False)  # fmt: skip
        torch.manual_seed(7)  # our draws: generator seeded 7, noise first, then t (musubi: randn_like, then its law)
        noise = torch.randn_like(x)
        noisy, timesteps = NetworkTrainer.get_noisy_model_input_and_timesteps(trainer, args, noise, x, None, None,
                                                                                 "cpu", torch.float32)  # fmt: skip
        res[f"{kind}.noisy"], res[f"{kind}.timesteps"] = noisy, timesteps
        res[f"{kind}.target"] = noise - x
        res[f"{kind}.loss"] = torch.nn.functional.mse_loss(torch.zeros_like(x), noise - x).reshape(1)
    # the prompt: musubi-tuner's Qwen3Embedder over a Qwen3ForCausalLM holding our tiny Qwen3
    te = {}
    for f in json.loads((out / "te_files.json").read_text()):
        te.update(load_file(f))
    lm = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).eval()
    print("musubi-side Qwen3 strict load:", lm.model.load_state_dict({k[len("model.") :]: v for k, v in te.items()}))
    tok = Qwen2TokenizerFast(tokenizer_file=str(Path((out / "tokenizer_dir.txt").read_text()) / "tokenizer.json"))
    tok.pad_token = "<|endoftext|>"
    tok.chat_template = (out / "chat_template.txt").read_text()
    with torch.no_grad():
        res["embeds"] = flux2_utils.Qwen3Embedder(tok, lm)(CAPTIONS).float()
    save_file({k: v.contiguous().float() for k, v in res.items()}, str(out / "musubi.safetensors"))
    net = lora_flux_2.create_arch_network(1.0, 32, 32, None, [], dit)
    names = sorted(m.lora_name for m in net.unet_loras)
    (out / "musubi_lora_names.json").write_text(json.dumps(names))


def compare(out: Path) -> int:
    from safetensors.torch import load_file

    a, b = load_file(str(out / "ours.safetensors")), load_file(str(out / "musubi.safetensors"))
    worst = 0.0
    for key in sorted(b):
        x, y = a[key].float(), b[key].float()
        if x.shape != y.shape:
            print(f"{key}: shapes differ {tuple(x.shape)} vs {tuple(y.shape)}")
            worst = float("inf")
            continue
        d = (x - y).abs().max().item()
        scale = y.abs().max().item()
        worst = max(worst, d / max(scale, 1e-12))
        print(f"{key:24s} max|ours - musubi| = {d:.3e}   (max |musubi| {scale:.3e})")
    ours_names = json.loads((out / "our_lora_names.json").read_text())
    theirs = json.loads((out / "musubi_lora_names.json").read_text())
    print(f"LoRA modules: ours {len(ours_names)}, musubi {len(theirs)}, equal: {ours_names == theirs}")
    ok = ours_names == theirs and worst < 1e-5
    print("OK" if ok else "DIFFERENT", f"(worst relative difference {worst:.2e})")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("both", "ours", "musubi"), default="both")
    p.add_argument("--out", default=None)
    p.add_argument("--musubi_python", default=os.path.expanduser("~/sdtrain-peer/sdsvenv/bin/python"))
    p.add_argument("--musubi_src", default=os.path.expanduser("~/musubi/src"))
    p.add_argument("--shims", default="/work/shared/peer/helpers/sds_shims")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="flux2_vs_musubi_"))
    out.mkdir(parents=True, exist_ok=True)
    if a.side == "ours":
        ours(out)
        return 0
    if a.side == "musubi":
        musubi(out)
        return 0
    ours(out)
    env = dict(os.environ, PYTHONPATH=f"{a.musubi_src}:{a.shims}")
    subprocess.run([a.musubi_python, __file__, "--side", "musubi", "--out", str(out)], check=True, env=env)
    return compare(out)


if __name__ == "__main__":
    sys.exit(main())
