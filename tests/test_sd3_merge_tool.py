"""tools/merge_sd3_safetensors.py (sd-scripts' flags): the parts land under their SAI prefixes bit for bit (or cast
by --save_precision), the --dit file's metadata is kept, a later part replaces the keys it shares, the streamed
file is what safetensors itself reads, and every wrong input is named before anything is written."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tools import merge_sd3_safetensors as tool


def _part(seed: int, keys: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(3, 2 + i % 3, generator=g) for i, k in enumerate(keys)}


@pytest.fixture()
def parts(tmp_path):
    """Small stand-ins with the key names of each part: an MMDiT (bare SAI names) with its VAE inside, a VAE,
    CLIP-L / CLIP-G / T5 with transformers' names (plus an int tensor, which --save_precision leaves alone)."""
    dit = _part(0, ["x_embedder.proj.weight", "joint_blocks.0.x_block.attn.qkv.weight", "final_layer.linear.weight"])
    dit["first_stage_model.decoder.conv_in.weight"] = torch.zeros(2, 2)  # a VAE inside the --dit file
    vae = _part(1, ["decoder.conv_in.weight", "encoder.down.0.block.0.conv1.weight"])
    clip = ["text_model.embeddings.token_embedding.weight", "text_model.final_layer_norm.weight"]
    clip_l, clip_g = _part(2, clip), _part(3, [*clip, "text_projection.weight"])
    clip_l["text_model.embeddings.position_ids"] = torch.arange(7).view(1, 7)
    t5 = _part(4, ["encoder.block.0.layer.0.SelfAttention.q.weight", "shared.weight"])
    files = {}
    for name, sd in (("dit", dit), ("vae", vae), ("clip_l", clip_l), ("clip_g", clip_g), ("t5xxl", t5)):
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(sd, str(files[name]), metadata={"modelspec.title": "tiny"} if name == "dit" else None)
    return files, {"dit": dit, "vae": vae, "clip_l": clip_l, "clip_g": clip_g, "t5xxl": t5}


def _argv(files, out):
    return ["--dit", str(files["dit"]), "--vae", str(files["vae"]), "--clip_l", str(files["clip_l"]), "--clip_g",
            str(files["clip_g"]), "--t5xxl", str(files["t5xxl"]), "--output", str(out)]  # fmt: skip


def test_parts_land_under_their_sai_prefixes_bit_for_bit(parts, tmp_path):
    files, sds = parts
    out = tmp_path / "all.safetensors"
    assert tool.main(_argv(files, out)) == 0
    merged = load_file(str(out))  # safetensors' own reader: the streamed header and offsets are valid
    expected = {}
    for flag, sd in sds.items():
        prefix = tool.PARTS[flag][0]
        for k, v in sd.items():
            expected[k if k.startswith(tool.SAI_PREFIXES) else prefix + k] = v
    assert set(merged) == set(expected)
    for k, v in expected.items():
        assert merged[k].dtype == v.dtype and torch.equal(merged[k], v), k
    # --vae came after --dit: the VAE inside the --dit file was replaced (zeros there, random in --vae)
    assert torch.equal(merged["first_stage_model.decoder.conv_in.weight"], sds["vae"]["decoder.conv_in.weight"])
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"modelspec.title": "tiny"}
    assert not list(tmp_path.glob(".all.safetensors.*"))  # the temporary file was renamed onto --output


def test_save_precision_casts_floating_tensors_only(parts, tmp_path):
    files, sds = parts
    out = tmp_path / "bf16.safetensors"
    assert tool.main([*_argv(files, out), "--save_precision", "bfloat16"]) == 0
    merged = load_file(str(out))
    w = merged["text_encoders.clip_l.transformer.text_model.final_layer_norm.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, sds["clip_l"]["text_model.final_layer_norm.weight"].to(torch.bfloat16))
    ids = merged["text_encoders.clip_l.transformer.text_model.embeddings.position_ids"]
    assert ids.dtype == torch.int64 and torch.equal(ids, torch.arange(7).view(1, 7))
    out8 = tmp_path / "fp8.safetensors"
    assert tool.main([*_argv(files, out8), "--save_precision", "fp8"]) == 0
    w8 = load_file(str(out8))["model.diffusion_model.x_embedder.proj.weight"]
    assert w8.dtype == torch.float8_e4m3fn
    assert torch.equal(w8.float(), sds["dit"]["x_embedder.proj.weight"].to(torch.float8_e4m3fn).float())


def test_dit_alone_and_an_sai_file_as_dit(parts, tmp_path):
    """Without the other flags only the --dit file's keys are written; an SAI file given as --dit keeps its
    prefixed keys (its encoders are not put under model.diffusion_model.)."""
    files, sds = parts
    one = tmp_path / "one.safetensors"
    assert tool.main(["--dit", str(files["dit"]), "--output", str(one)]) == 0
    assert set(load_file(str(one))) == {k if k.startswith("first_stage") else "model.diffusion_model." + k
                                        for k in sds["dit"]}  # fmt: skip
    all_ = tmp_path / "all.safetensors"
    assert tool.main(_argv(files, all_)) == 0
    again = tmp_path / "again.safetensors"
    assert tool.main(["--dit", str(all_), "--output", str(again)]) == 0
    a, b = load_file(str(all_)), load_file(str(again))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_wrong_inputs_are_named_before_anything_is_written(parts, tmp_path, capsys):
    files, _ = parts
    out = tmp_path / "never.safetensors"
    # every problem at once: a missing file, a CLIP file given as T5, a VAE given as the MMDiT
    argv = ["--dit", str(files["vae"]), "--clip_l", str(tmp_path / "nope.safetensors"), "--t5xxl",
            str(files["clip_l"]), "--output", str(out)]  # fmt: skip
    assert tool.main(argv) == 2
    err = capsys.readouterr().err
    assert "--dit" in err and "x_embedder.proj.weight" in err
    assert "--clip_l" in err and "no such file" in err
    assert "--t5xxl" in err and "T5-XXL" in err
    assert tool.main(["--dit", str(files["dit"]), "--output", str(tmp_path / "x.ckpt")]) == 2
    assert "--output" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "x.ckpt").exists()
    with pytest.raises(SystemExit):  # argparse: a precision sd-scripts has but safetensors cannot store
        tool.build_parser().parse_args(["--dit", "x", "--save_precision", "fp8_e4m3fnuz"])


