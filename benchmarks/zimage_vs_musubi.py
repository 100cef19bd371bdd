"""Z-Image beside kohya-ss/musubi-tuner's own code on the same tiny files and the same draws (by hand; CI has no
musubi-tuner).

    cd /work/wt-zimage && PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/zimage_vs_musubi.py

Our side (this venv) writes the tiny Z-Image files, trains a LoRA two steps with musubi-tuner's documented command line
and computes, for fixed inputs: the DiT's output through ``ZIMAGE.predict`` (negated back to the DiT's x0 − ε), the
noisy input / timesteps / target (negated likewise) / loss of every ``--timestep_sampling`` (seeded), the Qwen3
prompt states at the real tokens. musubi-tuner's side runs in its venv (``--musubi_python``, default
~/sdtrain-peer/sdsvenv; ``PYTHONPATH`` ~/musubi/src + the torchvision shims): its ``ZImageTransformer2DModel`` loads
our DiT file (diffusers names) strictly and runs through its own ``ZImageNetworkTrainer.call_dit`` (batch of two
captions of different lengths: its padded, masked path); its ``NetworkTrainer.get_noisy_model_input_and_timesteps``
on the same noise and seeds; its ``zimage_utils.get_text_embeds`` (chat template, layer −2) over a transformers
``Qwen3ForCausalLM`` holding our tiny Qwen3 and the Qwen3 tokenizer with its chat template (sd-scripts'
configs/qwen3_06b, ``--qwen3_tokenizer``); its ``lora_zimage.create_arch_network`` names its modules. Prints each
comparison's max |difference| and the sampling schedules of both (ours: diffusers' ZImagePipeline levels).

Known difference, not a bug here: musubi-tuner's own ``ZImageTransformer2DModel`` starts the image tokens' RoPE
positions after its caption length as given (the batch's longest, padded so that caption + image tokens are a multiple
of 32), the official model (diffusers, Tongyi-MAI's code, which we run) after each caption padded alone to a multiple
of 32. The two DiTs agree where those lengths agree (the forward check here: 32-token captions, 64 image tokens) and
differ otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

SAMPLINGS = ("uniform", "sigmoid", "shift", "flux_shift", "qwen_shift", "logsnr", "sigma")
CAPTIONS = ["a red cube on a table", "sks shape", ""]
B, C, H, W = 2, 16, 8, 12


def ours(out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    import zimage_train_network
    from library.families.base import Cond
    from library.families.zimage import ZIMAGE
    from library.families.zimage.objective import ZImageFlowConfig, ZImageFlowObjective
    from library.objectives.losses import LossConfig
    from library.run.demo import make_example_dataset
    from library.sampling.flow import linear_flow_sigmas

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _zimage_helpers import doc_command, musubi_toml

    parts = ZIMAGE.tiny.build(seed=0)
    files = {k: str(v) for k, v in ZIMAGE.tiny.write_files(parts, out, "tiny").items()}
    save_file(dict(parts.denoiser.state_dict()), str(out / "tiny_dit_diffusers.safetensors"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, C, H, W, generator=g)
    # the DiT's inputs: 16 x 16 latents (64 image tokens) and 32 caption tokens, so that musubi-tuner's padding of
    # the joint sequence to a multiple of 32 and the official one of the caption alone agree (module docstring)
    x16 = torch.randn(B, C, 16, 16, generator=g)
    ctx = torch.randn(B, 32, 16, generator=g)
    mask = torch.ones(B, 32, dtype=torch.long)
    timesteps = torch.tensor([301.0, 801.0])
    res = {"x": x, "x16": x16, "ctx": ctx, "mask": mask, "timesteps_in": timesteps}
    with torch.no_grad():
        res["pred"] = -ZIMAGE.predict(parts.denoiser, x16, timesteps, Cond(ctx, None, mask))
        for kind in SAMPLINGS:
            obj = ZImageFlowObjective(ZImageFlowConfig(timestep_sampling=kind, discrete_flow_shift=2.0), LossConfig())
            ex = obj.example(x, torch.Generator().manual_seed(7))
            res[f"{kind}.noisy"], res[f"{kind}.timesteps"], res[f"{kind}.target"] = ex.noisy, ex.timesteps, -ex.target
            res[f"{kind}.loss"] = obj.loss_per_sample(torch.zeros_like(x), ex).mean().reshape(1)
        cond = ZIMAGE.encode_prompt(parts, CAPTIONS)
        rows = [cond.hidden_states[i, : int(cond.mask[i].sum())] for i in range(len(CAPTIONS))]
        res["embeds"] = torch.cat(rows)
        res["sigmas"] = linear_flow_sigmas(8, 3.0)
    save_file({k: v.contiguous() for k, v in res.items()}, str(out / "ours.safetensors"))
    ds = make_example_dataset(out / "data")
    toml = musubi_toml(ds, out / "dataset.toml")
    rc = zimage_train_network.main(doc_command(files, toml, out / "lora", "--max_train_steps", "2"))
    if rc != 0:
        raise SystemExit(f"zimage_train_network.py failed: {rc}")
    names = sorted({k.split(".")[0] for k in load_file(str(out / "lora" / "my-lora.safetensors"))})
    (out / "our_lora_names.json").write_text(json.dumps(names))


def musubi(out: Path, tokenizer_dir: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM

    sys.modules.setdefault("av", types.ModuleType("av"))  # musubi-tuner's video decoding, not used here

    from musubi_tuner.networks import lora_zimage
    from musubi_tuner.training.trainer_base import NetworkTrainer
    from musubi_tuner.zimage import zimage_model, zimage_utils
    from musubi_tuner.zimage_train_network import ZImageNetworkTrainer

    ours_ = load_file(str(out / "ours.safetensors"))
    res = {}
    dit = zimage_model.ZImageTransformer2DModel(dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                                cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64],
                                                attn_mode="torch")  # fmt: skip
    info = dit.load_state_dict(load_file(str(out / "tiny_dit_diffusers.safetensors")), strict=True)
    print("musubi DiT strict load:", info)
    dit.eval()
    x, x16, ctx, mask, timesteps = ours_["x"], ours_["x16"], ours_["ctx"], ours_["mask"], ours_["timesteps_in"]
    accelerator = types.SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu"),
                                        autocast=contextlib.nullcontext)  # fmt: skip
    trainer = ZImageNetworkTrainer.__new__(ZImageNetworkTrainer)
    args = argparse.Namespace(split_attn=False, gradient_checkpointing=False)
    batch = {"llm_embed": [ctx[i, : int(mask[i].sum())] for i in range(B)]}
    with torch.no_grad():
        got = trainer.call_dit(args, accelerator, dit, x16, batch, torch.zeros_like(x16), x16, timesteps,
                               torch.float32)  # fmt: skip
    res["pred"] = got.pred
    trainer.num_timestep_buckets = None
    for kind in SAMPLINGS:
        args = argparse.Namespace(timestep_sampling=kind, discrete_flow_shift=2.0, sigmoid_scale=1.0, logit_mean=0.0,
                                  logit_std=1.0, mode_scale=1.29, weighting_scheme="none", min_timestep=None,
                                  max_timestep=None, preserve_distribution_shape=False)  # fmt: skip
        torch.manual_seed(7)  # our draws: generator seeded 7, noise first, then t (musubi: randn_like, then its law)
        noise = torch.randn_like(x)
        scheduler = None
        if kind == "sigma":
            from musubi_tuner.modules.scheduling_flow_match_discrete import FlowMatchDiscreteScheduler

            scheduler = FlowMatchDiscreteScheduler(shift=2.0, reverse=True, solver="euler")
        noisy, ts = NetworkTrainer.get_noisy_model_input_and_timesteps(trainer, args, noise, x, None, scheduler, "cpu",
                                                                       torch.float32)  # fmt: skip
        res[f"{kind}.noisy"], res[f"{kind}.timesteps"] = noisy, ts
        res[f"{kind}.target"] = x - noise  # zimage_train_network.call_dit's target
        res[f"{kind}.loss"] = torch.nn.functional.mse_loss(torch.zeros_like(x), noise - x).reshape(1)
    te = load_file(str(out / "tiny_te.safetensors"))
    cfg = Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                      rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=True)  # fmt: skip
    lm = Qwen3ForCausalLM(cfg).eval()
    lm.model.load_state_dict({k[len("model.") :]: v for k, v in te.items()}, strict=True)
    tok = Qwen2Tokenizer.from_pretrained(tokenizer_dir)
    embeds, emask = zimage_utils.get_text_embeds(tok, lm, CAPTIONS)
    res["embeds"] = torch.cat([embeds[i][emask[i]] for i in range(len(CAPTIONS))]).float()
    steps, sigmas = zimage_utils.get_timesteps_sigmas(8, 3.0)
    res["sigmas"] = sigmas
    save_file({k: v.contiguous().float() for k, v in res.items()}, str(out / "musubi.safetensors"))
    net = lora_zimage.create_arch_network(1.0, 32, 32, None, [], dit)
    (out / "musubi_lora_names.json").write_text(json.dumps(sorted(m.lora_name for m in net.unet_loras)))


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
        if key != "sigmas":  # the schedules differ by design (diffusers' levels): printed, not judged
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
    p.add_argument("--qwen3_tokenizer", default=os.path.expanduser("~/sdtrain-peer/sd-scripts/configs/qwen3_06b"),
                   help="a Qwen3 tokenizer folder with its chat template (vocab.json, merges.txt)")  # fmt: skip
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="zimage_vs_musubi_"))
    out.mkdir(parents=True, exist_ok=True)
    if a.side == "ours":
        ours(out)
        return 0
    if a.side == "musubi":
        musubi(out, a.qwen3_tokenizer)
        return 0
    ours(out)
    env = dict(os.environ, PYTHONPATH=f"{a.musubi_src}:{a.shims}")
    subprocess.run([a.musubi_python, __file__, "--side", "musubi", "--out", str(out), "--qwen3_tokenizer",
                    a.qwen3_tokenizer], check=True, env=env)  # fmt: skip
    return compare(out)


if __name__ == "__main__":
    sys.exit(main())
