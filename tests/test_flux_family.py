"""The FLUX.1 dev / schnell and Chroma family against independent oracles: diffusers' single-file converters at the
real width (index tensors, no memory), sd-scripts' BFL_TO_DIFFUSERS_MAP (re-typed from library/flux_utils.py),
diffusers' FluxPipeline (packing, ids, timestep, guidance, text encoding: one Euler step), sd-scripts' Chroma text
trimming, the shipped T5 vocabulary read by ``tokenizers`` itself, and load/save round trips of every input layout
(tiny files written here from the tiny models through the inverse maps)."""

from __future__ import annotations

import gzip
import re

import pytest
import torch
from safetensors.torch import save_file

from library.families import FAMILIES, Cond, block_layout, detect_family
from library.families.convert import vae_to_ldm
from library.families.encoders.t5 import T5_TOKENIZER_FILE
from library.families.flux import CHROMA, FLUX_DEV, FLUX_SCHNELL
from library.families.flux import keys as K
from library.families.flux import latents as L
from library.families.flux.options import FluxOptions
from library.families.flux.tiny import build_tiny_flux, write_tiny_files
from library.families.protocol import missing_members
from library.families.sd import SDXL
from library.files.weights import read_metadata

VARIANTS = {"flux-dev": FLUX_DEV, "flux-schnell": FLUX_SCHNELL, "chroma": CHROMA}


@pytest.fixture(scope="module")
def tiny():
    return {name: build_tiny_flux(name) for name in VARIANTS}


def _states_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k].float(), sb[k].float()), k


# ------------------------------------------------------------------------------------------------ key maps
@pytest.mark.parametrize("family", [FLUX_DEV, CHROMA], ids=lambda f: f.name)
def test_bfl_map_equals_diffusers_converter_at_real_width(family):
    from accelerate import init_empty_weights
    from diffusers.loaders import single_file_utils as sfu

    from library.families.flux.configs import released, transformer_factory

    with init_empty_weights():
        real = transformer_factory(released(family.name)["transformer"])()  # 19 / 38 blocks, width 3072, meta
    wanted = real.state_dict()
    # one index tensor per BFL key: (key number, row) identifies every row; width 1 so no real-size copies
    bfl = {}
    for i, (key, value) in enumerate(K.diffusers_to_bfl(wanted).items()):
        rows = i * 10**6 + torch.arange(value.shape[0], dtype=torch.float64)
        bfl[K.BFL_PREFIX + key] = rows.view(-1, 1) if value.ndim == 2 else rows
    convert = (sfu.convert_chroma_transformer_checkpoint_to_diffusers if family is CHROMA else
               sfu.convert_flux_transformer_checkpoint_to_diffusers)  # fmt: skip
    theirs_input = dict(bfl)
    theirs = convert(theirs_input)
    assert theirs_input == {}  # the converter consumed every BFL key we name
    ours = K.bfl_to_diffusers(bfl)
    assert set(ours) == set(theirs) == set(wanted)
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
        assert ours[key].shape[0] == wanted[key].shape[0], key
    assert K.bfl_layout(bfl).variant == (K.CHROMA if family is CHROMA else K.FLUX)


# sd-scripts v0.10.1 library/flux_utils.py BFL_TO_DIFFUSERS_MAP, re-typed ("()" = the block number)
SD_SCRIPTS_MAP = {
    "time_in.in_layer": ["time_text_embed.timestep_embedder.linear_1"],
    "time_in.out_layer": ["time_text_embed.timestep_embedder.linear_2"],
    "vector_in.in_layer": ["time_text_embed.text_embedder.linear_1"],
    "vector_in.out_layer": ["time_text_embed.text_embedder.linear_2"],
    "guidance_in.in_layer": ["time_text_embed.guidance_embedder.linear_1"],
    "guidance_in.out_layer": ["time_text_embed.guidance_embedder.linear_2"],
    "txt_in": ["context_embedder"],
    "img_in": ["x_embedder"],
    "double_blocks.().img_mod.lin": ["norm1.linear"],
    "double_blocks.().txt_mod.lin": ["norm1_context.linear"],
    "double_blocks.().img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "double_blocks.().txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "double_blocks.().img_mlp.0": ["ff.net.0.proj"],
    "double_blocks.().img_mlp.2": ["ff.net.2"],
    "double_blocks.().txt_mlp.0": ["ff_context.net.0.proj"],
    "double_blocks.().txt_mlp.2": ["ff_context.net.2"],
    "double_blocks.().img_attn.proj": ["attn.to_out.0"],
    "double_blocks.().txt_attn.proj": ["attn.to_add_out"],
    "single_blocks.().modulation.lin": ["norm.linear"],
    "single_blocks.().linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
    "single_blocks.().linear2": ["proj_out"],
    "final_layer.linear": ["proj_out"],
    "final_layer.adaLN_modulation.1": ["norm_out.linear"],
}  # (weight and bias each; the norms: "<bfl>.scale" -> "<diffusers>.weight")
SD_SCRIPTS_NORMS = {
    "double_blocks.().img_attn.norm.query_norm": "attn.norm_q",
    "double_blocks.().img_attn.norm.key_norm": "attn.norm_k",
    "double_blocks.().txt_attn.norm.query_norm": "attn.norm_added_q",
    "double_blocks.().txt_attn.norm.key_norm": "attn.norm_added_k",
    "single_blocks.().norm.query_norm": "attn.norm_q",
    "single_blocks.().norm.key_norm": "attn.norm_k",
}