def test_diffusers_single_file_loaders_read_every_part_back(tmp_path):
    """Tiny real parts (an SD3.5-medium MMDiT in SAI names from keys.py, the 16-channel AE in ldm names, CLIP-L and
    CLIP-G of different widths and T5 in transformers' names) merged into one file: diffusers' own single-file
    loaders (``from_single_file``, ``create_diffusers_clip_model_from_ldm``,
    ``create_diffusers_t5_model_from_checkpoint``) read each part back equal to what went in."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        create_diffusers_clip_model_from_ldm,
        create_diffusers_t5_model_from_checkpoint,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from library.families.convert import vae_to_ldm
    from library.families.flux.tiny import tiny_ae
    from library.families.sd3.keys import diffusers_to_sai

    torch.manual_seed(0)
    dit = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
                                num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                pooled_projection_dim=64, out_channels=16, pos_embed_max_size=16,
                                dual_attention_layers=(0,), qk_norm="rms_norm")  # fmt: skip
    vae = tiny_ae()
    clips = {name: CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=100, hidden_size=width, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, projection_dim=width)) for name, width in (("clip_l", 32), ("clip_g", 48))}  # fmt: skip
    t5 = T5EncoderModel(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                 feed_forward_proj="gated-gelu"))  # fmt: skip
    models = {"dit": dit, "vae": vae, **clips, "t5xxl": t5}
    files = {name: tmp_path / f"{name}.safetensors" for name in models}
    save_file(diffusers_to_sai(dit.state_dict()), str(files["dit"]))
    save_file(vae_to_ldm(vae.state_dict(), vae.config), str(files["vae"]))
    for name in ("clip_l", "clip_g", "t5xxl"):
        save_file({k: v.clone().contiguous() for k, v in models[name].state_dict().items()}, str(files[name]))
    for name, model in models.items():
        model.save_pretrained(tmp_path / f"{name}_config")
    out = tmp_path / "sd3_all.safetensors"
    assert tool.main(_argv(files, out)) == 0
    merged = load_file(str(out))
    config = {name: str(tmp_path / f"{name}_config") for name in models}
    back = {
        "dit": SD3Transformer2DModel.from_single_file(str(out), config=config["dit"]),
        "vae": AutoencoderKL.from_single_file(str(out), config=config["vae"]),
        "t5xxl": create_diffusers_t5_model_from_checkpoint(
            T5EncoderModel, merged, config=config["t5xxl"], local_files_only=True
        ),  # fmt: skip
        **{
            name: create_diffusers_clip_model_from_ldm(
                CLIPTextModelWithProjection, merged, config=config[name], local_files_only=True
            )
            for name in clips
        },  # fmt: skip
    }
    for name, model in models.items():
        theirs = back[name].state_dict()
        for key, value in model.state_dict().items():
            if name == "clip_l" and key == "text_projection.weight":
                continue  # diffusers sets SD3's CLIP-L projection to the identity, whatever the file holds
            assert torch.equal(theirs[key], value), f"{name}: {key}"


@pytest.mark.parametrize("variant", ["sd3.5-medium"])
def test_our_sd3_loader_reads_the_merged_file_as_the_parts(tmp_path, variant):
    """The tiny SD3 files users have (the SAI file with its VAE but no encoders, and --clip_l --clip_g --t5xxl)
    merged into one file: the SD3 family loads it alone to the same weights as the tiny model the files came from,
    and detects the variant from it."""
    from library.families import detect_family, get_family
    from library.families.sd3.tiny import build_tiny_sd3, write_tiny_files

    parts = build_tiny_sd3(variant)
    files = write_tiny_files(parts, tmp_path / "files", text_encoders=False)
    out = tmp_path / "merged.safetensors"
    argv = ["--dit", str(files["model"]), "--clip_l", str(files["clip_l"]), "--clip_g", str(files["clip_g"]),
            "--t5xxl", str(files["t5xxl"]), "--output", str(out)]  # fmt: skip
    assert tool.main(argv) == 0
    assert detect_family(str(out)).name == variant
    loaded = get_family(variant).load(str(out))
    pairs = [(parts.denoiser, loaded.denoiser), (parts.vae, loaded.vae)]
    pairs += list(zip(parts.text_encoders, loaded.text_encoders, strict=True))
    for want, got in pairs:
        theirs = got.state_dict()
        for key, value in want.state_dict().items():
            assert torch.equal(theirs[key], value), f"{type(want).__name__}: {key}"
