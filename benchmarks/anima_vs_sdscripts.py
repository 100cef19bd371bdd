"""Anima: sdtrain against sd-scripts' own code on the same tiny files (by hand; CI has no sd-scripts).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/anima_vs_sdscripts.py \
        [--sd-scripts ~/sdtrain-peer/sd-scripts] [--sds-python ~/sdtrain-peer/sdsvenv/bin/python]

Our side writes the tiny Anima files (``AnimaTiny.write_files``: the DiT under ``net.``, Qwen3 under ``model.``, the
VAE in ComfyUI's names), a random LoRA in ``networks.lora_anima``'s names and the shared inputs, then runs this file
again with ``--sds-side DIR`` under sd-scripts' venv (cwd the sd-scripts checkout, ``library`` = sd-scripts'). That
side reads the files with sd-scripts' loaders (``anima_utils.load_qwen3_text_encoder``, ``anima_models.Anima`` +
``LLMAdapter`` with ``load_state_dict(strict=True)`` after stripping ``net.``, ``qwen_image_autoencoder_kl.load_vae``
with its ComfyUI key table), with their hard-coded released configs patched to the tiny widths (nothing else), and
computes: the tokenizers' ids, Qwen3's states (``AnimaTextEncodingStrategy``), the DiT forward with the adapter,
the VAE latents and decode, the noisy input / timesteps / target / weighted loss of ``get_noise_pred_and_target``'s
functions (``flux_train_utils.get_noisy_model_input_and_timesteps``, ``compute_loss_weighting_for_anima``) for each
``--timestep_sampling`` on the same seeds, and the DiT forward with our LoRA file applied by sd-scripts'
``lora_anima.create_network_from_weights``. Our side computes the same with our code and prints the differences.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CAPTIONS = ["a cat sitting on a red chair, 1girl, masterpiece", ""]
LENGTH = 24
SAMPLINGS = [("sigmoid", "uniform"), ("uniform", "sigma_sqrt"), ("shift", "cosmap"), ("flux_shift", "uniform"),
             ("sigma", "logit_normal"), ("sigma", "mode")]  # fmt: skip
FLOW = dict(sigmoid_scale=1.3, discrete_flow_shift=2.0, logit_mean=0.1, logit_std=0.9, mode_scale=1.29)


# ---------------------------------------------------------------------------------------------------- sd-scripts
def sds_side(folder: Path) -> None:  # runs in sd-scripts' venv, cwd = the sd-scripts checkout
    import types

    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, os.getcwd())
    import torchvision.transforms as T  # the peer kit's shim: add the nearest resize Anima's forward calls

    class _Mode:
        NEAREST = "nearest"

    T.InterpolationMode = _Mode
    T.functional.resize = lambda x, size, interpolation=None: F.interpolate(x, size=list(size), mode="nearest")

    cfg = json.loads((folder / "config.json").read_text())
    files = cfg["files"]
    inputs = load_file(str(folder / "inputs.safetensors"))
    out: dict[str, torch.Tensor] = {}

    # tokenizers and Qwen3 (config patched to the tiny one: sd-scripts reads configs/qwen3_06b for a single file)
    import transformers

    from library import anima_utils, strategy_anima

    tiny_qwen3 = transformers.Qwen3Config(**cfg["qwen3"])
    transformers.Qwen3Config.from_pretrained = classmethod(lambda cls, *a, **k: tiny_qwen3)
    tok = strategy_anima.AnimaTokenizeStrategy(qwen3_path=files["qwen3"], qwen3_max_length=LENGTH,
                                               t5_max_length=LENGTH)  # fmt: skip
    tokens = tok.tokenize(CAPTIONS)
    for name, t in zip(("qwen3_ids", "qwen3_mask", "t5_ids", "t5_mask"), tokens):
        out[name] = t.long()
    qwen3, _ = anima_utils.load_qwen3_text_encoder(files["qwen3"], dtype=torch.float32, device="cpu")
    with torch.no_grad():
        embeds, mask, t5_ids, t5_mask = strategy_anima.AnimaTextEncodingStrategy().encode_tokens(tok, [qwen3], tokens)
    out["prompt_embeds"] = embeds

    # the DiT with the adapter (Anima's hard-coded adapter dims -> the tiny ones)
    from library import anima_models

    dit_cfg = dict(cfg["dit"], use_llm_adapter=False, attn_mode="torch", split_attn=False)
    dit = anima_models.Anima(**dit_cfg)
    dit.llm_adapter = anima_models.LLMAdapter(**cfg["adapter"])
    dit.use_llm_adapter = True
    sd = {k[len("net.") :] if k.startswith("net.") else k: v for k, v in load_file(files["dit"]).items()}
    dit.load_state_dict(sd, strict=True)
    dit.eval()
    x, t = inputs["x"], inputs["t"]
    padding = torch.zeros(x.shape[0], 1, x.shape[-2], x.shape[-1])
    with torch.no_grad():
        out["dit"] = dit(x.unsqueeze(2), t, inputs["prompt_embeds"], padding_mask=padding,
                         target_input_ids=inputs["t5_ids"].long(), target_attention_mask=inputs["t5_mask"].long(),
                         source_attention_mask=inputs["qwen3_mask"].long()).squeeze(2)  # fmt: skip

    # the LoRA file on sd-scripts' network
    from networks import lora_anima

    network, weights = lora_anima.create_network_from_weights(1.0, files["lora"], None, [qwen3], dit)
    network.apply_to([qwen3], dit, apply_text_encoder=False, apply_unet=True)
    info = network.load_state_dict(weights, strict=False)
    out["lora_missing"] = torch.tensor(len(info.missing_keys))
    with torch.no_grad():
        out["dit_lora"] = dit(x.unsqueeze(2), t, inputs["prompt_embeds"], padding_mask=padding,
                              target_input_ids=inputs["t5_ids"].long(), target_attention_mask=inputs["t5_mask"].long(),
                              source_attention_mask=inputs["qwen3_mask"].long()).squeeze(2)  # fmt: skip

    # the VAE (its released config -> the tiny one; ComfyUI names through sd-scripts' own table)
    from library import qwen_image_autoencoder_kl as qvae

    released = cfg["vae_released_comfy"]  # our ComfyUI names of the released VAE's keys, through sd-scripts' table
    converted = qvae.convert_comfyui_state_dict({k: torch.zeros(1) for k in released})
    (folder / "vae_table.json").write_text(json.dumps({"ours": released, "theirs": list(converted)}))
    qvae.json = types.SimpleNamespace(loads=lambda s: cfg["vae"])
    vae = qvae.load_vae(files["vae"], device="cpu")
    vae.eval()
    with torch.no_grad():
        out["latents"] = vae.encode_pixels_to_latents(inputs["pixels"])
        out["decoded"] = vae.decode_to_pixels(inputs["latents_in"])
    # --vae_chunk_size / --vae_disable_cache (sd-scripts' own VAE options): the same values as the plain VAE?
    for name, kw in (("chunk16", dict(spatial_chunk_size=16)), ("nocache", dict(disable_cache=True))):
        other = qvae.load_vae(files["vae"], device="cpu", **kw).eval()
        with torch.no_grad():
            out[f"latents_{name}"] = other.encode_pixels_to_latents(inputs["pixels"])
            out[f"decoded_{name}"] = other.decode_to_pixels(inputs["latents_in"])

    # the objective on the same draws
    from library import anima_train_utils, flux_train_utils, sd3_train_utils

    latents, pred = inputs["obj_latents"], inputs["obj_pred"]
    for i, (sampling, scheme) in enumerate(SAMPLINGS + [("sigmoid", "uniform")]):
        ip = 0.1 if i == len(SAMPLINGS) else None
        args = argparse.Namespace(timestep_sampling=sampling, weighting_scheme=scheme, ip_noise_gamma=ip,
                                  ip_noise_gamma_random_strength=ip is not None, **FLOW)  # fmt: skip
        scheduler = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                                    shift=args.discrete_flow_shift)  # fmt: skip
        torch.manual_seed(100 + i)
        noise = torch.randn_like(latents)
        noisy, timesteps, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(
            args, scheduler, latents, noise, "cpu", torch.float32
        )
        target = noise - latents
        weighting = anima_train_utils.compute_loss_weighting_for_anima(args.weighting_scheme, sigmas)
        loss = (F.mse_loss(pred.float(), target.float(), reduction="none") * weighting).mean([1, 2, 3])
        out[f"obj{i}_noisy"], out[f"obj{i}_t"] = noisy, timesteps / 1000.0
        out[f"obj{i}_target"], out[f"obj{i}_loss"] = target, loss
    save_file({k: v.contiguous() for k, v in out.items()}, str(folder / "sds.safetensors"))


# ---------------------------------------------------------------------------------------------------- sdtrain
def our_side(folder: Path, sd_scripts: Path, sds_python: str) -> int:
    from safetensors.torch import load_file, save_file

    from library.families.anima import ANIMA
    from library.families.anima import tiny as tiny_mod
    from library.families.anima.objective import AnimaFlowConfig, AnimaFlowObjective
    from library.families.anima.options import AnimaOptions
    from library.objectives.losses import LossConfig
    from networks.inject import network_from_file

    parts = ANIMA.tiny.build(seed=3)
    files = {k: str(v) for k, v in ANIMA.tiny.write_files(parts, folder, "tiny").items()}
    options = AnimaOptions(qwen3=files["qwen3"], qwen3_max_token_length=LENGTH, t5_max_token_length=LENGTH)
    loaded = ANIMA.load(files["dit"], vae=files["vae"], options=options)

    # a LoRA in networks.lora_anima's names with random weights (every DiT block module and the adapter's)
    lora = {}
    g = torch.Generator().manual_seed(5)
    for name, module in loaded.denoiser.named_modules():
        if isinstance(module, torch.nn.Linear) and (".attn" in name or ".ff." in name):
            from library.families.anima.keys import module_to_sd

            kohya = "lora_unet_" + module_to_sd(name).replace(".", "_")
            if "modulation" in kohya or "embedder" in kohya or "final_layer" in kohya:
                continue
            lora[kohya + ".lora_down.weight"] = 0.3 * torch.randn(4, module.in_features, generator=g)
            lora[kohya + ".lora_up.weight"] = 0.3 * torch.randn(module.out_features, 4, generator=g)
            lora[kohya + ".alpha"] = torch.tensor(2.0)
    files["lora"] = str(folder / "lora.safetensors")
    save_file(lora, files["lora"], {"ss_network_module": "networks.lora_anima"})

    tokens = ANIMA.tokenize(loaded, CAPTIONS)
    with torch.no_grad():
        cond = ANIMA.encode_tokens(loaded, tokens)
    torch.manual_seed(7)
    x = torch.randn(2, 16, 8, 12)
    t = torch.tensor([0.3, 0.85])
    pixels = torch.rand(1, 3, 64, 48) * 2 - 1
    latents_in = torch.randn(1, 16, 8, 6)
    obj_latents, obj_pred = torch.randn(3, 16, 8, 8), torch.randn(3, 16, 8, 8)
    inputs = {"x": x, "t": t, "prompt_embeds": cond.hidden_states, "qwen3_mask": tokens[1], "t5_ids": tokens[2],
              "t5_mask": tokens[3], "pixels": pixels, "latents_in": latents_in, "obj_latents": obj_latents,
              "obj_pred": obj_pred}  # fmt: skip
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(folder / "inputs.safetensors"))
    c = loaded.denoiser.config
    dit_cfg = dict(max_img_h=512, max_img_w=512, max_frames=128, in_channels=c.in_channels, out_channels=c.out_channels,
                   patch_spatial=2, patch_temporal=1, concat_padding_mask=True,
                   model_channels=c.num_attention_heads * c.attention_head_dim, num_blocks=c.num_layers,
                   num_heads=c.num_attention_heads, mlp_ratio=c.mlp_ratio, crossattn_emb_channels=c.text_embed_dim,
                   pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop", use_adaln_lora=True,
                   adaln_lora_dim=c.adaln_lora_dim, extra_per_block_abs_pos_emb=False,
                   rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0,
                   rope_enable_fps_modulation=False)  # fmt: skip
    a = c.text_conditioner
    adapter_cfg = dict(source_dim=a["source_dim"], target_dim=a["target_dim"], model_dim=a["model_dim"],
                       num_layers=a["num_layers"], num_heads=a["num_attention_heads"], self_attn=True)  # fmt: skip
    from accelerate import init_empty_weights

    from library.families.autoencoders import qwen_image
    from library.families.autoencoders.qwen_image import TINY

    with init_empty_weights():
        released_keys = list(qwen_image.factory(qwen_image.RELEASED)().state_dict())
    comfy = [qwen_image.diffusers_to_comfy_name(k, 2) for k in released_keys]
    config = {"files": files, "qwen3": tiny_mod.TINY_QWEN3, "dit": dit_cfg, "adapter": adapter_cfg,
              "vae": dict(TINY, input_channels=3), "vae_released_comfy": comfy}  # fmt: skip
    config["vae"].pop("input_channels")
    (folder / "config.json").write_text(json.dumps(config))

    env = dict(os.environ, PYTHONPATH=f"{sd_scripts}:/work/shared/peer/helpers/sds_shims", HF_HUB_OFFLINE="1")
    run = subprocess.run([sds_python, os.path.abspath(__file__), "--sds-side", str(folder)], cwd=sd_scripts, env=env,
                         capture_output=True, text=True)  # fmt: skip
    if run.returncode != 0:
        print(run.stdout[-3000:], run.stderr[-6000:])
        return run.returncode
    sds = load_file(str(folder / "sds.safetensors"))
    table = json.loads((folder / "vae_table.json").read_text())
    same = sum(a == b for a, b in zip(released_keys, table["theirs"]))
    print(f"released Qwen-Image VAE: {same} of {len(released_keys)} ComfyUI keys map to our diffusers name by "
          "sd-scripts' convert_comfyui_state_dict table")  # fmt: skip

    rows = []

    def row(what: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        ours, theirs = ours.float(), theirs.float()
        same_shape = tuple(ours.shape) == tuple(theirs.shape)
        diff = (ours - theirs).abs().max().item() if same_shape else float("nan")
        scale = theirs.abs().max().item()
        rows.append((what, tuple(theirs.shape), diff, scale))

    for i, name in enumerate(("qwen3_ids", "qwen3_mask", "t5_ids", "t5_mask")):
        row(f"tokens {name}", tokens[i], sds[name])
    row("Qwen3 states (prompt_embeds)", cond.hidden_states, sds["prompt_embeds"])
    with torch.no_grad():
        ours_dit = ANIMA.predict(loaded.denoiser, x, t * 1000, cond)
    row("DiT + LLM adapter forward", ours_dit, sds["dit"])
    with torch.no_grad():
        row("VAE latents (encode_pixels_to_latents)", ANIMA.encode_latents(loaded, pixels), sds["latents"])
        row("VAE decode (decode_to_pixels)", ANIMA.decode_latents(loaded, latents_in), sds["decoded"])
    for name, flag in (("chunk16", "--vae_chunk_size 16"), ("nocache", "--vae_disable_cache")):
        row(f"sd-scripts' VAE with {flag} vs ours: latents", ANIMA.encode_latents(loaded, pixels),
            sds[f"latents_{name}"])  # fmt: skip
        row(f"sd-scripts' VAE with {flag} vs ours: decode", ANIMA.decode_latents(loaded, latents_in),
            sds[f"decoded_{name}"])  # fmt: skip
    roots = ANIMA.adapter_roots(loaded)
    network = network_from_file(files["lora"], roots)
    network.merge_into_base()
    with torch.no_grad():
        row(f"DiT forward with our LoRA file (sd-scripts missing keys {int(sds['lora_missing'])})",
            ANIMA.predict(loaded.denoiser, x, t * 1000, cond), sds["dit_lora"])  # fmt: skip
    for i, (sampling, scheme) in enumerate(SAMPLINGS + [("sigmoid", "uniform")]):
        ip = 0.1 if i == len(SAMPLINGS) else None
        cfg = AnimaFlowConfig(timestep_sampling=sampling, weighting_scheme=scheme, ip_noise_gamma=ip,
                              ip_noise_gamma_random_strength=ip is not None, **FLOW)  # fmt: skip
        objective = AnimaFlowObjective(cfg, LossConfig())
        ex = objective.example(obj_latents, torch.Generator().manual_seed(100 + i))
        label = f"{sampling}/{scheme}" + (" +ip_noise_gamma" if ip else "")
        row(f"objective {label}: noisy input", ex.noisy, sds[f"obj{i}_noisy"])
        row(f"objective {label}: model t (σ)", ex.timesteps / 1000, sds[f"obj{i}_t"])
        row(f"objective {label}: target", ex.target, sds[f"obj{i}_target"])
        row(f"objective {label}: loss per sample", objective.loss_per_sample(obj_pred, ex), sds[f"obj{i}_loss"])
    width = max(len(r[0]) for r in rows)
    print(f"{'check':{width}}  {'shape':>18}  {'max |ours - sd-scripts|':>24}  {'max |sd-scripts|':>16}")
    for what, shape, diff, scale in rows:
        print(f"{what:{width}}  {str(shape):>18}  {diff:24.3e}  {scale:16.3e}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sds-side", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sd-scripts", type=Path, default=Path("~/sdtrain-peer/sd-scripts").expanduser())
    parser.add_argument("--sds-python", default=str(Path("~/sdtrain-peer/sdsvenv/bin/python").expanduser()))
    args = parser.parse_args()
    if args.sds_side is not None:
        sds_side(args.sds_side)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        return our_side(Path(tmp), args.sd_scripts, args.sds_python)


if __name__ == "__main__":
    sys.exit(main())