def test_bfl_map_names_the_pairs_of_sd_scripts_map():
    def expand(bfl: str, diffusers: list[str], block: int) -> tuple[str, tuple[str, ...]]:
        prefix = "transformer_blocks." if bfl.startswith("double") else "single_transformer_blocks."
        inside = bfl.startswith(("double", "single"))
        return bfl.replace("()", str(block)), tuple((f"{prefix}{block}." if inside else "") + d for d in diffusers)

    theirs = set()
    for block in range(2):
        for bfl, diffusers in SD_SCRIPTS_MAP.items():
            for p in ("weight", "bias"):
                name, targets = expand(bfl, diffusers, block)
                theirs.add((f"{name}.{p}", tuple(f"{t}.{p}" for t in targets)))
        for bfl, d in SD_SCRIPTS_NORMS.items():
            name, targets = expand(bfl, [d], block)
            theirs.add((f"{name}.scale", (f"{targets[0]}.weight",)))
    layout = K.Layout(K.FLUX, 2, 2, True)
    ours = {(f"{e.bfl}.{b}", tuple(f"{m}.{d}" for m in e.diffusers)) for e in layout.table for b, d in e.params}
    assert ours == theirs


@pytest.mark.parametrize("name", list(VARIANTS))
def test_diffusers_bfl_diffusers_round_trip_is_exact(tiny, name):
    state = tiny[name].denoiser.state_dict()
    bfl = K.diffusers_to_bfl(state, prefix=K.BFL_PREFIX)
    assert K.is_bfl(bfl) and K.variant_name(K.bfl_layout(bfl)) == name.removeprefix("flux-")
    back = K.bfl_to_diffusers(bfl)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


# ------------------------------------------------------------------------------------------------ files
def _write_parts(parts, tmp_path, **layout):
    return write_tiny_files(parts, tmp_path, **layout)


@pytest.mark.parametrize(
    "name,layout",
    [
        ("flux-dev", dict()),
        ("flux-schnell", dict(prefix=K.BFL_PREFIX, fp8=True, clip_prefixed=False, t5_encoder_only=True, ae_ldm=False)),
        ("chroma", dict(prefix=K.BFL_PREFIX)),
    ],
)
def test_bfl_file_with_part_files_loads_exactly(tiny, tmp_path, name, layout):
    parts, family = tiny[name], VARIANTS[name]
    files = _write_parts(parts, tmp_path, **layout)
    assert detect_family(files["model"]) is family
    extra = {k: files[k] for k in ("clip_l", "t5xxl", "ae") if k in files}
    options = dict(t5xxl_max_token_length=64, apply_t5_attn_mask=True) if name == "flux-dev" else {}
    loaded = family.load(files["model"], options=FluxOptions(**extra, **options))
    assert loaded.family == name and not any(p.requires_grad for p in loaded.denoiser.parameters())
    with torch.no_grad():  # the prompt settings given at load time are the loaded model's (Chroma: always masked)
        cond = family.encode_prompt(loaded, ["a cat"])
    length = {"flux-dev": 64, "flux-schnell": 256, "chroma": 512}[name]
    assert cond.hidden_states.shape[1] == length and (cond.mask is None) == (name == "flux-schnell")
    if layout.get("fp8"):  # float8_e4m3fn tensors are upcast to the load dtype
        ref = {k: v.to(torch.float8_e4m3fn).float() for k, v in parts.denoiser.state_dict().items()}
        got = loaded.denoiser.state_dict()
        assert got[next(iter(got))].dtype == torch.float32 and all(torch.equal(got[k], ref[k]) for k in ref)
    else:
        _states_equal(loaded.denoiser, parts.denoiser)
    _states_equal(loaded.vae, parts.vae)
    for a, b in zip(loaded.text_encoders, parts.text_encoders, strict=True):
        _states_equal(a, b)
    # a part missing from the command line is named before anything is loaded
    with pytest.raises(ValueError, match="--ae is required"):
        family.load(files["model"], options=FluxOptions(**{k: v for k, v in extra.items() if k != "ae"}))
    with pytest.raises(ValueError, match="--t5xxl"):
        family.load(files["model"], options=FluxOptions(ae=files["ae"]))
    with pytest.raises(ValueError, match=r"--ae .*t5xxl\.safetensors: no AE weights"):
        family.load(
            files["model"], options=FluxOptions(**dict(extra, ae=files["t5xxl"]))
        )  # the wrong file for a part is named
    if name == "chroma":  # a diffusers ChromaPipeline folder: written, read by diffusers' layout, reloaded
        folder = family.save(loaded, tmp_path / "chroma")
        assert detect_family(folder) is CHROMA and (folder / "text_encoder" / "config.json").is_file()
        again = family.load(folder)
        for a, b in zip(
            (again.denoiser, again.vae, *again.text_encoders), (loaded.denoiser, loaded.vae, *loaded.text_encoders)
        ):
            _states_equal(a, b)


