"""Helpers for the whole-script training tests (flux_train*.py, sd3_train*.py)."""

from __future__ import annotations

from pathlib import Path


def write_dataset_toml(dataset: Path, path: Path) -> Path:
    """A dataset config at ``path``: the demo's ``10_sks shape`` folder of ``dataset`` (the ``dataset`` fixture), .txt
    captions, resolution 64, batch size 2 (as sd-scripts' docs examples, with the tiny sizes)."""
    path.write_text(f'[general]\ncaption_extension = ".txt"\n[[datasets]]\nresolution = 64\nbatch_size = 2\n'
                    f'[[datasets.subsets]]\nimage_dir = "{(dataset / "10_sks shape").as_posix()}"\n')  # fmt: skip
    return path


def assert_comfyui_loads(
    lora: str, shapes: dict[str, tuple], te_prefixes: tuple[str, ...] = (), names: str = "", fused: str | None = None
) -> None:
    """ComfyUI's rule: ``lora_unet_`` + the single-file weight key's module (``shapes``: key -> weight shape; SAI or
    BFL ``names``) with dots as underscores; up @ down fits that weight. Modules under each of ``te_prefixes`` (text
    encoders) must be there too and are left out of the shape check; a module named with ``fused`` (one kohya module
    on a fused weight, e.g. SD3's ``joint_blocks_0_x_block_attn_qkv``) must be there."""
    from library.files.weights import load_state_dict

    by_name = {
        "lora_unet_" + k[: -len(".weight")].replace(".", "_"): s for k, s in shapes.items() if k.endswith(".weight")
    }
    sd, _ = load_state_dict(lora)
    modules = {k.split(".")[0] for k in sd if not k.startswith(te_prefixes)}
    assert modules and all(m.startswith("lora_unet_") for m in modules)
    assert all(k.startswith(("lora_unet_", *te_prefixes)) for k in sd)
    for prefix in te_prefixes:
        assert any(k.startswith(prefix) for k in sd), prefix
    for m in modules:
        assert m in by_name, f"{m}: no {names} key of that name"
        delta = sd[f"{m}.lora_up.weight"].float() @ sd[f"{m}.lora_down.weight"].float()
        assert tuple(delta.shape) == by_name[m], m
    if fused is not None:
        assert any(fused in m for m in modules), fused


def fixed_noise_loss(family, parts, denoiser, dataset: Path) -> float:
    """The family's training objective's loss of ``denoiser`` on the example dataset's images and captions, summed
    over the objective's validation timesteps with fixed noise (evaluation mode: no dropout): a loss that falls when
    training on those images worked."""
    import numpy as np
    import torch
    from PIL import Image

    from library.objectives.losses import LossConfig
    from library.objectives.noising import NoiseConfig

    paths = sorted((dataset / "10_sks shape").glob("*.png"))
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 127.5 - 1)
                          .permute(2, 0, 1) for p in paths])  # fmt: skip
    captions = [p.with_suffix(".txt").read_text().strip() for p in paths]
    objective = family.training_objective(parts, NoiseConfig(), LossConfig())
    with torch.no_grad():
        latents = family.encode_latents(parts, pixels)
        cond = family.encode_prompt(parts, captions)
        total = 0.0
        for i, t in enumerate(objective.validation_timesteps()):
            ex = objective.example(latents, torch.Generator().manual_seed(i), timesteps=torch.full((len(paths),), t))
            total += float(objective.loss_per_sample(family.predict(denoiser.eval(), ex.noisy, ex.timesteps, cond), ex)
                           .mean())  # fmt: skip
    return total
