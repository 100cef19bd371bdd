"""Tiny single files of the families whose reference trainers run beside ours in bench_vs_sdscripts.py's DiT cases.

    PYTHONPATH=<sdtrain> <sdtrain venv>/bin/python benchmarks/peer/tiny_families.py OUT --only anima

(OUT/tiny-sd3/: the peer kit's SD3.5-medium files, see :func:`sd3`; OUT/tiny-lumina/: :func:`lumina`; OUT/tiny-flux,
tiny-chroma, tiny-hunyuan_image (sd-scripts) and tiny-qwen_image, tiny-qwen_image_edit, tiny-zimage, tiny-flux2,
tiny-flux2_dev (musubi-tuner), tiny-pixart_sigma, tiny-pixart_alpha (OneTrainer): the function of that name.)
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


def flux(out: Path) -> None:
    """FLUX.1 dev: ``flux_tiny.safetensors`` (BFL names), ``clip_l``, ``t5xxl``, ``ae`` written by the family's own
    tiny builder (``build_tiny_flux``), and the peer kit's tiny_config.json for its run_sdscripts_tiny.py (sd-scripts'
    ``FluxParams`` / ``AutoEncoderParams`` fields, the AE's GroupNorm groups, the CLIP-L / T5 widths)."""
    from library.families.flux.tiny import build_tiny_flux, write_tiny_files

    parts = build_tiny_flux("flux-dev", seed=0)
    files = write_tiny_files(parts, out)
    files["model"].replace(out / "flux_tiny.safetensors")
    c, vae = parts.denoiser.config, parts.vae.config
    boc = vae.block_out_channels
    clip_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "projection_dim",
                 "hidden_act")  # fmt: skip
    t5_keys = ("d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets")
    clip_l, t5 = parts.text_encoders
    config = {"family": "flux",
              "flux_params": {"in_channels": c.in_channels, "vec_in_dim": c.pooled_projection_dim,
                              "context_in_dim": c.joint_attention_dim, "mlp_ratio": 4.0,
                              "hidden_size": c.num_attention_heads * c.attention_head_dim,
                              "num_heads": c.num_attention_heads, "axes_dim": list(c.axes_dims_rope)},
              "ae_params": {"ch": boc[0], "ch_mult": [b // boc[0] for b in boc], "num_res_blocks": vae.layers_per_block,
                            "z_channels": vae.latent_channels, "scale_factor": vae.scaling_factor,
                            "shift_factor": vae.shift_factor},
              "norm_num_groups": vae.norm_num_groups,
              "clip_l": {k: getattr(clip_l.config, k) for k in clip_keys},
              "t5xxl": {k: getattr(t5.config, k) for k in t5_keys}}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def chroma(out: Path) -> None:
    """Chroma: ``chroma_tiny.safetensors`` (BFL names), ``t5xxl``, ``ae`` written by the family's own tiny builder
    (``build_tiny_flux("chroma")``; no CLIP-L) and tiny_config.json: sd-scripts' ``ChromaParams`` fields (its
    loader builds the released widths and depths whatever the file holds), the AE's widths and GroupNorm groups, T5's
    widths (run_reference_tiny.py's ``patch_chroma``)."""
    from library.families.flux.tiny import CHROMA_EXTRA, build_tiny_flux, write_tiny_files

    parts = build_tiny_flux("chroma", seed=0)
    files = write_tiny_files(parts, out)
    files["model"].replace(out / "chroma_tiny.safetensors")
    c, vae = parts.denoiser.config, parts.vae.config
    boc = vae.block_out_channels
    t5_keys = ("d_model", "d_kv", "d_ff", "num_layers", "num_heads", "relative_attention_num_buckets")
    params = {"in_channels": c.in_channels, "context_in_dim": c.joint_attention_dim,
              "hidden_size": c.num_attention_heads * c.attention_head_dim, "num_heads": c.num_attention_heads,
              "depth": c.num_layers, "depth_single_blocks": c.num_single_layers, "axes_dim": list(c.axes_dims_rope),
              "approximator_in_dim": CHROMA_EXTRA["approximator_num_channels"],
              "approximator_depth": CHROMA_EXTRA["approximator_layers"],
              "approximator_hidden_size": CHROMA_EXTRA["approximator_hidden_dim"]}  # fmt: skip
    ae = {"ch": boc[0], "ch_mult": [b // boc[0] for b in boc], "num_res_blocks": vae.layers_per_block,
          "z_channels": vae.latent_channels, "groups": vae.norm_num_groups}  # fmt: skip
    config = {"family": "chroma", "chroma_params": params, "ae": ae,
              "t5xxl": {k: getattr(parts.text_encoders[0].config, k) for k in t5_keys}}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def hunyuan_image(out: Path) -> None:
    """HunyuanImage 2.1: ``tiny_dit`` (Tencent names), ``tiny_qwen`` (Comfy-Org's ``model.`` names), ``tiny_byt5``,
    ``tiny_vae`` written by the family's own tiny builder, the Qwen2.5-VL tokenizer it ships (``qwen_tokenizer/``)
    and tiny_config.json: the tiny sizes as replacements of the literals of sd-scripts' DiT, VAE and byT5 loaders
    (``SDSCRIPTS_*CONSTANTS``) and the tiny Qwen2.5-VL text config (run_reference_tiny.py's ``patch_hunyuan_image``)."""
    import shutil

    from library.families.encoders import qwen25vl
    from library.families.hunyuan_image import tiny as tiny_mod

    family_tiny = get_family_tiny("hunyuan_image")
    parts = family_tiny.build(seed=0)
    files = family_tiny.write_files(parts, out, "tiny")
    shutil.copytree(qwen25vl._bundled_folder(), out / "qwen_tokenizer")
    config = {"family": "hunyuan_image", "files": {k: Path(v).name for k, v in files.items()},
              "dit": tiny_mod.SDSCRIPTS_CONSTANTS, "vae": tiny_mod.SDSCRIPTS_VAE_CONSTANTS,
              "byt5": tiny_mod.SDSCRIPTS_BYT5_CONSTANTS, "byt5_width": tiny_mod.BYT5["d_model"],
              "qwen_text": _qwen_text()}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def qwen_image(out: Path) -> None:
    """Qwen-Image: ``tiny_dit`` (diffusers names), ``tiny_te`` (``model.``), ``tiny_vae`` (ComfyUI's names) written
    by the family's own tiny builder, the shipped Qwen2.5-VL tokenizer (``qwen_tokenizer/``) and tiny_config.json:
    the transformer sizes musubi-tuner's ``create_model`` hard-codes, the VAE's base width, the Qwen2.5-VL text
    config (run_reference_tiny.py's ``patch_qwen_image``)."""
    import shutil

    from library.families.autoencoders import qwen_image as vae_mod
    from library.families.encoders import qwen25vl
    from library.families.qwen_image import model as M

    family_tiny = get_family_tiny("qwen_image")
    files = family_tiny.write_files(family_tiny.build(seed=0), out, "tiny")
    shutil.copytree(qwen25vl._bundled_folder(), out / "qwen_tokenizer")
    dit = {k: M.TINY[k] for k in ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                                  "axes_dims_rope")}  # fmt: skip
    config = {"family": "qwen_image", "files": {k: Path(v).name for k, v in files.items()}, "dit": dit,
              "vae_base_dim": vae_mod.TINY["base_dim"], "qwen_text": _qwen_text()}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def zimage(out: Path) -> None:
    """Z-Image: ``tiny_dit`` (the original names), ``tiny_te`` (``model.``), ``tiny_vae`` (BFL's names) written by the
    family's own tiny builder, the shipped Qwen3 vocabulary and chat template (``qwen3_tokenizer/``) and
    tiny_config.json: the transformer, AE and Qwen3 sizes musubi-tuner's loaders hard-code
    (run_reference_tiny.py's ``patch_zimage``)."""
    from library.families.encoders import qwen3
    from library.families.zimage import model as M
    from library.families.zimage import tiny as tiny_mod

    family_tiny = get_family_tiny("zimage")
    files = family_tiny.write_files(family_tiny.build(seed=0), out, "tiny")
    _qwen3_tokenizer(out / "qwen3_tokenizer")
    dit = {k: M.TINY[k] for k in ("dim", "n_layers", "n_refiner_layers", "n_heads", "n_kv_heads", "cap_feat_dim",
                                  "axes_dims", "axes_lens")}  # fmt: skip
    ae = {k: tiny_mod.AE[k] for k in ("block_out_channels", "layers_per_block", "norm_num_groups")}
    text = {k: qwen3.TINY[k] for k in QWEN3_SIZES}
    config = {"family": "zimage", "files": {k: Path(v).name for k, v in files.items()}, "dit": dit, "ae": ae,
              "qwen3": text}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def flux2(out: Path) -> None:
    """FLUX.2 klein base 4B: ``tiny-base_dit`` (BFL names), ``tiny_te-0000{1,2}-of-00002`` (Qwen3, ``model.``),
    ``tiny_ae`` (BFL names) written by the family's own tiny builder, the shipped Qwen3 vocabulary and chat template
    and tiny_config.json: musubi-tuner's ``Flux2Params`` / ``AutoEncoderParams`` fields and GroupNorm group count, the
    Qwen3 sizes (run_reference_tiny.py's ``patch_flux2``)."""
    from library.families.autoencoders import flux2 as ae
    from library.families.flux2 import model as M
    from library.families.flux2 import tiny as tiny_mod

    family_tiny = get_family_tiny("flux2")
    files = family_tiny.write_files(family_tiny.build(seed=0), out, "tiny")
    _qwen3_tokenizer(out / "qwen3_tokenizer")
    t, boc = M.TINY, ae.TINY["block_out_channels"]
    dit = {"in_channels": t["in_channels"], "context_in_dim": t["joint_attention_dim"], "num_heads":
           t["num_attention_heads"], "hidden_size": t["num_attention_heads"] * t["attention_head_dim"],
           "depth": t["num_layers"], "depth_single_blocks": t["num_single_layers"], "axes_dim":
           list(t["axes_dims_rope"]), "mlp_ratio": t["mlp_ratio"], "use_guidance_embed": t["guidance_embeds"]}  # fmt: skip
    autoencoder = {"ch": boc[0], "ch_mult": [b // boc[0] for b in boc], "num_res_blocks": ae.TINY["layers_per_block"],
                   "z_channels": ae.TINY["latent_channels"]}  # fmt: skip
    text = {k: tiny_mod.TINY_QWEN3[k] for k in QWEN3_SIZES if k in tiny_mod.TINY_QWEN3}
    config = {"family": "flux2", "files": {k: Path(v).name for k, v in files.items()}, "dit": dit, "ae": autoencoder,
              "groups": ae.TINY["norm_num_groups"], "qwen3": text}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def qwen_image_edit(out: Path) -> None:
    """Qwen-Image Edit: :func:`qwen_image`'s files with the Qwen2.5-VL vision tower in ``tiny_te`` (``visual.``, as
    ComfyUI's edit text encoder; ``qwen25vl_edit``'s tiny tower, seeded), the DiT named ``tiny_edit_dit`` (musubi-tuner
    warns on an edit run whose DiT file name lacks "edit"), ``control/``: one control image (seeded blobs) per image
    of the peer dataset (``make_dataset.py``'s ``img00``..``img07``), 64 x 64 as the targets (musubi-tuner gives the
    VL model each control image resized to its target's bucket first, ours from the control file's own size: a
    control of another aspect ratio would give the two sides different prompt lengths), and tiny_config.json's ``vision``
    and ``processor`` (run_reference_tiny.py's ``tiny_qwen25vl``: the vision tower and musubi-tuner's VL processor)."""
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from library.families.encoders import qwen25vl
    from library.families.encoders import qwen25vl_edit as E
    from library.families.qwen_image import saving

    qwen_image(out)
    (out / "tiny_dit.safetensors").replace(out / "tiny_edit_dit.safetensors")
    vl = E.randomize(E.build(qwen25vl.TINY_TEXT, E.TINY_VISION).eval(), 0)
    saving.save_text_encoder(SimpleNamespace(text_encoders=[E.core(vl)]), out / "tiny_te.safetensors")
    (out / "control").mkdir()
    rng = np.random.default_rng(1)
    for i in range(8):
        blobs = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        Image.fromarray(blobs).resize((64, 64), Image.BICUBIC).save(out / "control" / f"img{i:02d}.png")
    config = json.loads((out / "tiny_config.json").read_text())
    config["files"]["dit"] = "tiny_edit_dit.safetensors"
    config.update(vision=E.TINY_VISION, processor=E.PROCESSOR)
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def flux2_dev(out: Path) -> None:
    """FLUX.2 dev: ``tiny_dev_dit`` (the tiny FLUX.2 DiT with the guidance embedding, BFL names), the klein tiny's AE,
    ``text_encoder/model-0000{1,2}-of-00002`` (a whole tiny ``Mistral3ForConditionalGeneration``: the language model at
    ``mistral3.TINY``, a one-layer Pixtral tower and the projector, split and named as the released file; musubi-tuner loads
    it strictly, ours reads the language model), ``tokenizer/`` beside it (the tests' word-level tokenizer with
    Mistral's chat markers: Mistral's is not shipped) and tiny_config.json: the DiT's ``Flux2Params``, the Mistral 3
    text and vision sizes (run_reference_tiny.py's ``patch_flux2``)."""
    import dataclasses

    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from library.families.autoencoders import flux2 as ae
    from library.families.encoders import mistral3
    from library.families.flux2 import model as M
    from library.families.flux2 import saving
    from library.families.flux2.tiny import randomize
    from library.files.weights import save_state_dict

    sys.path.insert(0, str(ROOT / "tests"))
    from _flux2_helpers import tiny_mistral_tokenizer

    family_tiny = get_family_tiny("flux2")
    klein = family_tiny.build(seed=0)
    denoiser = M.build(dict(M.TINY, guidance_embeds=True))
    randomize(denoiser, 4)
    text = {k: mistral3.TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "head_dim")}  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  patch_size=14, image_size=28)  # fmt: skip
    vlm = Mistral3ForConditionalGeneration(Mistral3Config(text_config=dict(mistral3.TINY, model_type="mistral"),
                                                          vision_config=vision))  # fmt: skip
    randomize(vlm, 5)
    # the released file's names (transformers 4's layout; musubi-tuner renames them to its transformers' own)
    renames = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
               ("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))  # fmt: skip
    state = {}
    for k, v in vlm.state_dict().items():  # cloned: lm_head may be tied to the embedding
        old = next(o for o, _ in renames if k.startswith(o))
        state[dict(renames)[old] + k[len(old) :]] = v.clone()
    names = sorted(state)
    (out / "text_encoder").mkdir()
    shards = [out / "text_encoder" / f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for shard, part in zip(shards, (names[: len(names) // 2], names[len(names) // 2 :])):
        save_state_dict({k: state[k] for k in part}, shard, {"format": "pt"})
    tiny_mistral_tokenizer(out / "tokenizer")
    parts = dataclasses.replace(klein, denoiser=denoiser)
    files = {"dit": saving.save_dit(parts, out / "tiny_dev_dit.safetensors", family_tiny.family),
             "vae": saving.save_vae(parts, out / "tiny_ae.safetensors"), "text_encoder": shards[0]}  # fmt: skip
    t, boc = M.TINY, ae.TINY["block_out_channels"]
    dit = {"in_channels": t["in_channels"], "context_in_dim": t["joint_attention_dim"], "num_heads":
           t["num_attention_heads"], "hidden_size": t["num_attention_heads"] * t["attention_head_dim"],
           "depth": t["num_layers"], "depth_single_blocks": t["num_single_layers"], "axes_dim":
           list(t["axes_dims_rope"]), "mlp_ratio": t["mlp_ratio"], "use_guidance_embed": True}  # fmt: skip
    autoencoder = {"ch": boc[0], "ch_mult": [b // boc[0] for b in boc], "num_res_blocks": ae.TINY["layers_per_block"],
                   "z_channels": ae.TINY["latent_channels"]}  # fmt: skip
    config = {"family": "flux2", "files": {k: Path(v).name for k, v in files.items()}, "dit": dit, "ae": autoencoder,
              "groups": ae.TINY["norm_num_groups"], "mistral3": {"text": text, "vision": vision}}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


QWEN3_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "max_window_layers", "max_position_embeddings")  # fmt: skip


def stable_cascade(out: Path) -> None:
    """Stable Cascade stage C: ``stage_c`` (Stability's names, the family's single-file save), ``text_model``
    (CLIP-bigG with projection, transformers names), ``effnet`` (``backbone.*`` / ``mapper.*``) written by the
    family's own tiny builder, and tiny_config.json: sd-scripts' stable-cascade branch's ``StageC`` keyword
    arguments, the CLIP text config and the EfficientNet stages and head width (run_reference_tiny.py's
    ``patch_stable_cascade``)."""
    import dataclasses

    from library.families.stable_cascade import STABLE_CASCADE
    from library.families.stable_cascade import effnet as E
    from library.families.stable_cascade import tiny as tiny_mod

    parts = STABLE_CASCADE.tiny.build(seed=0)
    files = STABLE_CASCADE.tiny.write_files(parts, out, "tiny")
    STABLE_CASCADE.save(parts, out / "tiny_stage_c.safetensors")
    files["previewer"].unlink()
    p = tiny_mod.part_configs()["prior"]
    kinds = {"SDCascadeResBlock": "C", "SDCascadeTimestepBlock": "T", "SDCascadeAttnBlock": "A"}
    stage_c = dict(c_in=p["in_channels"], c_out=p["out_channels"], c_r=p["timestep_ratio_embedding_dim"],
                   patch_size=p["patch_size"], c_cond=p["conditioning_dim"], c_hidden=p["block_out_channels"],
                   nhead=p["num_attention_heads"],
                   blocks=[p["down_num_layers_per_block"], p["up_num_layers_per_block"]],
                   block_repeat=[p["down_blocks_repeat_mappers"], p["up_blocks_repeat_mappers"]],
                   level_config=["".join(kinds[b] for b in level) for level in p["block_types_per_layer"]],
                   c_clip_text=p["clip_text_in_channels"], c_clip_text_pooled=p["clip_text_pooled_in_channels"],
                   c_clip_img=p["clip_image_in_channels"], c_clip_seq=p["clip_seq"], kernel_size=p["kernel_size"],
                   dropout=p["dropout"], self_attn=p["self_attn"], t_conds=p["timestep_conditioning_type"],
                   switch_level=p["switch_level"])  # fmt: skip
    text_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "projection_dim",
                 "hidden_act")  # fmt: skip
    text = {k: getattr(parts.text_encoders[0].config, k) for k in text_keys}
    config = {"family": "stable_cascade", "stage_c": stage_c, "text_model": text,
              "effnet": {"stages": [dataclasses.astuple(s) for s in E.tiny_stages()], "head": tiny_mod.TINY_HEAD}}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def wuerstchen(out: Path) -> None:
    """Würstchen 2: ``prior/`` (the family's tiny prior pipeline folder: ``prior/``, ``text_encoder/``,
    ``tokenizer/``, ``scheduler/``), ``model_v2_stage_b.pt`` (``effnet_state_dict``: the tiny EfficientNet stages
    with the 1280-wide head the branch's ``EfficientNetEncoder()`` hard-codes, the affine mapper BatchNorm), a
    ``WuerstchenCombinedPipeline`` folder ``combined/`` (the family's tiny decoder, vqgan and CLIP-L with the tiny
    prior: what the branch's final save loads as ``--pretrained_decoder_model_name_or_path``) and tiny_config.json
    (run_reference_tiny.py's ``patch_wuerstchen``)."""
    import dataclasses
    import shutil

    import torch
    from diffusers import WuerstchenCombinedPipeline

    from library.families.stable_cascade import WUERSTCHEN
    from library.families.stable_cascade import effnet as E
    from library.families.stable_cascade.effnet import HEAD_WIDTH
    from library.families.stable_cascade.wuerstchen_decoder import load_decoder, write_tiny_decoder

    parts = WUERSTCHEN.tiny.build(seed=0)
    WUERSTCHEN.tiny.write_folder(parts, out / "prior")
    torch.manual_seed(1)
    effnet = E.EfficientNetEncoder(16, E.tiny_stages(), HEAD_WIDTH, affine=True).eval()
    with torch.no_grad():
        for m in effnet.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    torch.save({"effnet_state_dict": effnet.state_dict()}, out / "model_v2_stage_b.pt")
    decoder = load_decoder(str(write_tiny_decoder(out / "decoder")))
    prior = WUERSTCHEN.prior_pipeline(parts)
    combined = WuerstchenCombinedPipeline(
        tokenizer=decoder.tokenizer, text_encoder=decoder.text_encoder, decoder=decoder.decoder,
        scheduler=decoder.scheduler, vqgan=decoder.vqgan, prior_tokenizer=prior.tokenizer,
        prior_text_encoder=prior.text_encoder, prior_prior=prior.prior, prior_scheduler=prior.scheduler)  # fmt: skip
    combined.save_pretrained(out / "combined")
    shutil.rmtree(out / "decoder")
    for folder in (out / "prior" / "text_encoder", out / "combined" / "text_encoder"):
        _clip_release_names(folder / "model.safetensors")
    index = json.loads((out / "combined" / "model_index.json").read_text())
    for name, entry in index.items():  # the module the reference's diffusers (0.32) keeps them in
        if isinstance(entry, list) and entry[1] in ("WuerstchenDiffNeXt", "PaellaVQModel", "WuerstchenPrior"):
            index[name] = ["wuerstchen", entry[1]]
    index["prior_tokenizer"] = ["transformers", "PreTrainedTokenizerFast"]  # the class the branch loads and passes
    index["tokenizer"] = ["transformers", "CLIPTokenizerFast"]  # the folder has tokenizer.json alone
    (out / "combined" / "model_index.json").write_text(json.dumps(index, indent=1))
    config = {"family": "wuerstchen", "effnet": {"stages": [dataclasses.astuple(s) for s in E.tiny_stages()],
              "head": HEAD_WIDTH, "file": "model_v2_stage_b.pt"}, "decoder": "combined"}  # fmt: skip
    (out / "tiny_config.json").write_text(json.dumps(config, indent=1))


def _pixart(variant: str, out: Path) -> None:
    """PixArt-α / Σ: the family's tiny diffusers pipeline folder (``transformer/``, ``text_encoder/``, ``tokenizer/``,
    ``vae/``, ``scheduler/``), which OneTrainer's PixArt loader and ours both read."""
    from library.families import get_family

    tiny = get_family(variant).tiny
    tiny.write_folder(tiny.build(seed=0), out)


def pixart_sigma(out: Path) -> None:
    _pixart("pixart_sigma", out)


def pixart_alpha(out: Path) -> None:
    _pixart("pixart_alpha", out)


def _clip_release_names(path: Path) -> None:
    """A CLIP text model written by transformers 5's ``save_pretrained`` (``embeddings.*``, ``encoder.*``,
    ``final_layer_norm.*``) under the released files' names (``text_model.`` + those), which transformers 4 needs:
    without them it loads nothing and initialises the model at random (the family's own save writes them already)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    save_file({k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in state.items()}, str(path))


def _qwen3_tokenizer(folder: Path) -> None:
    """The shipped Qwen3 vocabulary and Qwen3's chat template (musubi-tuner reads Qwen/Qwen3-4B's from the hub)."""
    from library.families.encoders import qwen3

    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((qwen3.bundled_folder() / "tokenizer.json").read_bytes())
    (folder / "chat_template.jinja").write_text(qwen3.chat_template(), encoding="utf-8")


def _qwen_text() -> dict:
    from library.families.encoders import qwen25vl

    return {k: qwen25vl.TINY_TEXT[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "max_window_layers",
                                               "rope_scaling")}  # fmt: skip


def get_family_tiny(name: str):
    from library.families import get_family

    return get_family(name).tiny


BUILDERS = {
    "sd3": sd3,
    "anima": anima,
    "lumina": lumina,
    "flux": flux,
    "chroma": chroma,
    "hunyuan_image": hunyuan_image,
    "qwen_image": qwen_image,
    "zimage": zimage,
    "flux2": flux2,
    "qwen_image_edit": qwen_image_edit,
    "flux2_dev": flux2_dev,
    "stable_cascade": stable_cascade,
    "wuerstchen": wuerstchen,
    "pixart_sigma": pixart_sigma,
    "pixart_alpha": pixart_alpha,
}


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