def test_diffusers_transformer_file_folder_and_bfl_save_round_trip(tiny, tmp_path):
    from diffusers import FluxPipeline

    parts = tiny["flux-dev"]
    files = _write_parts(parts, tmp_path)
    parts_files = {k: files[k] for k in ("clip_l", "t5xxl", "ae")}
    diffusers_file = tmp_path / "transformer.safetensors"  # a diffusers FluxTransformer2DModel single file
    save_file(parts.denoiser.state_dict(), diffusers_file)
    assert detect_family(diffusers_file) is FLUX_DEV
    _states_equal(FLUX_DEV.load(diffusers_file, options=FluxOptions(**parts_files)).denoiser, parts.denoiser)

    folder = FLUX_DEV.save(parts, tmp_path / "folder")  # a full diffusers FLUX folder
    assert detect_family(folder) is FLUX_DEV
    theirs = FluxPipeline.from_pretrained(folder)  # diffusers reads what we wrote
    _states_equal(theirs.transformer, parts.denoiser)
    loaded = FLUX_DEV.load(folder)
    for a, b in zip(
        (loaded.denoiser, loaded.vae, *loaded.text_encoders), (parts.denoiser, parts.vae, *parts.text_encoders)
    ):
        _states_equal(a, b)
    assert loaded.tokenizers[1]("a cat").input_ids == parts.tokenizers[1]("a cat").input_ids
    with pytest.raises(ValueError, match="flux-dev model, but flux-schnell"):
        FLUX_SCHNELL.load(folder)
    assert detect_family(folder / "transformer") is FLUX_DEV  # a transformer folder alone, with the part files
    _states_equal(FLUX_DEV.load(folder / "transformer", options=FluxOptions(**parts_files)).denoiser, parts.denoiser)
    with pytest.raises(ValueError, match="--ae, --clip_l, --t5xxl are required"):
        FLUX_DEV.load(folder / "transformer")

    single = FLUX_DEV.save(parts, tmp_path / "saved.safetensors")  # what flux_train.py writes: BFL keys only
    meta = read_metadata(single)
    assert meta["modelspec.architecture"] == "flux-1-dev" and meta["sdtrain.family"] == "flux-dev"
    again = FLUX_DEV.load(single, options=FluxOptions(**parts_files))
    _states_equal(again.denoiser, parts.denoiser)
    with pytest.raises(ValueError, match="not pickles"):
        FLUX_DEV.save(parts, tmp_path / "x.ckpt")


def test_detection_keeps_sd_files_and_tells_flux_variants_apart(tiny, tiny_parts, tmp_path):
    for name, parts in tiny.items():
        sd = K.diffusers_to_bfl(parts.denoiser.state_dict())
        assert detect_family(sd) is VARIANTS[name]
    sdxl_file = SDXL.save(tiny_parts["sdxl"], tmp_path / "sdxl.safetensors")
    assert detect_family(sdxl_file).name == "sdxl"
    with pytest.raises(ValueError, match="no FLUX.1 / Chroma transformer found"):
        FLUX_DEV.load(sdxl_file, options=FluxOptions(clip_l=sdxl_file, t5xxl=sdxl_file, ae=sdxl_file))
    lora_names = ["lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_3_linear1"]
    assert block_layout(lora_names) is FLUX_DEV.blocks and not SDXL.blocks.names_match(lora_names[0])
    assert block_layout(["lora_unet_input_blocks_4_1_proj_in"]) is SDXL.blocks
    assert [FLUX_DEV.blocks.index(n) for n in lora_names] == [0, 19 + 3]


