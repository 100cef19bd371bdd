"""By hand (CI has no sd-scripts): sdtrain's HunyuanImage 2.1 pieces against sd-scripts v0.10.1's own code.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 /work/main/.venv/bin/python benchmarks/hunyuan_image_vs_sdscripts.py \
        --sd_scripts ~/sdtrain-peer/sd-scripts --sds_python ~/sdtrain-peer/sdsvenv/bin/python

1. Transformer: tiny random weights in Tencent's layout; sd-scripts' ``HYImageDiffusionTransformer`` (its __init__'s
   size literals replaced by ``tiny.SDSCRIPTS_CONSTANTS``, loaded ``strict=True``) runs in sd-scripts' venv; diffusers'
   ``HunyuanImageTransformer2DModel`` gets the same weights through ``keys.tencent_to_diffusers`` here. Outputs on the
   same inputs (with padded text and byT5 masks, int64 timesteps as sd-scripts passes) are compared, and the key
   round trip Tencent -> diffusers -> Tencent is checked on every key.
2. Objective: noisy input, timesteps, target and loss of ``objective.HunyuanFlowObjective`` against sd-scripts'
   ``flux_train_utils.get_noisy_model_input_and_timesteps`` + ``apply_model_prediction_type`` on the same draws, for
   every ``--timestep_sampling``.
3. Sampler (``hunyuan_image_minimal_inference.py``, training samples): sd-scripts' ``get_timesteps_sigmas``,
   ``AdaptiveProjectedGuidance`` (built as its ``generate_body`` builds them), ``apply_classifier_free_guidance`` and
   ``step`` in a float32 loop over a stand-in model (v = a·x + b + (t / 1000)·c, t the truncated integer timestep)
   against ``flow_generate.sampling_sigmas`` + ``guidance.with_apg`` + ``flow.sample_euler``, for a prompt with and
   without quoted text and with both guidance rescales; and the guided output of every step of a fixed sequence of
   predictions.
The sd-scripts side runs as a subprocess (``--side sdscripts``) reading and writing a temporary folder.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SAMPLINGS = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
GLYPH_PROMPT = 'a poster reading "<color-3>SALE <en-font-7>50%" and “café”'  # the added tokens, a non-ASCII text


def inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    b = 2
    text_mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8], dtype=torch.long)
    byt5_mask = torch.tensor([[1] * 3 + [0] * 3, [0] * 6], dtype=torch.long)
    return {
        "x": torch.randn(b, 4, 6, 4, generator=generator),
        "t": torch.tensor([250, 917], dtype=torch.int64),
        "text": torch.randn(b, 8, 16, generator=generator),
        "text_mask": text_mask,
        "byt5": torch.randn(b, 6, 12, generator=generator),
        "byt5_mask": byt5_mask,
        "pixels": torch.rand(b, 3, 64, 96, generator=generator) * 2 - 1,
        "latents": torch.randn(b, 4, 2, 3, generator=generator),
        "sampler_noise": torch.randn(1, 4, 3, 5, generator=generator),
        **{
            f"{k}{i}": torch.randn(1, 4, 3, 5, generator=generator) * (0.3 if k == "a" else 1.0)
            for k in "abc"
            for i in (1, 2)
        },  # fmt: skip
        "seq_cond": torch.randn(12, 4, 3, 5, generator=generator),
        "seq_uncond": torch.randn(12, 4, 3, 5, generator=generator),
    }


# ------------------------------------------------------------------------------------------------ sd-scripts side
def sdscripts_side(folder: Path, sd_scripts: Path) -> None:
    sys.path.insert(0, str(sd_scripts))
    import json

    from safetensors.torch import load_file, save_file

    from library import hunyuan_image_models as hm

    ns = json.loads((folder / "constants.json").read_text())  # tiny.py's (sdtrain needs a newer diffusers)
    src = inspect.getsource(hm.HYImageDiffusionTransformer.__init__)
    for old, new in ns["SDSCRIPTS_CONSTANTS"].items():
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    src = src.replace("super().__init__()", "nn.Module.__init__(self)")  # no __class__ cell outside the class body
    src = "\n".join(line[4:] for line in src.splitlines())
    exec(compile(src, "tiny_init", "exec"), hm.__dict__)
    hm.HYImageDiffusionTransformer.__init__ = hm.__dict__["__init__"]
    model = hm.HYImageDiffusionTransformer(attn_mode="torch").eval()
    state = load_file(str(folder / "tencent.safetensors"))
    model.load_state_dict(state, strict=True)
    x = load_file(str(folder / "inputs.safetensors"))
    with torch.no_grad():
        out = model(x["x"], x["t"], x["text"], x["text_mask"], x["byt5"], x["byt5_mask"])
    results = {"dit_out": out.contiguous()}

    from library import hunyuan_image_vae as hv

    src = inspect.getsource(hv.HunyuanVAE2D.__init__)
    for old, new in ns["SDSCRIPTS_VAE_CONSTANTS"].items():
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    src = src.replace("super().__init__()", "nn.Module.__init__(self)")
    src = "\n".join(line[4:] for line in src.splitlines())
    exec(compile(src, "tiny_vae_init", "exec"), hv.__dict__)
    hv.HunyuanVAE2D.__init__ = hv.__dict__["__init__"]
    vae = hv.HunyuanVAE2D().eval()
    vae.load_state_dict(load_file(str(folder / "vae.safetensors")), strict=True)
    with torch.no_grad():
        posterior = vae.encode(x["pixels"])
        results["vae_mean"] = posterior.mean.contiguous()
        results["vae_decoded"] = vae.decode(x["latents"]).contiguous()

    from library import hunyuan_image_text_encoder as te

    src = inspect.getsource(te.load_byt5)
    for old, new in ns["SDSCRIPTS_BYT5_CONSTANTS"].items():
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    exec(compile(src, "tiny_load_byt5", "exec"), te.__dict__)
    from transformers import ByT5Tokenizer

    te.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: ByT5Tokenizer())  # google/byt5-small: no files
    tokenizer, byt5 = te.load_byt5(str(folder / "byt5.safetensors"), torch.float32, "cpu")
    ids, mask = te.get_byt5_text_tokens(tokenizer, ns["GLYPH_PROMPT"])
    results.update(
        {"byt5_ids": ids, "byt5_mask": mask, "byt5_out": te.get_byt5_prompt_embeds_from_tokens(byt5, ids, mask)[1]}
    )

    from library import flux_train_utils

    lat = x["x"]
    for sampling in SAMPLINGS:
        args = argparse.Namespace(timestep_sampling=sampling, sigmoid_scale=1.0, discrete_flow_shift=5.0,
                                  weighting_scheme="uniform", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                  ip_noise_gamma=None, ip_noise_gamma_random_strength=False,
                                  model_prediction_type="raw")  # fmt: skip
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
        torch.manual_seed(1234)
        noise = torch.randn_like(lat)
        noisy, _, sigmas = flux_train_utils.get_noisy_model_input_and_timesteps(args, scheduler, lat, noise, "cpu",
                                                                                torch.float32)  # fmt: skip
        timesteps = (sigmas[:, 0, 0, 0] * 1000).to(torch.int64)
        pred = x["x"] * 0.5 + 0.1  # a stand-in model output
        pred, _ = flux_train_utils.apply_model_prediction_type(args, pred, noisy, sigmas)
        target = noise - lat
        loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none").mean([1, 2, 3])
        results.update({f"{sampling}.noisy": noisy, f"{sampling}.timesteps": timesteps, f"{sampling}.target": target,
                        f"{sampling}.loss": loss})  # fmt: skip
    results.update(sdscripts_sampler(x))
    save_file({k: v.contiguous() for k, v in results.items()}, str(folder / "sdscripts.safetensors"))


SAMPLER_CASES = {"general": (False, 0.0, 0.0), "ocr": (True, 0.0, 0.0), "rescaled": (False, 0.7, 0.5)}
SAMPLER_STEPS, SAMPLER_SHIFT, SAMPLER_SCALE, SAMPLER_START = 12, 5.0, 3.5, (3, 8)  # start steps: general, ocr


def stand_in(x: torch.Tensor, t: torch.Tensor, k: dict, cond: bool) -> torch.Tensor:
    """The stand-in model of section 3: a·x + b + (t / 1000)·c with the prompt's or the negative's tensors."""
    a, b, c = (k["a1"], k["b1"], k["c1"]) if cond else (k["a2"], k["b2"], k["c2"])
    return a * x + b + (t.float() / 1000).view(-1, 1, 1, 1) * c


def sdscripts_sampler(x: dict) -> dict:
    from library import hunyuan_image_utils as hu

    out = {}
    for name, (ocr, rescale, rescale_apg) in SAMPLER_CASES.items():
        timesteps, sigmas = hu.get_timesteps_sigmas(SAMPLER_STEPS, SAMPLER_SHIFT, torch.device("cpu"))
        out[f"sampler.{name}.sigmas"] = sigmas
        guiders = [hu.AdaptiveProjectedGuidance(guidance_scale=10.0, eta=0.0, adaptive_projected_guidance_rescale=10.0,
                                                adaptive_projected_guidance_momentum=-0.5,
                                                guidance_rescale=rescale_apg) for _ in range(2)]  # fmt: skip
        latents = x["sampler_noise"].clone()
        guided_seq = []
        for i, t in enumerate(timesteps):
            t_int = t.expand(latents.shape[0]).to(torch.int64)
            cond, uncond = stand_in(latents, t_int, x, True), stand_in(latents, t_int, x, False)
            pred = hu.apply_classifier_free_guidance(cond, uncond, ocr, SAMPLER_SCALE, i, apg_start_step_ocr=SAMPLER_START[1],
                                                     apg_start_step_general=SAMPLER_START[0], cfg_guider_ocr=guiders[1],
                                                     cfg_guider_general=guiders[0], guidance_rescale=rescale)  # fmt: skip
            latents = hu.step(latents, pred, sigmas, i)
            guided = hu.apply_classifier_free_guidance(x["seq_cond"][i : i + 1], x["seq_uncond"][i : i + 1], ocr,
                                                       SAMPLER_SCALE, i, SAMPLER_START[1], SAMPLER_START[0],
                                                       *guiders_seq(hu, rescale_apg, out, name), guidance_rescale=rescale)  # fmt: skip
            guided_seq.append(guided)
        out[f"sampler.{name}.latents"] = latents
        out[f"sampler.{name}.guided"] = torch.cat(guided_seq)
    return out


_SEQ_GUIDERS: dict = {}


def guiders_seq(hu, rescale_apg: float, out: dict, name: str) -> tuple:
    """The (ocr, general) guiders of the fixed-sequence check of case ``name`` (made once, kept across its steps)."""
    if name not in _SEQ_GUIDERS:
        _SEQ_GUIDERS[name] = tuple(hu.AdaptiveProjectedGuidance(guidance_scale=10.0, eta=0.0,
                                   adaptive_projected_guidance_rescale=10.0, adaptive_projected_guidance_momentum=-0.5,
                                   guidance_rescale=rescale_apg) for _ in range(2))  # fmt: skip
    return _SEQ_GUIDERS[name]


# ------------------------------------------------------------------------------------------------ sdtrain side
def sdtrain_side(sd_scripts: Path, sds_python: str) -> int:
    from diffusers import HunyuanImageTransformer2DModel
    from safetensors.torch import load_file, save_file

    from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY
    from library.families.hunyuan_image import keys as K
    from library.families.hunyuan_image import tiny
    from library.families.hunyuan_image.objective import HunyuanFlowConfig, HunyuanFlowObjective
    from library.objectives.losses import LossConfig

    g = torch.Generator().manual_seed(0)
    ref = HunyuanImageTransformer2DModel(**tiny.TRANSFORMER)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    tencent = K.diffusers_to_tencent(ref.state_dict())
    from diffusers import AutoencoderKLHunyuanImage

    ref_vae = AutoencoderKLHunyuanImage(**tiny.VAE)
    with torch.no_grad():
        for p in ref_vae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    layout = K.vae_layout_of(len(tiny.VAE["block_out_channels"]), tiny.VAE["layers_per_block"])
    tencent_vae = K.vae_diffusers_to_tencent(ref_vae.state_dict(), layout)
    x = inputs(g)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_file({k: v.contiguous() for k, v in tencent.items()}, str(folder / "tencent.safetensors"))
        save_file(x, str(folder / "inputs.safetensors"))
        (folder / "constants.json").write_text(
            json.dumps(
                {
                    "SDSCRIPTS_CONSTANTS": tiny.SDSCRIPTS_CONSTANTS,
                    "SDSCRIPTS_VAE_CONSTANTS": tiny.SDSCRIPTS_VAE_CONSTANTS,
                    "SDSCRIPTS_BYT5_CONSTANTS": tiny.SDSCRIPTS_BYT5_CONSTANTS,
                    "GLYPH_PROMPT": GLYPH_PROMPT,
                }
            )
        )
        byt5_files = FAMILY.tiny.write_files(FAMILY.tiny.build(seed=3), folder / "files", "t")
        import shutil

        shutil.copy(byt5_files["byt5"], folder / "byt5.safetensors")
        save_file({k: v.contiguous() for k, v in tencent_vae.items()}, str(folder / "vae.safetensors"))
        shims = Path("/work/shared/peer/helpers/sds_shims")  # stands in for torchvision (not installed)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(sd_scripts), str(shims)]))
        subprocess.run([sds_python, __file__, "--side", "sdscripts", "--folder", tmp, "--sd_scripts", str(sd_scripts)],
                       check=True, env=env)  # fmt: skip
        theirs = load_file(str(folder / "sdscripts.safetensors"))
        from library.families.hunyuan_image import model as M
        from library.families.hunyuan_image.loading import load_byt5

        our_byt5 = load_byt5(folder / "byt5.safetensors", torch.float32, "cpu")
    ids, mask = M.tokenize_byt5(M.load_byt5_tokenizer(), [GLYPH_PROMPT])
    same_ids = torch.equal(ids, theirs["byt5_ids"]) and torch.equal(mask, theirs["byt5_mask"])
    with torch.no_grad():
        states = M.encode_byt5(our_byt5, ids, mask)
    d = (states - theirs["byt5_out"]).abs().max().item()
    print(
        f"byT5 Glyph: token ids and mask {'equal' if same_ids else 'DIFFERENT'} ({int(mask.sum())} tokens, colour / "
        f"font tokens included); sd-scripts' load_byt5 read our file (strict) and its states differ by {d:.3e}"
    )
    failures += (not same_ids) + (not d <= 1e-5)

    model = M.transformer_factory(tiny.TRANSFORMER)().eval()  # ours: sd-scripts' float32 time embedding
    model.load_state_dict(K.tencent_to_diffusers(tencent), strict=True)
    back = K.diffusers_to_tencent(model.state_dict())
    same_keys = back.keys() == tencent.keys() and all(torch.equal(back[k], tencent[k]) for k in tencent)
    print(
        f"key round trip Tencent -> diffusers -> Tencent on all {len(tencent)} keys: {'equal' if same_keys else 'DIFFERENT'}"
    )
    failures += not same_keys
    with torch.no_grad():
        ours = model(x["x"], x["t"].float(), x["text"], x["text_mask"], encoder_hidden_states_2=x["byt5"],
                     encoder_attention_mask_2=x["byt5_mask"], return_dict=False)[0]  # fmt: skip
    diff = (ours - theirs["dit_out"]).abs().max().item()
    scale = theirs["dit_out"].abs().max().item()
    print(f"transformer forward: max |diffusers - sd-scripts| = {diff:.3e} (output max {scale:.3e})")
    failures += not diff <= 1e-5 * max(scale, 1.0)

    vae = AutoencoderKLHunyuanImage(**tiny.VAE).eval()
    vae.load_state_dict(K.vae_tencent_to_diffusers(tencent_vae), strict=True)
    back_vae = K.vae_diffusers_to_tencent(vae.state_dict(), layout)
    same_vae_keys = back_vae.keys() == tencent_vae.keys()
    print(f"VAE key round trip on all {len(tencent_vae)} keys: {'equal' if same_vae_keys else 'DIFFERENT'}")
    failures += not same_vae_keys
    with torch.no_grad():
        mean = vae.encode(x["pixels"]).latent_dist.mean
        decoded = vae.decode(x["latents"]).sample
    for name, ours_t, theirs_t in (("VAE encode (mean)", mean, theirs["vae_mean"]),
                                   ("VAE decode", decoded, theirs["vae_decoded"])):  # fmt: skip
        d = (ours_t - theirs_t).abs().max().item() if ours_t.shape == theirs_t.shape else float("inf")
        print(f"{name}: shapes {tuple(ours_t.shape)} / {tuple(theirs_t.shape)}, max diff {d:.3e}")
        failures += not d <= 1e-5

    for sampling in SAMPLINGS:
        cfg = HunyuanFlowConfig(timestep_sampling=sampling, discrete_flow_shift=5.0)
        obj = HunyuanFlowObjective(cfg, LossConfig())
        gen = torch.Generator().manual_seed(1234)
        ex = obj.example(x["x"], gen)
        pred = obj.prediction(x["x"] * 0.5 + 0.1, ex)
        loss = obj.loss_per_sample(pred, ex)
        worst = max((ex.noisy - theirs[f"{sampling}.noisy"]).abs().max().item(),
                    (ex.target - theirs[f"{sampling}.target"]).abs().max().item(),
                    (loss - theirs[f"{sampling}.loss"]).abs().max().item())  # fmt: skip
        same_t = torch.equal(ex.timesteps.to(torch.int64), theirs[f"{sampling}.timesteps"])
        print(f"objective {sampling:10s}: timesteps {'equal' if same_t else 'DIFFERENT'} "
              f"{ex.timesteps.tolist()} vs {theirs[f'{sampling}.timesteps'].tolist()}; max diff noisy/target/loss {worst:.3e}")  # fmt: skip
        failures += (not same_t) + (worst > 1e-6)
    failures += compare_sampler(x, theirs)
    print("ALL EQUAL" if not failures else f"{failures} DIFFERENCES")
    return 1 if failures else 0


def compare_sampler(x: dict, theirs: dict) -> int:
    """Section 3 on our side; returns the number of differences."""
    from library.families.base import FlowSampling, ProjectedGuidance
    from library.sampling.flow import sample_euler
    from library.sampling.flow_generate import sampling_sigmas
    from library.sampling.guidance import with_apg

    failures = 0
    for name, (ocr, rescale, rescale_apg) in SAMPLER_CASES.items():
        settings = FlowSampling(embedded_guidance=False, shift=False, static_shift=SAMPLER_SHIFT, linear_shift=True,
                                latent_downscale=1)  # fmt: skip
        sigmas = sampling_sigmas(settings, SAMPLER_STEPS, 8, 8)
        apg = ProjectedGuidance(start_step=SAMPLER_START[0], text_start_step=SAMPLER_START[1], rescale=rescale,
                                rescale_apg=rescale_apg)  # fmt: skip

        def velocity(x2: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
            t = (sigma2 * 1000).floor()  # what HunyuanImageFamily.predict gives the DiT
            neg, pos = x2.chunk(2)
            return torch.cat([stand_in(neg, t[:1], x, False), stand_in(pos, t[1:], x, True)])

        latents = sample_euler(with_apg(velocity, SAMPLER_SCALE, apg, [ocr]), x["sampler_noise"].clone(), sigmas)

        def fixed(x2: torch.Tensor, sigma2: torch.Tensor, calls: list = []) -> torch.Tensor:  # noqa: B006
            i = len(calls) % SAMPLER_STEPS  # the i-th call of this case: step i
            calls.append(i)
            return torch.cat([x["seq_uncond"][i : i + 1], x["seq_cond"][i : i + 1]])

        guide = with_apg(fixed, SAMPLER_SCALE, apg, [ocr])
        guided = torch.cat([guide(x["sampler_noise"], sigmas[i : i + 1]) for i in range(SAMPLER_STEPS)])
        d_sig = (sigmas - theirs[f"sampler.{name}.sigmas"]).abs().max().item()
        d_lat = (latents - theirs[f"sampler.{name}.latents"]).abs().max().item()
        d_seq = (guided - theirs[f"sampler.{name}.guided"]).abs().max().item()
        print(f"sampler {name:8s} ({SAMPLER_STEPS} steps, APG after step {SAMPLER_START[int(ocr)]}, rescale "
              f"{rescale}/{rescale_apg}): max diff sigmas {d_sig:.3e}, latents {d_lat:.3e}, guided predictions "
              f"{d_seq:.3e}")  # fmt: skip
        failures += (d_sig > 0) + (d_lat > 1e-5) + (d_seq > 1e-5)
    return failures


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--side", default="sdtrain")
    p.add_argument("--folder")
    p.add_argument("--sd_scripts", default=str(Path.home() / "sdtrain-peer/sd-scripts"))
    p.add_argument("--sds_python", default=str(Path.home() / "sdtrain-peer/sdsvenv/bin/python"))
    a = p.parse_args()
    if a.side == "sdscripts":
        sdscripts_side(Path(a.folder), Path(a.sd_scripts))
        return 0
    return sdtrain_side(Path(a.sd_scripts), a.sds_python)


if __name__ == "__main__":
    sys.exit(main())
