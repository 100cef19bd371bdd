"""The demo's last step (``train_network.py --demo``): the trained adapter loaded by the consumer that reads its
format, shown to change the denoiser's output (diffusers' ``load_lora_weights`` for LoRA/LoCon, lycoris-lora's
loader and forward pass for LyCORIS formats, sd-scripts' OFT forward for its files, sdtrain's own loader for a
denoiser that is not a UNet)."""

from __future__ import annotations

from pathlib import Path

from library.families.protocol import ModelFamily

DIFFUSERS_KEYS = ("lora_down.weight", "lora_up.weight", "alpha")  # kohya LoRA/LoCon: what diffusers reads


def reader_for(lora: Path, family: ModelFamily | None = None) -> str:
    """Which consumer reads the file: "diffusers" for plain kohya LoRA/LoCon files, "sd-scripts-oft" for sd-scripts'
    networks.oft files (``oft_unet_…``), "lycoris" for LyCORIS formats (LoHa, LoKr, DoRA, Tucker, diag-oft, BOFT);
    "sdtrain" for a ``family`` whose denoiser is not a UNet (FLUX: diffusers' kohya converter assumes the released
    width, lycoris-lora does not know the fused modules), read by sdtrain's own loader."""
    from safetensors import safe_open

    if family is not None and family.denoiser_name != "UNet":
        return "sdtrain"
    with safe_open(str(lora), "pt") as f:
        keys = list(f.keys())
    if all(k.endswith(DIFFUSERS_KEYS) for k in keys):
        return "diffusers"
    return "sd-scripts-oft" if any(k.startswith("oft_unet_") for k in keys) else "lycoris"


def show_it_loads(lora: Path, model: str, family: ModelFamily) -> None:
    """Load the demo adapter with the consumer that reads its format (diffusers' load_lora_weights for LoRA/LoCon,
    lycoris-lora's loader and forward pass for LyCORIS formats), check it changes the UNet, say where it is."""
    import torch

    reader = reader_for(lora, family)
    if reader == "sdtrain":
        before, after = _own_outputs(lora, model, family)
        how = "sdtrain loads it (networks.inject.network_from_file)"
    elif reader == "diffusers":
        before, after = _diffusers_outputs(lora, model, family)
        how = "diffusers loads it (load_lora_weights)"
    elif reader == "sd-scripts-oft":
        before, after = _lycoris_outputs(lora, model, family, sd_scripts_oft=True)
        how = "sd-scripts' networks.oft forward (networks/sd_scripts_oft_reader.py) reads it the same"
    else:
        before, after = _lycoris_outputs(lora, model, family)
        how = "lycoris-lora loads it (create_network_from_weights, forward pass)"
    change = (after - before).abs().mean().item()
    if not torch.isfinite(after).all() or change == 0:
        raise RuntimeError(f"demo: {lora} loaded but does not change the UNet output ({how})")
    print(
        f"demo: the adapter is at {lora}; {how} and it changes the {family.denoiser_name} output by {change:.4f} on average"
    )


def _diffusers_outputs(lora: Path, model: str, family: ModelFamily):
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True)
    unet = pipe.unet
    sample = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    out = pipe.encode_prompt(
        prompt="sks shape", device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=False
    )
    text, kwargs = out[0], {}
    time_ids = family.size_conditioning([[64, 64]], [[0, 0]], [[64, 64]])  # None where the family has none
    if time_ids is not None:  # pooled text (the pipeline's third output) + size conditioning
        kwargs = {"added_cond_kwargs": {"text_embeds": out[2], "time_ids": time_ids}}
    with torch.no_grad():
        before = unet(sample, 500, text, **kwargs).sample
        pipe.load_lora_weights(str(lora), adapter_name="demo")
        after = unet(sample, 500, text, **kwargs).sample
    return before, after


def _own_outputs(lora: Path, model: str, family: ModelFamily):
    """The denoiser's outputs for one noisy latent before / after sdtrain's loader applies ``lora``."""
    import torch

    from .inject import network_from_file

    parts = family.load(model)
    with torch.no_grad():
        shape = family.encode_latents(parts, torch.zeros(1, 3, 64, 64)).shape
        sample = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        t, cond = torch.tensor([500.0]), family.encode_prompt(parts, ["sks shape"])
        before = family.predict(parts.denoiser, sample, t, cond)
        network_from_file(lora, family.adapter_roots(parts))
        after = family.predict(parts.denoiser, sample, t, cond)
    return before, after


def _lycoris_outputs(lora: Path, model: str, family: ModelFamily, sd_scripts_oft: bool = False):
    """UNet outputs before / after lycoris-lora (or, for ``oft_unet_`` files, sd-scripts' OFT forward) applies
    ``lora``; they must equal sdtrain's own reading of the file."""
    import torch

    from .inject import network_from_file
    from .lycoris_reader import apply_with_lycoris
    from .sd_scripts_oft_reader import apply_sd_scripts_oft

    sample = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500])
    time_ids = family.size_conditioning([[64, 64]], [[0, 0]], [[64, 64]])  # None where the family has none

    def predict(parts):
        with torch.no_grad():
            cond = family.encode_prompt(parts, ["sks shape"])
            return family.predict(parts.denoiser, sample, t, cond, time_ids=time_ids)

    theirs, ours = family.load(model), family.load(model)
    before = predict(theirs)
    (apply_sd_scripts_oft if sd_scripts_oft else apply_with_lycoris)(lora, family.adapter_roots(theirs))
    network_from_file(lora, family.adapter_roots(ours))
    after, expected = predict(theirs), predict(ours)
    if not torch.allclose(after, expected, atol=1e-4, rtol=1e-3):
        who = "sd-scripts' networks.oft" if sd_scripts_oft else "lycoris-lora"
        raise RuntimeError(
            f"demo: {who} reads {lora} differently from sdtrain (max difference "
            f"{(after - expected).abs().max():.2e}); please report this"
        )
    return before, after