# ------------------------------------------------------------------------------------------------ text
def test_t5_tokenizer_is_shipped_and_tokenizes_like_the_vocabulary_file(tiny, tmp_path):
    from tokenizers import Tokenizer

    raw = tmp_path / "tokenizer.json"
    raw.write_bytes(gzip.decompress(T5_TOKENIZER_FILE.read_bytes()))
    reference = Tokenizer.from_file(str(raw))  # the vocabulary data itself, no transformers
    captions = ["a photo of a cat", "Hello, wörld! 123"]
    parts = tiny["flux-dev"]
    clip_ids, t5_ids, mask = FLUX_DEV.tokenize(parts, captions)
    assert clip_ids.shape == (2, 77) and t5_ids.shape == mask.shape == (2, 512)
    for row, m, caption in zip(t5_ids, mask, captions):
        ids = reference.encode(caption).ids  # ends with </s> (id 1)
        assert (
            ids[-1] == 1
            and row.tolist() == ids + [0] * (512 - len(ids))
            and m.tolist() == [1] * len(ids) + [0] * (512 - len(ids))
        )
    assert FLUX_SCHNELL.tokenize(tiny["flux-schnell"], captions)[1].shape == (2, 256)
    assert FLUX_DEV.tokenize(parts, captions, t5xxl_max_token_length=8)[1][0, -1].item() == 1  # truncated, </s> kept


def test_encoding_and_prediction_equal_flux_pipeline_one_euler_step(tiny):
    parts = tiny["flux-dev"]
    pipe = FLUX_DEV.pipeline(parts, None)
    torch.manual_seed(1)
    noisy = torch.randn(1, 16, 8, 12)
    packed = pipe._pack_latents(noisy, 1, 16, 8, 12)
    with torch.no_grad():
        out = pipe(prompt="a photo of a cat", num_inference_steps=1, guidance_scale=2.5, latents=packed.clone(),
                   height=64, width=96, output_type="latent", max_sequence_length=512).images  # fmt: skip
        cond = FLUX_DEV.encode_prompt(parts, ["a photo of a cat"])
        v = FLUX_DEV.predict(parts.denoiser, noisy, torch.tensor([1000.0]), cond, guidance=2.5)
        # one step from sigma 1 to 0: x - v (the pipeline packs and unpacks with its own helpers)
        expected = pipe._unpack_latents(out, 64, 96, pipe.vae_scale_factor)
        assert (noisy - v - expected).abs().max() < 1e-5
        other = FLUX_DEV.predict(parts.denoiser, noisy, torch.tensor([1000.0]), cond, guidance=torch.tensor([7.0]))
        assert (other - v).abs().max() > 1e-3  # the guidance option reaches the model (dev)
    assert torch.equal(L.unpack(L.pack(noisy), 8, 12), noisy)
    assert torch.equal(L.image_ids(8, 12), pipe._prepare_latent_image_ids(1, 4, 6, "cpu", torch.float32))


def test_t5_mask_hides_padding_from_the_transformer(tiny):
    parts = tiny["flux-dev"]
    with torch.no_grad():
        cond = FLUX_DEV.encode_prompt(parts, ["a cat"], t5xxl_max_token_length=16, apply_t5_attn_mask=True)
        n = int(cond.mask.sum())
        noisy, t = torch.randn(1, 16, 4, 4), torch.tensor([700.0])
        masked = FLUX_DEV.predict(parts.denoiser, noisy, t, cond)
        # key masking == the text cut after its last token (text position ids are all zero)
        cut = FLUX_DEV.predict(parts.denoiser, noisy, t, Cond(cond.hidden_states[:, :n], cond.pooled))
        unmasked = FLUX_DEV.predict(parts.denoiser, noisy, t, Cond(cond.hidden_states, cond.pooled))
    assert (masked - cut).abs().max() < 1e-5 and (masked - unmasked).abs().max() > 1e-4
    moved = cond.to("cpu", torch.float64)
    assert moved.hidden_states.dtype == torch.float64 and moved.mask.dtype == cond.mask.dtype


