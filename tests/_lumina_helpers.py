"""Shared tiny Lumina 2 fixtures: the tiny parts written once per session in every layout users have."""

from __future__ import annotations

from pathlib import Path


def write_layouts(parts, root: Path) -> dict[str, str]:
    """``parts`` as sd-scripts' files (``model``: Alpha-VLLM transformer, ``gemma2``, ``ae``, the tokenizer beside
    them), the same transformer under ``model.diffusion_model.`` (``prefixed``), ComfyUI's all-in-one file
    (``allinone``: the three parts under ``model.diffusion_model.`` / ``text_encoders.gemma2_2b.transformer.model.`` /
    ``vae.``, tokenizer beside it) and a diffusers folder (``folder``)."""
    from safetensors.torch import load_file, save_file

    from library.families.lumina import LUMINA2
    from library.families.lumina.tiny import write_tiny_files, write_tokenizer

    files = {k: str(v) for k, v in write_tiny_files(parts, root / "files").items()}
    prefixed = write_tiny_files(parts, root / "prefixed", prefix="model.diffusion_model.")["model"]
    files["prefixed"] = str(prefixed)
    merged = {k: v for k, v in load_file(prefixed).items()}
    merged.update({"text_encoders.gemma2_2b.transformer.model." + k.removeprefix("model."): v
                   for k, v in load_file(files["gemma2"]).items()})  # fmt: skip
    merged.update({"vae." + k: v for k, v in load_file(files["ae"]).items()})
    (root / "allinone").mkdir()
    save_file(merged, root / "allinone" / "lumina_allinone.safetensors")
    write_tokenizer(root / "allinone")
    files["allinone"] = str(root / "allinone" / "lumina_allinone.safetensors")
    files["folder"] = str(LUMINA2.save(parts, root / "folder"))
    return files
