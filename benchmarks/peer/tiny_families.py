"""Tiny single files of the families whose reference trainers run beside ours in bench_vs_sdscripts.py's DiT cases.

    PYTHONPATH=<sdtrain> <sdtrain venv>/bin/python benchmarks/peer/tiny_families.py OUT --only anima

(OUT/tiny-sd3/: the peer kit's SD3.5-medium files, see :func:`sd3`; OUT/tiny-lumina/: :func:`lumina`.)
OUT/tiny-anima/: ``tiny_dit.safetensors`` (the DiT with its LLM adapter under ``net.``), ``tiny_qwen3.safetensors``,
``tiny_vae.safetensors`` (ComfyUI names), written by the family's own tiny builder (``ANIMA.tiny``), and
``tiny_config.json``: the same widths in the reference's own constructor arguments (``anima_models.Anima`` /
``LLMAdapter`` keyword arguments, the Qwen3 config, the Qwen-Image VAE config), which run_reference_tiny.py puts in
place of the reference's hard-coded released configs. Nothing is written for a family whose folder exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def anima(out: Path) -> None:
    from library.families.anima import ANIMA
    from library.families.anima import tiny as tiny_mod
    from library.families.autoencoders.qwen_image import TINY

    parts = ANIMA.tiny.build(seed=3)
    files = {k: str(v) for k, v in ANIMA.tiny.write_files(parts, out, "tiny").items()}
    c = parts.denoiser.config
    dit = dict(in_channels=c.in_channels, out_channels=c.out_channels, model_channels=c.num_attention_heads
               * c.attention_head_dim, num_blocks=c.num_layers, num_heads=c.num_attention_heads, mlp_ratio=c.mlp_ratio,
               crossattn_emb_channels=c.text_embed_dim, adaln_lora_dim=c.adaln_lora_dim)  # fmt: skip
    a = c.text_conditioner
    adapter = dict(source_dim=a["source_dim"], target_dim=a["target_dim"], model_dim=a["model_dim"],
                   num_layers=a["num_layers"], num_heads=a["num_attention_heads"])  # fmt: skip
    vae = {k: v for k, v in TINY.items() if k != "input_channels"}
    config = {"family": "anima", "files": files, "dit": dit, "adapter": adapter, "qwen3": tiny_mod.TINY_QWEN3,
              "vae": vae}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def sd3(out: Path) -> None:
    """SD3.5-medium with 2 joint blocks (block 0 dual attention): the peer kit's ``tiny-sd3`` names and its
    run_sdscripts_tiny.py's tiny_config.json (MMDiT width / heads, VAE, CLIP-L / CLIP-G / T5 widths)."""
    from library.families.sd3.tiny import AE, build_tiny_sd3

    parts = build_tiny_sd3("sd3.5-medium", 0, 2)
    files = get_family_tiny("sd3.5-medium").write_files(parts, out, "tiny")
    for part, name in (("dit", "sd3_tiny"), ("clip_l", "clip_l"), ("clip_g", "clip_g"), ("t5xxl", "t5xxl")):
        files[part].replace(out / f"{name}.safetensors")
    files["vae"].unlink()
    c = parts.denoiser.config
    boc = AE["block_out_channels"]
    clip_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "projection_dim",
                 "hidden_act")  # fmt: skip
    t5_keys = ("d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets")
    config = {"family": "sd3", "mmdit": {"hidden_size": c.num_attention_heads * c.attention_head_dim,
                                         "num_heads": c.num_attention_heads},
              "vae_params": {"ch": boc[0], "ch_mult": [b // boc[0] for b in boc], "num_res_blocks": AE["layers_per_block"],
                             "z_channels": AE["latent_channels"], "scale_factor": AE["scaling_factor"],
                             "shift_factor": AE["shift_factor"]},
              "norm_num_groups": AE["norm_num_groups"]}  # fmt: skip
    for name, encoder, keys in zip(("clip_l", "clip_g", "t5xxl"), parts.text_encoders, (clip_keys, clip_keys, t5_keys)):
        config[name] = {k: getattr(encoder.config, k) for k in keys}
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def lumina(out: Path) -> None:
    """Lumina 2: the Alpha-VLLM transformer, Gemma2 and the AE (``write_tiny_files``), the tiny Gemma tokenizer also
    in the hub-cache layout under ``TOKCACHE`` (sd-scripts loads google/gemma-2-2b with ``--tokenizer_cache_dir``)."""
    from library.families.lumina.tiny import GEMMA, TRANSFORMER, build_tiny_lumina, write_tiny_files, write_tokenizer

    parts = build_tiny_lumina(seed=0)
    write_tiny_files(parts, out)
    vae = parts.vae.config
    ch = vae.block_out_channels[0]
    ae = {"ch": ch, "ch_mult": [c // ch for c in vae.block_out_channels], "num_res_blocks": vae.layers_per_block,
          "z_channels": vae.latent_channels, "groups": vae.norm_num_groups}  # fmt: skip
    config = {"family": "lumina", "transformer": TRANSFORMER, "text_encoder": GEMMA, "ae": ae}
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))
    hub = out.parent.parent / "tokcache" / "models--google--gemma-2-2b"
    if not hub.exists():
        write_tokenizer(hub / "snapshots" / "0")
        (hub / "refs").mkdir(parents=True, exist_ok=True)
        (hub / "refs" / "main").write_text("0")


def get_family_tiny(name: str):
    from library.families import get_family

    return get_family(name).tiny


BUILDERS = {"sd3": sd3, "anima": anima, "lumina": lumina}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--only", default=",".join(BUILDERS), help=f"comma list of {', '.join(BUILDERS)}")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    for name in a.only.split(","):
        folder = a.out / f"tiny-{name}"
        if folder.exists():
            continue
        folder.mkdir(parents=True)
        BUILDERS[name](folder)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