def test_chroma_encodes_like_chroma_pipeline_and_masks_like_sd_scripts(tiny):
    parts = tiny["chroma"]
    pipe = CHROMA.pipeline(parts, None)
    with torch.no_grad():
        embeds, pipe_mask = pipe._get_t5_prompt_embeds(["a photo of a cat"], max_sequence_length=512, device="cpu")
        cond = CHROMA.encode_prompt(parts, ["a photo of a cat"])
        assert cond.pooled is None and torch.equal(cond.hidden_states, embeds)
        noisy, t = torch.randn(1, 16, 4, 4), torch.tensor([300.0])
        seen = []  # the text rows the transformer computes
        hook = parts.denoiser.context_embedder.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[1]))
        try:
            v = CHROMA.predict(parts.denoiser, noisy, t, cond)
            # two captions of different lengths: cut to the longer, the shorter one masked; each as alone
            pair = CHROMA.encode_prompt(parts, ["a photo of a cat", "a cat"])
            v2 = CHROMA.predict(parts.denoiser, noisy.expand(2, -1, -1, -1), t.expand(2), pair)
            alone = CHROMA.predict(parts.denoiser, noisy, t, CHROMA.encode_prompt(parts, ["a cat"]))
        finally:
            hook.remove()
        # sd-scripts' Chroma (chroma_models.py): the text is cut to its length + attn_padding 1, no mask
        n = int(cond.mask.sum()) + 1
        assert seen[:2] == [n, n] and seen[2] < n
        assert torch.equal(pipe_mask[0].bool(), torch.arange(512) < n)  # the pipeline attends the same tokens
        packed = L.pack(noisy)
        ref = parts.denoiser(hidden_states=packed, encoder_hidden_states=cond.hidden_states[:, :n], timestep=t / 1000,
                             img_ids=L.image_ids(4, 4), txt_ids=torch.zeros(n, 3), return_dict=False)[0]  # fmt: skip
        # every padded row, masked (the pipeline's way): the same velocity
        mask = torch.cat([pipe_mask.bool(), torch.ones(1, packed.shape[1], dtype=torch.bool)], dim=1)
        padded = parts.denoiser(hidden_states=packed, encoder_hidden_states=cond.hidden_states, timestep=t / 1000,
                                img_ids=L.image_ids(4, 4), txt_ids=torch.zeros(512, 3), attention_mask=mask,
                                return_dict=False)[0]  # fmt: skip
    assert (L.pack(v) - ref).abs().max() < 1e-5 and (L.pack(v) - padded).abs().max() < 1e-5
    torch.testing.assert_close(v2, torch.cat([v, alone]), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ latents
def test_latents_are_shifted_and_scaled(tiny):
    parts = tiny["flux-dev"]
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        z = FLUX_DEV.encode_latents(parts, pixels, torch.Generator().manual_seed(3))
        raw = parts.vae.encode(pixels).latent_dist.sample(torch.Generator().manual_seed(3))
        assert z.shape == (1, 16, 4, 4) and torch.allclose(z, (raw - 0.1159) * 0.3611)
        # FluxPipeline's decode: latents / scaling_factor + shift_factor
        expected = parts.vae.decode(z / parts.vae.config.scaling_factor + parts.vae.config.shift_factor).sample
        assert torch.allclose(FLUX_DEV.decode_latents(parts, z), expected.clamp(-1, 1))


# ------------------------------------------------------------------------------------------------ adapter names
@pytest.mark.parametrize("name", list(VARIANTS))
def test_adapter_roots_name_every_bfl_module_once_with_its_weight(tiny, name):
    parts, family = tiny[name], VARIANTS[name]
    roots = family.adapter_roots(parts)
    assert tuple(r.prefix for r in roots) == family.adapter_prefixes
    unet = roots[0]
    bfl = K.diffusers_to_bfl(parts.denoiser.state_dict())
    linears = {path: m for path, m in unet.module.named_modules() if isinstance(m, torch.nn.Linear)}
    named = {}
    for path, module in linears.items():
        try:
            named[unet.rename(path)] = module.weight
        except KeyError:
            pass
    for fused in unet.fused:
        named[fused.name] = torch.cat([linears[s.path].weight[s.start : s.stop] for s in fused.segments])
    bfl_linears = {k.removesuffix(".weight") for k, v in bfl.items() if k.endswith(".weight") and v.ndim == 2}
    assert set(named) == bfl_linears  # every BFL Linear exactly once: 1:1 renames and fused modules
    for module_name, weight in named.items():
        assert torch.equal(weight, bfl[module_name + ".weight"]), module_name
        # ComfyUI's rule: lora_unet_ + the BFL key with dots as underscores
        assert re.fullmatch(r"lora_unet_[A-Za-z0-9_]+", "lora_unet_" + module_name.replace(".", "_"))
    covered = {s.path for f in unet.fused for s in f.segments}
    assert all(path in covered or path in dict.fromkeys(linears) for path in covered)
    t5_root = roots[-1]
    assert t5_root.rename("encoder.block.0.layer.0.SelfAttention.q") == "encoder.block.0.layer.0.SelfAttention.q"
    if name != "chroma":
        assert roots[1].rename("encoder.layers.0.mlp.fc1").startswith("text_model.")


# ------------------------------------------------------------------------------------------------ contract
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_satisfies_the_family_contract(tiny, name):
    from tests.test_family_contract import signature_problems

    family = VARIANTS[name]
    assert FAMILIES[name] is family and missing_members(family) == [] and signature_problems(family) == []
    parts = tiny[name]
    assert family.objective(parts) == parts.prediction_type == "flow_matching"
    assert len(family.ti_embedding_keys) == family.num_text_encoders == len(parts.text_encoders)
    assert family.spec.training_script == "flux_train_network.py" and family.size_multiple == 16
    assert family.base_model_version() == ("chroma" if name == "chroma" else "flux1")
    arch = {"flux-dev": "flux-1-dev", "flux-schnell": "flux-1-schnell", "chroma": "chroma"}[name]
    assert family.modelspec_architecture("lora") == arch + "/lora" and family.default_resolution() == 1024
    assert family.size_conditioning(None, None, None) is None
    if name == "flux-schnell":
        return  # the released architecture is dev's without guidance_in (checked by the key-map tests)
    reference = family.reference_parts()
    assert reference.vae is None and {p.device.type for p in reference.denoiser.parameters()} == {"meta"}
    assert reference.denoiser.config.num_layers == 19 and reference.text_encoders[-1].config.d_model == 4096


def test_text_cache_entry_keeps_the_mask():
    from types import SimpleNamespace

    from library.run.train_step import batch_cond, text_cache_entry

    cond = Cond(torch.randn(2, 5, 4), torch.randn(2, 3), torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]))
    entry = text_cache_entry(cond)
    assert torch.equal(entry["mask"], cond.mask)
    m = SimpleNamespace(device=torch.device("cpu"), pad_tokens=True, train_text_encoder=False)
    back = batch_cond(m, SimpleNamespace(text_encoder_outputs=entry))
    assert torch.equal(back.mask, cond.mask) and torch.equal(back.hidden_states, cond.hidden_states)
    assert "mask" not in text_cache_entry(Cond(cond.hidden_states))


