"""Qwen-Image beside kohya-ss/musubi-tuner's own code on the same tiny files and the same draws (by hand; CI has no
musubi-tuner).

    cd /work/wt-qwen && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/qwen_image_vs_musubi.py

Our side (this venv) writes the tiny Qwen-Image files, trains a LoRA one step with musubi-tuner's documented command
line and computes, for fixed inputs: the DiT's velocity, the noisy input / timesteps / target / loss of every
``--timestep_sampling`` we take (seeded), Qwen-Image's prompt embeddings and mask. Then musubi-tuner's side runs in
its venv (``--musubi_python``, default ~/sdtrain-peer/sdsvenv; ``PYTHONPATH`` ~/musubi/src + the torchvision shims):
its ``QwenImageTransformer2DModel`` loads our DiT file strictly (same key names), runs on the same inputs (also
with two reference latents as its edit ``call_dit`` appends them, and as an Edit-2511 DiT with ``zero_cond_t``); its
``NetworkTrainer.get_noisy_model_input_and_timesteps`` runs on the same noise draws and seeds; its
``get_qwen_prompt_embeds`` runs over a transformers ``Qwen2_5_VLForConditionalGeneration`` holding our tiny language
model; its ``lora_qwen_image.create_arch_network`` names its modules. Prints each comparison's max |difference|.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

SAMPLINGS = ("uniform", "sigmoid", "shift", "flux_shift", "qwen_shift", "logsnr")
CAPTIONS = ["a red cube on a table", "sks shape", ""]
B, C, H, W = 2, 16, 8, 12


def ours(out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    import qwen_image_train_network
    from library.families.encoders import qwen25vl
    from library.families.qwen_image import QWEN_IMAGE
    from library.families.qwen_image import model as M
    from library.families.qwen_image.objective import QwenFlowConfig, QwenFlowObjective
    from library.objectives.losses import LossConfig
    from library.run.demo import make_example_dataset

    parts = QWEN_IMAGE.tiny.build(seed=0)
    files = QWEN_IMAGE.tiny.write_files(parts, out, "tiny")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, C, H, W, generator=g)
    ctx = torch.randn(B, 5, 16, generator=g)
    mask = torch.ones(B, 5, dtype=torch.long)
    mask[1, 3:] = 0
    ctx[1, 3:] = 0
    sigma = torch.tensor([0.3, 0.8])
    res = {"x": x, "ctx": ctx, "mask": mask, "sigma": sigma}
    res["ref0"], res["ref1"] = torch.randn(B, C, 4, 8, generator=g), torch.randn(B, C, 6, 6, generator=g)
    edit2511 = M.build(dict(M.TINY, zero_cond_t=True)).eval()  # Edit-2511's DiT: the same weights, zero_cond_t
    edit2511.load_state_dict(parts.denoiser.state_dict())
    with torch.no_grad():
        res["velocity"] = M.forward(parts.denoiser, x, sigma, ctx, mask)
        refs = [res["ref0"], res["ref1"]]  # the edit models' control latents, two as Edit-2509 takes
        res["edit.velocity"] = M.forward(parts.denoiser, x, sigma, ctx, mask, references=refs)
        res["edit2511.velocity"] = M.forward(edit2511, x, sigma, ctx, mask, references=refs)
        for kind in SAMPLINGS:
            obj = QwenFlowObjective(QwenFlowConfig(timestep_sampling=kind, discrete_flow_shift=2.2), LossConfig())
            ex = obj.example(x, torch.Generator().manual_seed(7))
            res[f"{kind}.noisy"], res[f"{kind}.timesteps"], res[f"{kind}.target"] = ex.noisy, ex.timesteps, ex.target
            pred = torch.zeros_like(x)
            res[f"{kind}.loss"] = obj.loss_per_sample(pred, ex).mean().reshape(1)
        states, smask = qwen25vl.encode(parts.text_encoders[0], parts.tokenizers[0], CAPTIONS)
        res["embeds"], res["embeds_mask"] = states, smask
    save_file({k: v.contiguous() for k, v in res.items()}, str(out / "ours.safetensors"))
    # one LoRA step with the documented command line: the module names
    ds = make_example_dataset(out / "data")
    toml = out / "dataset.toml"
    toml.write_text(f'[general]\nresolution = [64, 64]\ncaption_extension = ".txt"\nbatch_size = 1\n\n[[datasets]]\n'
                    f'image_directory = "{(ds / "10_sks shape").as_posix()}"\nnum_repeats = 1\n')  # fmt: skip
    rc = qwen_image_train_network.main([
        "--dit", str(files["dit"]), "--vae", str(files["vae"]), "--text_encoder", str(files["text_encoder"]),
        "--model_version", "original", "--dataset_config", str(toml), "--sdpa", "--mixed_precision", "bf16",
        "--timestep_sampling", "shift", "--weighting_scheme", "none", "--discrete_flow_shift", "2.2",
        "--optimizer_type", "adamw8bit", "--learning_rate", "5e-5", "--gradient_checkpointing",
        "--max_data_loader_n_workers", "2", "--persistent_data_loader_workers", "--network_module",
        "networks.lora_qwen_image", "--network_dim", "16", "--max_train_steps", "1", "--save_every_n_epochs", "1",
        "--seed", "42", "--output_dir", str(out / "lora"), "--output_name", "tiny-lora"])  # fmt: skip
    assert rc == 0, rc
    names = sorted({k.split(".")[0] for k in load_file(str(out / "lora" / "tiny-lora.safetensors"))})
    (out / "our_lora_names.json").write_text(json.dumps(names))
    (out / "tokenizer_dir.txt").write_text(str(qwen25vl._bundled_folder()))


def musubi(out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2TokenizerFast

    sys.modules.setdefault("av", types.ModuleType("av"))  # musubi-tuner's video decoding, not used here

    from musubi_tuner.networks import lora_qwen_image
    from musubi_tuner.qwen_image import qwen_image_model, qwen_image_utils
    from musubi_tuner.training.trainer_base import NetworkTrainer

    ours_ = load_file(str(out / "ours.safetensors"))
    res = {}
    dit = qwen_image_model.QwenImageTransformer2DModel(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                                       joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
                                                       attn_mode="torch")  # fmt: skip
    info = dit.load_state_dict(load_file(str(out / "tiny_dit.safetensors")), strict=True)
    print("musubi DiT strict load:", info)
    x, ctx, mask, sigma = ours_["x"], ours_["ctx"], ours_["mask"], ours_["sigma"]
    lens = [int(m.sum()) for m in mask]
    with torch.no_grad():
        packed = qwen_image_utils.pack_latents(x.unsqueeze(2))
        out_ = dit(hidden_states=packed, timestep=sigma, guidance=None, encoder_hidden_states_mask=mask.bool(),
                   encoder_hidden_states=ctx, img_shapes=[[(1, H // 2, W // 2)]] * B, txt_seq_lens=lens)  # fmt: skip
        out_ = out_[0] if isinstance(out_, (tuple, list)) else getattr(out_, "sample", out_)
        res["velocity"] = qwen_image_utils.unpack_latents(out_, H * 8, W * 8, 8).squeeze(2)
        # the edit models: musubi-tuner's call_dit appends the packed control latents and their img_shapes
        refs = [ours_["ref0"], ours_["ref1"]]
        controls = torch.cat([qwen_image_utils.pack_latents(r.unsqueeze(2)) for r in refs], dim=1)
        shapes = [[(1, H // 2, W // 2)] + [(1, r.shape[-2] // 2, r.shape[-1] // 2) for r in refs]] * B
        zero = qwen_image_model.QwenImageTransformer2DModel(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                                            joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
                                                            attn_mode="torch", zero_cond_t=True)  # fmt: skip
        zero.load_state_dict(load_file(str(out / "tiny_dit.safetensors")), strict=True)
        for key, model in (("edit.velocity", dit), ("edit2511.velocity", zero)):
            o = model(hidden_states=torch.cat([packed, controls], dim=1), timestep=sigma, guidance=None,
                      encoder_hidden_states_mask=mask.bool(), encoder_hidden_states=ctx, img_shapes=shapes,
                      txt_seq_lens=lens)  # fmt: skip
            o = o[0] if isinstance(o, (tuple, list)) else getattr(o, "sample", o)
            res[key] = qwen_image_utils.unpack_latents(o[:, : packed.shape[1]], H * 8, W * 8, 8).squeeze(2)
    trainer = NetworkTrainer.__new__(NetworkTrainer)
    trainer.num_timestep_buckets = None
    for kind in SAMPLINGS:
        args = argparse.Namespace(timestep_sampling=kind, discrete_flow_shift=2.2, sigmoid_scale=1.0, logit_mean=0.0,
                                  logit_std=1.0, mode_scale=1.29, weighting_scheme="none", min_timestep=None,
                                  max_timestep=None, preserve_distribution_shape=False)  # fmt: skip
        torch.manual_seed(7)  # our draws: generator seeded 7, noise first, then t (musubi: randn_like, then its law)
        lat = x.unsqueeze(2)
        noise = torch.randn_like(lat)
        noisy, timesteps = NetworkTrainer.get_noisy_model_input_and_timesteps(trainer, args, noise, lat, None, None,
                                                                                 "cpu", torch.float32)  # fmt: skip
        res[f"{kind}.noisy"], res[f"{kind}.timesteps"] = noisy.squeeze(2), timesteps
        res[f"{kind}.target"] = (noise - lat).squeeze(2)
        res[f"{kind}.loss"] = torch.nn.functional.mse_loss(torch.zeros_like(lat), noise - lat).reshape(1)
    # the prompt: a Qwen2.5-VL holding our tiny language model (vision tower unused for text)
    te = load_file(str(out / "tiny_te.safetensors"))
    cfg = Qwen2_5_VLConfig(text_config=dict(vocab_size=152064, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000,
                                            rope_scaling={"type": "default", "mrope_section": [1, 1, 2]}),
                           vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                              out_hidden_size=16), vocab_size=152064, hidden_size=16,
                           intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           rms_norm_eps=1e-6, rope_theta=1000000.0,
                           rope_scaling={"type": "default", "mrope_section": [1, 1, 2]}, vision_start_token_id=151652,
                           vision_end_token_id=151653, vision_token_id=151654, image_token_id=151655,
                           video_token_id=151656)  # fmt: skip
    vlm = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    lm = {k[len("model.") :]: v for k, v in te.items()}
    missing = vlm.model.language_model.load_state_dict(lm, strict=True)
    print("musubi-side language model strict load:", missing)
    tok = Qwen2TokenizerFast(tokenizer_file=str(Path((out / "tokenizer_dir.txt").read_text()) / "tokenizer.json"))
    tok.pad_token = "<|endoftext|>"
    embeds, emask = qwen_image_utils.get_qwen_prompt_embeds(tok, vlm, CAPTIONS)
    res["embeds"], res["embeds_mask"] = embeds.float(), emask
    save_file({k: v.contiguous().float() for k, v in res.items()}, str(out / "musubi.safetensors"))
    net = lora_qwen_image.create_arch_network(1.0, 16, 16, None, [], dit)
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
    out = Path(a.out or tempfile.mkdtemp(prefix="qwen_vs_musubi_"))
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
