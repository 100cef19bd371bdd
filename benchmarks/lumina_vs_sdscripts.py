#!/usr/bin/env python3
"""Lumina Image 2.0 against sd-scripts' own code on the same tiny files (by hand; CI has no sd-scripts).

    PYTHONPATH=. python benchmarks/lumina_vs_sdscripts.py [--work DIR] [--sd-scripts ~/sdtrain-peer/sd-scripts] \
        [--sds-python ~/sdtrain-peer/sdsvenv/bin/python]

Our side (this process) writes the tiny Lumina 2 files (Alpha-VLLM transformer, Gemma-2, AE, tokenizer), trains a
LoRA on them with sd-scripts' docs/lumina_train_network.md command line (Gemma's adapters too: no text cache) and
fixes the inputs; sd-scripts' side (``--side sds``, a subprocess in sd-scripts' venv with its checkout on the path,
``../shared/peer/helpers/sds_shims`` for torchvision) loads the same files with its own loaders
(``lumina_util.load_lumina_model`` with and without ``model.diffusion_model.``, ``load_gemma2``, ``load_ae``; their
hard-coded released configs replaced by the tiny widths, and each checked to leave no weight unloaded) and computes,
with its own functions:

1. the transformer's output on the same latents / τ / Gemma states / padded caption mask (our
   ``Lumina2Transformer2DModel`` loaded by ``LUMINA2.load`` from the Alpha-VLLM file); sd-scripts' vanilla RMSNorm
   gives the q/k norms eps 1e-6 where diffusers (and apex's FusedRMSNorm, which sd-scripts uses when installed) has
   1e-5: both are reported;
2. per ``--timestep_sampling`` (and ``--model_prediction_type`` raw / sigma_scaled, ``--ip_noise_gamma``): the noisy
   input, timesteps, σ, target and per-sample loss from ``lumina_train_util.get_noisy_model_input_and_timesteps`` /
   ``apply_model_prediction_type``, ``train_util.conditional_loss`` on the same seed (sd-scripts draws from torch's
   global generator, ours from a ``torch.Generator`` of the same seed);
3. our saved LoRA file loaded by sd-scripts' ``networks.lora_lumina.create_network_from_weights`` and applied: the
   transformer's and Gemma's outputs against ours with the file applied by ``networks.inject.network_from_file``;
4. the key map: sd-scripts' ``lumina_util.DIFFUSERS_TO_ALPHA_VLLM_MAP`` entries against ours, entry by entry (which
   of its diffusers names exist in ``Lumina2Transformer2DModel``, and whether our map gives its Alpha-VLLM name);
5. the upstream reader of our full fine-tune's file: diffusers' ``Lumina2Transformer2DModel.from_single_file`` on
   a file written by ``LUMINA2.save`` (what lumina_train.py writes) of a transformer at the released widths (its
   converter hard-codes the 2B q / k / v split, so the tiny model cannot be read by it) with 1 layer, bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "nextdit_shift", "flux_shift")
CASES = [(s, "raw", None) for s in SAMPLINGS] + [("shift", "sigma_scaled", None), ("nextdit_shift", "raw", 0.1),
                                                 ("sigma", "additive", None)]  # fmt: skip
SEED = 1234
SYSTEM = "You are an assistant."
CAPTIONS = ["a red cube", "x"]
SAMPLING = ((0.25, 1.0), (1.0, 0.0), (0.6, 1.0))  # (--cfg_trunc_ratio, --renorm_cfg) of lumina_minimal_inference


def large_logits_hidden(gemma, inp):
    """Gemma's hidden_states[-2] with every q_proj scaled by 300 (restored after): attention logits beyond the config's
    soft cap, where transformers' eager path (tanh cap) and sd-scripts' SDPA path (no cap) differ."""
    import torch

    layers = [layer.self_attn.q_proj for layer in gemma.layers]
    with torch.no_grad():
        for q in layers:
            q.weight.mul_(300)
        try:
            out = gemma(input_ids=inp["ids"], attention_mask=inp["ids_mask"], output_hidden_states=True)
            return out.hidden_states[-2]
        finally:
            for q in layers:
                q.weight.div_(300)


# ------------------------------------------------------------------------------------------------ sd-scripts' side
def sds_side(work: Path) -> None:
    import dataclasses
    import inspect
    import types

    import torch
    from transformers import Gemma2Config

    from library import flux_models, lumina_models, lumina_train_util, lumina_util, sd3_train_utils, train_util
    from networks import lora_lumina

    # sd-scripts' loaders build the released configs; the tiny widths go in where they are hard-coded
    cfg = json.loads((work / "tiny_config.json").read_text())
    t = cfg["transformer"]
    assert t["multiple_of"] == 256 and t["num_refiner_layers"] == 2  # what NextDiT_2B_GQA_... does not pass on
    tiny = lumina_models.LuminaParams(patch_size=t["patch_size"], in_channels=t["in_channels"], dim=t["hidden_size"],
                                      n_layers=t["num_layers"], n_heads=t["num_attention_heads"],
                                      n_kv_heads=t["num_kv_heads"], axes_dims=t["axes_dim_rope"],
                                      axes_lens=t["axes_lens"], qk_norm=True, cap_feat_dim=t["cap_feat_dim"])  # fmt: skip
    lumina_models.LuminaParams.get_2b_config = classmethod(lambda cls: tiny)
    assert "Gemma2Config(**GEMMA2_CONFIG)" in inspect.getsource(lumina_util.load_gemma2)
    lumina_util.Gemma2Config = lambda **kw: Gemma2Config(**dict(kw, **cfg["text_encoder"]))
    ae = cfg["ae"]
    for spec in flux_models.configs.values():
        spec.ae_params = dataclasses.replace(spec.ae_params, ch=ae["ch"], ch_mult=ae["ch_mult"],
                                             num_res_blocks=ae["num_res_blocks"], z_channels=ae["z_channels"])  # fmt: skip

    class GroupNorm(torch.nn.GroupNorm):  # the AE's literal num_groups=32
        def __init__(self, num_groups, num_channels, *a, **kw):
            super().__init__(ae["groups"], num_channels, *a, **kw)

    nn = types.ModuleType("torch.nn")
    nn.__dict__.update(torch.nn.__dict__)
    nn.GroupNorm = GroupNorm
    flux_models.nn = nn

    dit = lumina_util.load_lumina_model(str(work / "model.safetensors"), torch.float32, "cpu")
    prefixed = lumina_util.load_lumina_model(str(work / "prefixed.safetensors"), torch.float32, "cpu")
    gemma = lumina_util.load_gemma2(str(work / "gemma2.safetensors"), torch.float32, "cpu")
    autoencoder = lumina_util.load_ae(str(work / "ae.safetensors"), torch.float32, "cpu")
    for module in (dit, prefixed, gemma, autoencoder):
        assert not any(p.device.type == "meta" for p in module.parameters()), "a weight sd-scripts did not load"
        module.eval()
    inp = torch.load(work / "inputs.pt", weights_only=True)
    out: dict = {}
    with torch.no_grad():
        out["forward_eps1e-6"] = dit(inp["latents"], inp["tau"], inp["cap"], inp["mask"].to(torch.int32))
        norms = [m for model in (dit, prefixed) for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))]
        for m in norms:
            m.eps = 1e-5
        out["forward_eps1e-5"] = dit(inp["latents"], inp["tau"], inp["cap"], inp["mask"].to(torch.int32))
        out["forward_prefixed"] = prefixed(inp["latents"], inp["tau"], inp["cap"], inp["mask"].to(torch.int32))
        gem = gemma(input_ids=inp["ids"], attention_mask=inp["ids_mask"], output_hidden_states=True)
        out["gemma"] = gem.hidden_states[-2]
        out["ae_decode"] = autoencoder.decode(inp["latents"])
        out["gemma_large_logits"] = large_logits_hidden(gemma, inp)
        from library import strategy_lumina

        tokenize = strategy_lumina.LuminaTokenizeStrategy(SYSTEM, 32, tokenizer_cache_dir=str(work / "hub"))
        tokens = tokenize.tokenize(CAPTIONS)
        out["tokens"] = tokens
        out["negative_tokens"] = tokenize.tokenize(CAPTIONS, is_negative=True)
        out["text"] = strategy_lumina.LuminaTextEncodingStrategy().encode_tokens(tokenize, [gemma], tokens)
        scheduler = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0)
        for sampling, kind, gamma in CASES:
            args = argparse.Namespace(timestep_sampling=sampling, sigmoid_scale=1.0, discrete_flow_shift=6.0,
                                      weighting_scheme="uniform", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                      ip_noise_gamma=gamma, ip_noise_gamma_random_strength=False,
                                      model_prediction_type=kind)  # fmt: skip
            torch.manual_seed(SEED)
            latents = inp["latents"]
            noise = torch.randn_like(latents)
            noisy, timesteps, sigmas = lumina_train_util.get_noisy_model_input_and_timesteps(
                args, scheduler, latents, noise, "cpu", torch.float32
            )
            raw = dit(noisy, 1 - timesteps / 1000, inp["cap"], inp["mask"].to(torch.int32))
            pred, weighting = lumina_train_util.apply_model_prediction_type(args, raw, noisy, sigmas)
            target = latents - noise
            loss = train_util.conditional_loss(pred.float(), target.float(), "l2", "none", None)
            if weighting is not None:
                loss = loss * weighting
            out[f"{sampling}/{kind}/{gamma}"] = {"noisy": noisy, "timesteps": timesteps, "sigmas": sigmas.flatten(),
                                                 "target": target, "loss": loss.mean([1, 2, 3])}  # fmt: skip
        for m in norms:  # the sampling and LoRA comparisons with diffusers' eps
            m.eps = 1e-5
        for ratio, renorm in SAMPLING:
            sched = sd3_train_utils.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0)
            sched.set_timesteps(6, device="cpu")
            noise = torch.randn((1, 16, 8, 8), generator=torch.Generator("cpu").manual_seed(SEED))
            out[f"denoise/{ratio}/{renorm}"] = lumina_train_util.denoise(
                sched, dit, noise, inp["cap"][:1], inp["mask"][:1], inp["cap"][1:], inp["mask"][1:],
                sched.timesteps, 3.5, ratio, renorm)  # fmt: skip
        network, _ = lora_lumina.create_network_from_weights(1.0, str(work / "lora.safetensors"), None, [gemma], dit)
        network.apply_to([gemma], dit, apply_text_encoder=True, apply_unet=True)
        network.load_weights(str(work / "lora.safetensors"))
        out["lora_forward"] = dit(inp["latents"], inp["tau"], inp["cap"], inp["mask"].to(torch.int32))
        out["lora_gemma"] = gemma(input_ids=inp["ids"], attention_mask=inp["ids_mask"],
                                  output_hidden_states=True).hidden_states[-2]  # fmt: skip
        out["lora_modules"] = len(network.unet_loras) + len(network.text_encoder_loras)
        split, _ = lora_lumina.create_network_from_weights(1.0, str(work / "lora_split.safetensors"), None, [gemma],
                                                           prefixed)  # fmt: skip
        split.apply_to([gemma], prefixed, apply_text_encoder=False, apply_unet=True)
        split.load_weights(str(work / "lora_split.safetensors"))
        out["split_forward"] = prefixed(inp["latents"], inp["tau"], inp["cap"], inp["mask"].to(torch.int32))
        out["split_modules"] = len(split.unet_loras)
        out["map"] = dict(lumina_util.DIFFUSERS_TO_ALPHA_VLLM_MAP)
    torch.save(out, work / "sds_out.pt")


# ------------------------------------------------------------------------------------------------ our side
def prepare(work: Path) -> None:
    import torch

    import lumina_train_network
    from library.families.lumina.tiny import GEMMA, TRANSFORMER, build_tiny_lumina, write_tiny_files, write_tokenizer
    from library.run.demo import make_example_dataset

    parts = build_tiny_lumina(seed=0)
    write_tiny_files(parts, work)
    prefixed = write_tiny_files(parts, work / "prefixed", prefix="model.diffusion_model.")["model"]
    prefixed.replace(work / "prefixed.safetensors")
    vae = parts.vae.config
    ae = {
        "ch": vae.block_out_channels[0],
        "ch_mult": [c // vae.block_out_channels[0] for c in vae.block_out_channels],
        "num_res_blocks": vae.layers_per_block,
        "z_channels": vae.latent_channels,
        "groups": vae.norm_num_groups,
    }
    snapshot = work / "hub" / "models--google--gemma-2-2b" / "snapshots" / "0"  # the hub cache's layout
    write_tokenizer(snapshot)
    (work / "hub" / "models--google--gemma-2-2b" / "refs").mkdir(parents=True, exist_ok=True)
    (work / "hub" / "models--google--gemma-2-2b" / "refs" / "main").write_text("0")
    config = {"transformer": TRANSFORMER, "text_encoder": GEMMA, "ae": ae}
    (work / "tiny_config.json").write_text(json.dumps(config))
    data = make_example_dataset(work / "data")
    toml = work / "my_lumina_dataset_config.toml"
    toml.write_text(f'[general]\ncaption_extension = ".txt"\n[[datasets]]\nresolution = 64\nbatch_size = 2\n'
                    f'[[datasets.subsets]]\nimage_dir = "{(data / "10_sks shape").as_posix()}"\n')  # fmt: skip
    result = lumina_train_network.run([
        f"--pretrained_model_name_or_path={work / 'model.safetensors'}", f"--gemma2={work / 'gemma2.safetensors'}",
        f"--ae={work / 'ae.safetensors'}", f"--dataset_config={toml}", f"--output_dir={work}", "--output_name=lora",
        "--save_model_as=safetensors", "--network_module=networks.lora_lumina", "--network_dim=8",
        "--network_alpha=8", "--learning_rate=1e-2", "--optimizer_type=AdamW", "--lr_scheduler=constant",
        "--timestep_sampling=nextdit_shift", "--discrete_flow_shift=6.0", "--model_prediction_type=raw",
        "--system_prompt=You are an assistant designed to generate high-quality images based on user prompts.",
        "--max_train_epochs=1", "--mixed_precision=no", "--gradient_checkpointing", "--cache_latents",
        "--max_data_loader_n_workers=0", "--seed=1",
    ])  # fmt: skip
    print(f"LoRA trained: {result.output}")
    split = lumina_train_network.run([  # split_qkv, the embedders and type dims; the transformer only
        f"--pretrained_model_name_or_path={work / 'model.safetensors'}", f"--gemma2={work / 'gemma2.safetensors'}",
        f"--ae={work / 'ae.safetensors'}", f"--dataset_config={toml}", f"--output_dir={work}",
        "--output_name=lora_split", "--network_module=networks.lora_lumina", "--network_dim=4", "--network_alpha=2",
        "--network_args", "split_qkv=True", "embedder_dims=[4,4,4]", "mod_dim=2", "--network_train_unet_only",
        "--learning_rate=1e-2", "--max_train_epochs=1", "--cache_latents", "--cache_text_encoder_outputs",
        "--max_data_loader_n_workers=0", "--seed=2",
    ])  # fmt: skip
    print(f"split LoRA trained: {split.output}")
    g = torch.Generator().manual_seed(7)
    latents = torch.randn(2, 16, 8, 8, generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 9:] = 0  # a right-padded caption
    ids = torch.randint(4, 100, (2, 16), generator=g)
    ids[1, 9:] = 0
    torch.save({"latents": latents, "tau": torch.tensor([0.3, 0.8]), "cap": torch.randn(2, 16, 32, generator=g),
                "mask": mask, "ids": ids, "ids_mask": mask.clone()}, work / "inputs.pt")  # fmt: skip


def maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def ours_side(work: Path) -> dict:
    import dataclasses

    import torch

    from library.families.base import Cond
    from library.families.lumina import LUMINA2
    from library.families.lumina import keys as K
    from library.families.lumina.objective import LuminaFlowConfig, LuminaFlowObjective
    from library.families.lumina.options import LuminaOptions
    from library.objectives.losses import LossConfig
    from networks.inject import network_from_file

    sds = torch.load(work / "sds_out.pt", weights_only=False)
    inp = torch.load(work / "inputs.pt", weights_only=True)
    opts = LuminaOptions(gemma2=str(work / "gemma2.safetensors"), ae=str(work / "ae.safetensors"))
    parts = LUMINA2.load(work / "model.safetensors", options=opts)
    dit, gemma = parts.denoiser, parts.text_encoders[0]
    rows: dict = {}
    with torch.no_grad():
        ours = dit(hidden_states=inp["latents"], timestep=inp["tau"], encoder_hidden_states=inp["cap"],
                   encoder_attention_mask=inp["mask"].to(torch.int32), return_dict=False)[0]  # fmt: skip
        rows["forward vs NextDiT (q/k norm eps 1e-6, sd-scripts without apex)"] = maxdiff(ours, sds["forward_eps1e-6"])
        rows["forward vs NextDiT (q/k norm eps 1e-5, diffusers / apex)"] = maxdiff(ours, sds["forward_eps1e-5"])
        g_ours = gemma(input_ids=inp["ids"], attention_mask=inp["ids_mask"], output_hidden_states=True)
        rows["forward, model.diffusion_model. file through sd-scripts' loader"] = maxdiff(ours, sds["forward_prefixed"])
        rows["Gemma hidden_states[-2]"] = maxdiff(g_ours.hidden_states[-2], sds["gemma"])
        from library.families.lumina.model import load_gemma_tokenizer

        hub = dataclasses.replace(parts, tokenizers=[load_gemma_tokenizer([], str(work / "hub"))])
        hub.options = dataclasses.replace(parts.options, system_prompt=SYSTEM, gemma2_max_token_length=32)
        ids, mask = LUMINA2.tokenize(hub, CAPTIONS)
        neg_ids, neg_mask = LUMINA2.tokenize(hub, CAPTIONS, negative=True)
        same = all(torch.equal(a, b) for a, b in zip((ids, mask, neg_ids, neg_mask),
                                                      (*sds["tokens"], *sds["negative_tokens"])))  # fmt: skip
        rows[
            f"prompt rule: ids and masks (system prompt; negatives without; --tokenizer_cache_dir hub layout) equal: "
            f"{same}"
        ] = float(not same)
        rows["prompt conditioning (LuminaTextEncodingStrategy.encode_tokens vs encode_tokens)"] = maxdiff(
            LUMINA2.encode_tokens(hub, [ids, mask]).hidden_states, sds["text"][0])  # fmt: skip
        rows["Gemma hidden_states[-2], q_proj x 300 (attention logits past the soft cap 50)"] = maxdiff(
            large_logits_hidden(gemma, inp), sds["gemma_large_logits"])  # fmt: skip
        decoded = LUMINA2.decode_latents(parts, inp["latents"])
        rows["AE decode (ours clamped to [-1, 1], as sd-scripts' images)"] = maxdiff(
            decoded, sds["ae_decode"].clamp(-1, 1)
        )
        cond = Cond(inp["cap"], None, inp["mask"])
        for sampling, kind, gamma in CASES:
            cfg = LuminaFlowConfig(timestep_sampling=sampling, model_prediction_type=kind, ip_noise_gamma=gamma)
            objective = LuminaFlowObjective(cfg, LossConfig())
            ex = objective.example(inp["latents"], torch.Generator().manual_seed(SEED))
            out = LUMINA2.predict(dit, ex.noisy, ex.timesteps, cond)
            loss = objective.loss_per_sample(objective.prediction(out, ex), ex)
            ref = sds[f"{sampling}/{kind}/{gamma}"]
            name = f"{sampling} {kind}" + (f" ip_noise_gamma={gamma}" if gamma else "")
            rows[f"{name}: noisy / timesteps / sigmas / target"] = max(
                maxdiff(ex.noisy, ref["noisy"]), maxdiff(ex.timesteps, ref["timesteps"]),
                maxdiff(ex.sigmas, ref["sigmas"]), maxdiff(ex.target, ref["target"]))  # fmt: skip
            rows[f"{name}: loss per sample (ours {loss.tolist()})"] = maxdiff(loss, ref["loss"])
        for m in [m for n, m in dit.named_modules() if n.endswith(("norm_q", "norm_k"))]:
            assert abs(m.eps - 1e-5) < 1e-12
        from lumina_minimal_inference import Request, lumina_latents

        pos, neg = Cond(inp["cap"][:1], None, inp["mask"][:1]), Cond(inp["cap"][1:], None, inp["mask"][1:])
        for ratio, renorm in SAMPLING:
            request = Request("", "", 64, 64, 6, 3.5, ratio, renorm)
            x = lumina_latents(LUMINA2, parts, pos, neg, request, 6.0, torch.Generator("cpu").manual_seed(SEED))
            rows[
                f"lumina_minimal_inference sampling, 6 steps, CFG 3.5, --cfg_trunc_ratio {ratio} --renorm_cfg "
                f"{renorm} (vs lumina_train_util.denoise)"
            ] = maxdiff(x, sds[f"denoise/{ratio}/{renorm}"])
        network = network_from_file(work / "lora.safetensors", LUMINA2.adapter_roots(parts))
        with_lora = dit(hidden_states=inp["latents"], timestep=inp["tau"], encoder_hidden_states=inp["cap"],
                        encoder_attention_mask=inp["mask"].to(torch.int32), return_dict=False)[0]  # fmt: skip
        rows[
            f"LoRA applied: forward ({len(network)} modules ours, {sds['lora_modules']} sd-scripts; Δ by the LoRA "
            f"{maxdiff(with_lora, ours):.3g})"
        ] = maxdiff(with_lora, sds["lora_forward"])
        fresh = LUMINA2.load(work / "model.safetensors", options=opts)
        split = network_from_file(work / "lora_split.safetensors", LUMINA2.adapter_roots(fresh))
        split_out = fresh.denoiser(hidden_states=inp["latents"], timestep=inp["tau"], encoder_hidden_states=inp["cap"],
                                   encoder_attention_mask=inp["mask"].to(torch.int32), return_dict=False)[0]  # fmt: skip
        rows[
            f"split_qkv + embedder_dims + mod_dim LoRA ({len(split)} modules ours, {sds['split_modules']} "
            f"sd-scripts; Δ by the LoRA {maxdiff(split_out, ours):.3g})"
        ] = maxdiff(split_out, sds["split_forward"])
        g_lora = gemma(input_ids=inp["ids"], attention_mask=inp["ids_mask"], output_hidden_states=True)
        rows[f"LoRA applied: Gemma (Δ by the LoRA {maxdiff(g_lora.hidden_states[-2], g_ours.hidden_states[-2]):.3g})"
             ] = maxdiff(g_lora.hidden_states[-2], sds["lora_gemma"])  # fmt: skip
    # the key map, entry by entry
    from accelerate import init_empty_weights

    from library.families.lumina.model import released, transformer_factory

    with init_empty_weights():
        real = transformer_factory(released()["transformer"])()
    names = set(real.state_dict())
    exists = same = 0
    for diff_key, alpha_key in sds["map"].items():
        key, akey = diff_key.replace("().", "0."), alpha_key.replace("().", "0.")
        if key in names:
            exists += 1
            module, _, param = key.rpartition(".")
            try:
                same += f"{K.diffusers_module_to_alpha(module)}.{param}" == akey
            except KeyError:
                pass
    rows[
        f"DIFFUSERS_TO_ALPHA_VLLM_MAP: {len(sds['map'])} entries, {exists} name a Lumina2Transformer2DModel key, "
        f"ours agrees on {same}"
    ] = float(exists - same)
    rows.update(single_file_check(work))
    return rows


def single_file_check(work: Path) -> dict:
    import torch
    from diffusers import Lumina2Transformer2DModel

    from library.families.base import Parts
    from library.families.lumina import LUMINA2
    from library.families.lumina.model import released, transformer_factory

    torch.manual_seed(0)
    model = transformer_factory(dict(released()["transformer"], num_layers=1))().to(torch.bfloat16)
    path = LUMINA2.save(Parts(model, None, [], [], dict(released()["scheduler"]), "lumina2"), work / "ft.safetensors")
    model.save_config(work / "ft_config" / "transformer")
    theirs = Lumina2Transformer2DModel.from_single_file(str(path), config=str(work / "ft_config"),
                                                        subfolder="transformer", torch_dtype=torch.bfloat16)  # fmt: skip
    a, b = model.state_dict(), theirs.state_dict()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a) if a.keys() == b.keys() else float("inf")
    return {f"diffusers from_single_file of our saved file (released widths, 1 layer; {len(a)} tensors)": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("ours", "sds"), default="ours")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lumina_vs_sdscripts"))
    parser.add_argument("--sd-scripts", type=Path, default=Path.home() / "sdtrain-peer" / "sd-scripts")
    parser.add_argument("--sds-python", type=Path, default=Path.home() / "sdtrain-peer" / "sdsvenv" / "bin" / "python")
    a = parser.parse_args()
    if a.side == "sds":
        sds_side(a.work)
        return
    a.work.mkdir(parents=True, exist_ok=True)
    prepare(a.work)
    shims = HERE.parent.parent / "shared" / "peer" / "helpers" / "sds_shims"
    shims = shims if shims.is_dir() else Path("/work/shared/peer/helpers/sds_shims")
    env = dict(os.environ, PYTHONPATH=f"{a.sd_scripts}{os.pathsep}{shims}", HF_HUB_OFFLINE="1")
    subprocess.run([str(a.sds_python), str(Path(__file__).resolve()), "--side", "sds", "--work", str(a.work)],
                   cwd=a.sd_scripts, env=env, check=True)  # fmt: skip
    rows = ours_side(a.work)
    width = max(len(k) for k in rows)
    print(f"\n{'check':<{width}}  max |ours - sd-scripts|")
    for k, v in rows.items():
        print(f"{k:<{width}}  {v:.3g}")


if __name__ == "__main__":
    sys.exit(main())