def test_ae_conversion_equals_diffusers_ldm_vae_converter_and_dtypes_per_part(tiny, tmp_path):
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    from library.families.base import PartDtypes

    parts = tiny["flux-dev"]
    files = _write_parts(parts, tmp_path)
    ldm = vae_to_ldm(parts.vae.state_dict(), parts.vae.config)
    theirs = convert_ldm_vae_checkpoint(dict(ldm), dict(parts.vae.config))  # diffusers' own reading of the BFL AE
    dtypes = PartDtypes(denoiser=torch.bfloat16, vae=torch.float32, text_encoders=torch.float16)
    loaded = FLUX_DEV.load(
        files["model"], dtype=dtypes, options=FluxOptions(clip_l=files["clip_l"], t5xxl=files["t5xxl"], ae=files["ae"])
    )
    ours = loaded.vae.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k].reshape(ours[k].shape)) for k in ours)
    assert {p.dtype for p in loaded.denoiser.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loaded.text_encoders[1].parameters()} == {torch.float16}
    want = parts.denoiser.state_dict()
    assert all(torch.equal(v, want[k].to(torch.bfloat16)) for k, v in loaded.denoiser.state_dict().items())


def test_sdxl_and_flux_adapter_files_are_told_apart_by_block_names():
    from types import SimpleNamespace

    from library.families import adapter_families, adapter_family_label
    from networks.merge import check_same_family

    def file(source, *names):
        return SimpleNamespace(source=source, modules=dict.fromkeys(names), metadata={})

    sdxl = ["lora_unet_input_blocks_4_1_proj_in", "lora_te1_text_model_encoder_layers_0_mlp_fc1"]
    flux = ["lora_unet_double_blocks_0_img_attn_qkv", "lora_te1_text_model_encoder_layers_0_mlp_fc1"]
    prefixes = {"lora_unet", "lora_te1"}  # the same prefixes: only the block names tell them apart
    assert adapter_families(prefixes, sdxl) == ["sdxl"]
    assert adapter_families(prefixes, flux) == ["flux-dev", "flux-schnell"]
    assert adapter_family_label(prefixes, flux) == "FLUX.1-dev/FLUX.1-schnell"
    both_sdxl = [file("a", *sdxl), file("b", *sdxl, "lora_te2_text_model_encoder_layers_0_mlp_fc1")]
    assert check_same_family(both_sdxl) == []
    problems = check_same_family([file("a", *sdxl), file("f", *flux)])
    assert len(problems) == 1 and "a (SDXL)" in problems[0] and "FLUX.1-dev" in problems[0]


