"""Header-only files of the released Anima, Lumina Image 2.0, HunyuanImage 2.1 and PixArt-Σ / α models, as the files
users pass on their documented command lines, for ``--plan_memory`` (benchmarks/docs_memory_tables.py's tables of
docs/anima.md, lumina.md, hunyuan_image.md, pixart.md).

    python benchmarks/plan_dit_families.py --model hunyuan_image --workdir DIR   # write the files, print the flags
    python benchmarks/plan_dit_families.py --model anima --check                  # and check no value can be read

Each file holds its safetensors header only: the real key names, shapes and dtypes of the released file, no tensor
data (``library.measure.phantom.header_only_writes``), so reading any weight value from it fails (``--check``: every
file's first tensor read with safetensors' own reader raises; a plan reads headers through
``library.measure.phantom.header_only_reads``). The layouts are the ones the loaders read:

* ``hunyuan_image``: Tencent's ``hunyuanimage2.1.safetensors`` (bf16), Comfy-Org's ``qwen_2.5_vl_7b.safetensors``
  (``model.`` names, bf16; the language model the loader builds), ``byt5_small_glyphxl_fp16.safetensors``
  (``encoder.*`` + ``shared.weight``, fp16) and ``hunyuan_image_2.1_vae_fp16.safetensors`` (Tencent names, fp16):
  ``--pretrained_model_name_or_path --text_encoder --byt5 --vae``;
* ``anima``: the DiT with its LLM adapter under ``net.`` (bf16), ComfyUI's ``qwen_3_06b_base.safetensors``
  (``model.``), ``qwen_image_vae.safetensors`` (Wan names): ``--pretrained_model_name_or_path --qwen3 --vae``; the
  tokenizers are the shipped Qwen3 and T5 ones (a real single-file load's);
* ``lumina2``: Alpha-VLLM's ``lumina_2_model_bf16.safetensors``, Gemma-2-2B (``model.`` names) and the FLUX AE
  (BFL names), bf16: ``--pretrained_model_name_or_path --gemma2 --ae``; Gemma's tokenizer is gated on the hub, so
  the tiny model's tokenizer file lies beside ``--gemma2`` (the one benchmarks/lumina_memory.py's runs use);
* ``pixart_sigma`` / ``pixart_alpha``: benchmarks/pixart_memory.py's files (the official transformer, ``--t5xxl``,
  ``--vae``).

The files of a model are a few hundred KB; a folder is reused when its ``flags.json`` is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

MODELS = ("hunyuan_image", "anima", "lumina2", "pixart_sigma", "pixart_alpha")


def _phantom(module, dtype):
    """``module`` in ``dtype`` with every tensor a phantom (uninitialised host memory, never read)."""
    from library.measure.phantom import _mark

    module = module.to(dtype).to_empty(device="cpu")
    for t in (*module.parameters(), *module.buffers()):
        _mark(t)
    return module.eval().requires_grad_(False)


def _hunyuan(folder: Path) -> dict[str, Path]:
    import torch
    from accelerate import init_empty_weights

    from library.families.hunyuan_image import HUNYUAN_IMAGE
    from library.families.hunyuan_image import keys as K
    from library.families.hunyuan_image import model as M
    from library.files.weights import save_state_dict

    parts = HUNYUAN_IMAGE.reference_parts()
    with init_empty_weights(include_buffers=True):
        vae = _phantom(M.vae_factory(M.VAE)(), torch.float16)
    qwen, byt5 = parts.text_encoders
    qwen, byt5 = _phantom(qwen, torch.bfloat16), _phantom(byt5, torch.float16)
    parts = dataclasses.replace(parts, denoiser=_phantom(parts.denoiser, torch.bfloat16), vae=vae,
                                text_encoders=[qwen, byt5])  # fmt: skip
    layout = K.vae_layout_of(len(M.VAE["block_out_channels"]), M.VAE["layers_per_block"])
    byt5_state = {k: v for k, v in byt5.state_dict().items() if k != "encoder.embed_tokens.weight"}  # tied
    return {
        "pretrained_model_name_or_path": HUNYUAN_IMAGE.save(parts, folder / "hunyuanimage2.1.safetensors"),
        "text_encoder": save_state_dict({f"model.{k}": v for k, v in qwen.state_dict().items()},
                                        folder / "qwen_2.5_vl_7b.safetensors", {}),
        "byt5": save_state_dict(byt5_state, folder / "byt5_small_glyphxl_fp16.safetensors", {}),
        "vae": save_state_dict(K.vae_diffusers_to_tencent(vae.state_dict(), layout),
                               folder / "hunyuan_image_2.1_vae_fp16.safetensors", {}),
    }  # fmt: skip


def _anima(folder: Path) -> dict[str, Path]:
    import torch
    from accelerate import init_empty_weights

    from library.families.anima import ANIMA, saving
    from library.families.autoencoders import qwen_image

    parts = ANIMA.reference_parts()
    with init_empty_weights(include_buffers=True):
        vae = qwen_image.factory(qwen_image.RELEASED)()
    parts = dataclasses.replace(parts, denoiser=_phantom(parts.denoiser, torch.bfloat16),
                                vae=_phantom(vae, torch.bfloat16),
                                text_encoders=[_phantom(te, torch.bfloat16) for te in parts.text_encoders])  # fmt: skip
    return {
        "pretrained_model_name_or_path": saving.save_dit(parts, folder / "anima.safetensors", ANIMA),
        "qwen3": saving.save_qwen3(parts, folder / "qwen_3_06b_base.safetensors"),
        "vae": saving.save_vae(parts, folder / "qwen_image_vae.safetensors", comfy=True),
    }


def _lumina(folder: Path) -> dict[str, Path]:
    import torch
    from accelerate import init_empty_weights

    from library.families import get_family
    from library.families.autoencoders import flux_ae
    from library.families.lumina import tiny

    parts = get_family("lumina2").reference_parts()
    with init_empty_weights(include_buffers=True):
        vae = flux_ae.factory(flux_ae.released_config())()
    parts = dataclasses.replace(parts, denoiser=_phantom(parts.denoiser, torch.bfloat16),
                                vae=_phantom(vae, torch.bfloat16),
                                text_encoders=[_phantom(te, torch.bfloat16) for te in parts.text_encoders])  # fmt: skip
    files = tiny.write_tiny_files(parts, folder)  # model / gemma2 / ae, and the tiny tokenizer beside them
    return {"pretrained_model_name_or_path": files["model"], "gemma2": files["gemma2"], "ae": files["ae"]}


def write_files(model: str, folder: Path) -> list[str]:
    """The model flags of a command on ``model``'s header-only files in ``folder`` (written once)."""
    from library.measure.phantom import PhantomDevice, header_only_writes

    folder.mkdir(parents=True, exist_ok=True)
    done = folder / "flags.json"
    if done.exists():
        return json.loads(done.read_text())
    if model.startswith("pixart"):
        from pixart_memory import write_files as pixart_files

        flags = pixart_files(model, folder)
    else:
        writer = {"hunyuan_image": _hunyuan, "anima": _anima, "lumina2": _lumina}[model]
        with PhantomDevice(strict=False), header_only_writes():
            files = writer(folder)
        flags = [w for flag, path in files.items() for w in (f"--{flag}", str(path))]
    written = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    if written > 2**26:  # headers only: a few hundred KB each
        raise RuntimeError(f"{folder}: {written} bytes written; the header-only writes missed a writer")
    done.write_text(json.dumps(flags))
    return flags


def check_unreadable(flags: list[str]) -> list[str]:
    """Each ``.safetensors`` of ``flags``: reading its first tensor's value with safetensors must fail (the file
    ends after its header). Returns the files whose value could be read."""
    from safetensors import safe_open

    readable = []
    for path in (Path(w) for w in flags if w.endswith(".safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                f.get_tensor(next(iter(f.keys())))
            readable.append(str(path))
        except Exception:  # noqa: BLE001 - any failure to read a value is what is checked
            pass
    return readable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--check", action="store_true", help="check that no file's tensor values can be read")
    args = parser.parse_args(argv)
    bad = []
    for model in args.model:
        flags = write_files(model, Path(args.workdir) / model)
        print(model, " ".join(flags))
        if args.check:
            bad += check_unreadable(flags)
    for path in bad:
        print("CHECK: a value was read from", path)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