@pytest.mark.parametrize("family", [FLUX_DEV, CHROMA], ids=lambda f: f.name)
def test_block_targets_at_real_size_have_sd_scripts_lora_flux_names(family):
    # sd-scripts networks/lora_flux.py targets every Linear of DoubleStreamBlock / SingleStreamBlock, named by BFL path
    mods = [] if family is CHROMA else ["img_mod_lin", "txt_mod_lin"]
    double = mods + [f"{s}_{m}" for s in ("img", "txt") for m in ("attn_qkv", "attn_proj", "mlp_0", "mlp_2")]
    single = ["linear1", "linear2"] + ([] if family is CHROMA else ["modulation_lin"])
    expected = {f"lora_unet_double_blocks_{i}_{m}" for i in range(19) for m in double}
    expected |= {f"lora_unet_single_blocks_{i}_{m}" for i in range(38) for m in single}
    root = family.adapter_roots(family.reference_parts())[0]
    leaf_of = {s.path: f.name for f in root.fused for s in f.segments}
    names = set()
    for path, module in root.module.named_modules():
        if type(module).__name__ in family.target_classes.transformer:
            for child, leaf in module.named_modules():
                if isinstance(leaf, torch.nn.Linear):
                    full = f"{path}.{child}"
                    names.add("lora_unet_" + (leaf_of.get(full) or root.rename(full)).replace(".", "_"))
    assert names == expected and len(names) == (304 if family is FLUX_DEV else 228)


def test_make_tiny_model_writes_sd_scripts_flux_inputs(tiny, tmp_path):
    from tools.make_tiny_model import run

    written = run(["--out", str(tmp_path), "--family", "flux-schnell", "--flux_blocks", "2", "2"])  # the tests' model
    assert [p.name for p in written] == ["flux-schnell", "flux-schnell.safetensors"]
    parts = {k: tmp_path / f"flux-schnell_{k}.safetensors" for k in ("clip_l", "t5xxl", "ae")}
    loaded = FLUX_SCHNELL.load(
        tmp_path / "flux-schnell.safetensors", options=FluxOptions(**parts)
    )  # the configs stored in the file
    for a, b in zip((loaded.denoiser, loaded.vae, *loaded.text_encoders), (tiny["flux-schnell"].denoiser,
                    tiny["flux-schnell"].vae, *tiny["flux-schnell"].text_encoders)):  # fmt: skip
        _states_equal(a, b)


def test_make_tiny_model_has_the_blocks_the_documented_swap_needs(tmp_path):
    """By default the tool's FLUX models have 11 double and 20 single blocks: sd-scripts' documented
    --blocks_to_swap 18 swaps 9 + 18 of them and keeps 2 of each kind on the device (one fewer is refused)."""
    from library.run.block_swap import swap_problems
    from tools.make_tiny_model import run

    run(["--out", str(tmp_path), "--family", "flux-schnell"])
    denoiser = FLUX_SCHNELL.load(tmp_path / "flux-schnell").denoiser
    lists = FLUX_SCHNELL.swap_blocks(denoiser)
    assert (len(denoiser.transformer_blocks), len(denoiser.single_transformer_blocks)) == (11, 20)
    assert swap_problems(18, lists, "FLUX.1") == [] and swap_problems(19, lists, "FLUX.1") != []


@pytest.mark.parametrize("name,line", [("flux-dev", "--g 2.5 --s 3"), ("flux-schnell", "--s 2")])
def test_flow_sampler_on_the_flux_family_equals_flux_pipeline(tiny, name, line):
    """library/sampling's Euler sampler on this family (encode_prompt, predict, flow_sampling) == FluxPipeline's own
    text encoding, schedule (dev: shifted; schnell: not) and guidance, from sd-scripts' packed noise of the seed."""
    from library.sampling import generate_flow_latents, parse_prompt_line, resolve

    parts, family = tiny[name], VARIANTS[name]
    spec = resolve(parse_prompt_line(f"a red cat {line} --w 64 --h 96 --d 11"), family, parts)
    ours = generate_flow_latents(family, parts, [spec], [torch.Generator().manual_seed(11)])
    pipe = family.pipeline(parts, None)
    pipe.set_progress_bar_config(disable=True)
    packed = torch.randn(1, 4 * 6, 64, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        out = pipe(prompt="a red cat", height=96, width=64, num_inference_steps=spec.steps, guidance_scale=2.5,
                   latents=packed, output_type="latent", max_sequence_length=family.t5_max_length).images  # fmt: skip
    torch.testing.assert_close(ours, pipe._unpack_latents(out, 96, 64, 8), rtol=0, atol=2e-5)


def test_training_objective_and_block_lists(tiny):
    """The family's objective is sd-scripts' FLUX flow matching from the run's flags (the family's options read them;
    a model loaded without them is refused), and a training example goes through predict: x_σ = (1 − σ) x0 + σ ε at
    t = 1000 σ; swap_blocks names the block lists."""
    import argparse
    import dataclasses

    from library.objectives.losses import LossConfig, add_loss_args
    from library.objectives.noising import NoiseConfig, add_noise_args

    parser = argparse.ArgumentParser()
    add_noise_args(parser)
    add_loss_args(parser)
    plain = parser.parse_args([])
    with pytest.raises(ValueError, match="loaded without the objective's flags"):
        FLUX_DEV.training_objective(tiny["flux-dev"], NoiseConfig.from_args(plain), LossConfig.from_args(plain))
    args = FluxOptions.add_args(parser, training=True).parse_args(["--timestep_sampling", "shift",
                                                                   "--model_prediction_type", "raw"])  # fmt: skip
    parts = dataclasses.replace(tiny["flux-dev"], options=FluxOptions.from_args(args, training=True))
    objective = FLUX_DEV.training_objective(parts, NoiseConfig.from_args(args), LossConfig.from_args(args))
    latents = torch.randn(2, 16, 4, 4)
    example = objective.example(latents, torch.Generator().manual_seed(0))
    sigma = example.sigmas.view(-1, 1, 1, 1)
    assert torch.allclose(example.noisy, (1 - sigma) * latents + sigma * example.noise, atol=1e-6)
    assert torch.allclose(example.timesteps, example.sigmas * 1000)
    with torch.no_grad():
        cond = FLUX_DEV.encode_prompt(parts, ["a cat", "a dog"], t5xxl_max_token_length=8)
        out = FLUX_DEV.predict(parts.denoiser, example.noisy, example.timesteps, cond, guidance=1.0)
    assert out.shape == latents.shape and torch.equal(objective.prediction(out, example), out)  # raw
    lists = FLUX_DEV.swap_blocks(parts.denoiser)
    assert [(b.blocks, b.per_unit) for b in lists] == [(parts.denoiser.transformer_blocks, 1),
                                                         (parts.denoiser.single_transformer_blocks, 2)]  # fmt: skip


@pytest.mark.parametrize("name", ["flux-dev", "chroma"])
def test_lora_file_merged_by_comfyui_rule_equals_the_adapted_model(tiny, name):
    """A LoRA injected through the family's roots and target classes (fused qkv / linear1 included) saves kohya keys
    that ComfyUI's rule maps onto the BFL state dict (lora_unet_ + BFL path, dots as underscores); merging
    W += α/r · up @ down there, converting back and predicting equals predicting with the adapter."""
    import copy

    from networks.config import NetworkConfig
    from networks.inject import inject

    parts, family = copy.deepcopy(tiny[name]), VARIANTS[name]
    roots = family.adapter_roots(parts)
    network = inject(NetworkConfig(module="networks.lora", dim=2, alpha=1.0), roots, family.target_classes)
    torch.manual_seed(5)
    for p in network.parameters():
        p.data.normal_(0, 0.05)
    file = network.state_dict_for_file()
    modules = {k.rsplit(".", 2)[0] for k in file if k.startswith("lora_unet_")}
    bfl = K.diffusers_to_bfl(tiny[name].denoiser.state_dict())
    by_rule = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k for k in bfl if k.endswith(".weight")}
    assert modules and modules <= set(by_rule)  # every saved denoiser module has a BFL key by ComfyUI's rule
    assert any(m.endswith("_linear1") for m in modules) and any(m.endswith("_img_attn_qkv") for m in modules)
    assert not any(k.startswith("lora_te3_") for k in file)  # T5 only with train_t5xxl, as sd-scripts
    for module in modules:
        up, down = file[module + ".lora_up.weight"], file[module + ".lora_down.weight"]
        scale = float(file[module + ".alpha"]) / down.shape[0]
        bfl[by_rule[module]] = bfl[by_rule[module]] + scale * (up.float() @ down.float())
    merged = copy.deepcopy(tiny[name].denoiser)
    merged.load_state_dict(K.bfl_to_diffusers(bfl))
    with torch.no_grad():
        cond = family.encode_prompt(tiny[name], ["a cat"], t5xxl_max_token_length=8)
        noisy, t = torch.randn(1, 16, 4, 4), torch.tensor([600.0])
        ours = family.predict(parts.denoiser, noisy, t, cond)
        theirs = family.predict(merged, noisy, t, cond)
        base = family.predict(tiny[name].denoiser, noisy, t, cond)
    assert (ours - theirs).abs().max() < 1e-5 < (ours - base).abs().max()


def test_attention_backends_leave_flux_attention_its_own_processor(caplog):
    """--sdpa / --xformers set diffusers' classic processors only where every attention layer is a classic
    ``Attention``: FLUX's ``FluxAttention`` keeps its SDPA processor (AttnProcessor2_0 crashed its forward, the
    xformers processor cannot run it), and --xformers says so instead of failing."""
    import logging

    from library.families.flux.tiny import tiny_transformer
    from library.run.runtime import set_attention

    model = tiny_transformer("flux-dev")
    before = {k: type(v) for k, v in model.attn_processors.items()}
    set_attention([model], "sdpa")
    with caplog.at_level(logging.WARNING, logger="sdtrain"):
        set_attention([model], "xformers")
    assert {k: type(v) for k, v in model.attn_processors.items()} == before
    assert "keeps its own attention" in caplog.text
