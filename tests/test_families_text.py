"""Model families, prompts and denoising: checked against diffusers' pipelines and sd-scripts' token layout."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

from library.families.convert import hf_state_dict
from library.families.sd import SD1, SD2, SDXL
from library.files.weights import load_state_dict

CAPTIONS = ["a photo of an astronaut riding a horse on mars", "a red cat"]
WORDS = ["a", "photo", "of", "red", "cat", "dog", "blue", "sky", "tree", "house"]  # one CLIP token each


def sd_pipe(parts) -> StableDiffusionPipeline:
    te = parts.text_encoders[0]
    if not hasattr(te, "text_model"):
        # diffusers 0.42's clip_skip path reads text_encoder.text_model.final_layer_norm, which the flat CLIPTextModel
        # of transformers >= 5.6 no longer has; give a copy of the encoder that alias so the oracle can run.
        te = copy.deepcopy(te)
        object.__setattr__(te, "text_model", SimpleNamespace(final_layer_norm=te.final_layer_norm))
    return StableDiffusionPipeline(
        vae=parts.vae, text_encoder=te, tokenizer=parts.tokenizers[0], unet=parts.denoiser, scheduler=DDIMScheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def sdxl_pipe(parts) -> StableDiffusionXLPipeline:
    te1, te2 = parts.text_encoders
    tok1, tok2 = parts.tokenizers
    return StableDiffusionXLPipeline(
        vae=parts.vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok1, tokenizer_2=tok2, unet=parts.denoiser,
        scheduler=EulerDiscreteScheduler(), add_watermarker=False,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ diffusers oracle
@pytest.mark.parametrize(("family", "clip_skip"), [("sd1", None), ("sd1", 1), ("sd1", 2), ("sd2", None)])
def test_encode_prompt_equals_diffusers(family, clip_skip, tiny_parts):
    parts = tiny_parts[family]
    ours = {"sd1": SD1, "sd2": SD2}[family].encode_prompt(parts, CAPTIONS, clip_skip=clip_skip)
    # sd-scripts' clip_skip n is diffusers' n - 1 (layers skipped from the end); 1 means the last layer
    diffusers_skip = None if clip_skip in (None, 1) else clip_skip - 1
    theirs, _ = sd_pipe(parts).encode_prompt(CAPTIONS, "cpu", 1, False, clip_skip=diffusers_skip)
    assert ours.pooled is None
    torch.testing.assert_close(ours.hidden_states, theirs, rtol=0, atol=0)


def test_sdxl_encode_prompt_and_unet_call_equal_diffusers(tiny_parts):
    parts = tiny_parts["sdxl"]
    pipe = sdxl_pipe(parts)
    embeds, _, pooled, _ = pipe.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False)
    ours = SDXL.encode_prompt(parts, CAPTIONS)
    torch.testing.assert_close(ours.hidden_states, embeds, rtol=0, atol=0)
    torch.testing.assert_close(ours.pooled, pooled, rtol=0, atol=0)
    # size/crop conditioning: diffusers' own builder is the oracle for the order of the six numbers
    sizes = [((96, 64), (8, 0), (64, 64)), ((64, 128), (0, 16), (64, 96))]
    theirs = torch.cat([
        pipe._get_add_time_ids(o, c, t, dtype=torch.float32, text_encoder_projection_dim=parts.text_encoders[1].config.projection_dim)
        for o, c, t in sizes
    ])  # fmt: skip
    time_ids = SDXL.time_ids(*zip(*sizes))
    torch.testing.assert_close(time_ids, theirs, rtol=0, atol=0)
    noisy, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([10, 500])
    expected = parts.denoiser(noisy, t, embeds, added_cond_kwargs={"text_embeds": pooled, "time_ids": theirs}).sample
    torch.testing.assert_close(
        SDXL.predict(parts.denoiser, noisy, t, ours, time_ids=time_ids), expected, rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="time_ids"):
        SDXL.predict(parts.denoiser, noisy, t, ours)


# ------------------------------------------------------------------------------------------------ long prompts
def caption_of(n_tokens: int, offset: int = 0) -> str:
    return " ".join(WORDS[(i + offset) % len(WORDS)] for i in range(n_tokens))


def expected_layout(tokenizer, caption: str, chunks: int) -> list[int]:
    """sd-scripts' layout, written independently: every 75-token chunk is <BOS> its tokens <EOS> then padding;
    text beyond 75·chunks is cut."""
    ids = tokenizer(caption, add_special_tokens=False).input_ids
    out = []
    for k in range(chunks):
        body = ids[75 * k : 75 * (k + 1)]
        out += [tokenizer.bos_token_id, *body, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * (75 - len(body))
    return out


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_long_prompt_token_layout_as_sd_scripts(family, tiny_parts):
    parts = tiny_parts[family]
    fam = {"sd1": SD1, "sd2": SD2, "sdxl": SDXL}[family]
    tokenizer = parts.tokenizers[0]
    assert all(len(tokenizer(w, add_special_tokens=False).input_ids) == 1 for w in WORDS)
    for max_len, lengths in ((150, [5, 75, 76, 150, 200]), (225, [5, 151, 300])):
        captions = [caption_of(n, offset=n) for n in lengths]
        tokens = fam.tokenize(parts, captions, max_token_length=max_len)
        assert len(tokens) == fam.num_text_encoders
        for ids, tok in zip(tokens, parts.tokenizers):  # SDXL: CLIP-L pads with <EOS>, bigG with "!"
            assert ids.shape == (len(captions), 77 * (max_len // 75))
            assert ids.tolist() == [expected_layout(tok, c, max_len // 75) for c in captions]
    short = fam.tokenize(parts, ["a red cat"])[-1]
    assert short.shape == (1, 77) and short[0, :5].tolist() == [49406, 320, 736, 2368, 49407]


@pytest.mark.parametrize("family", ["sd1", "sd2"])
def test_long_prompt_encoding_joins_chunks_as_sd_scripts(family, tiny_parts):
    parts = tiny_parts[family]
    fam = {"sd1": SD1, "sd2": SD2}[family]
    captions = [caption_of(100), caption_of(7)]
    cond = fam.encode_prompt(parts, captions, max_token_length=150)
    assert cond.hidden_states.shape == (2, 152, 32)
    te, tok = parts.text_encoders[0], parts.tokenizers[0]
    layout = torch.tensor([expected_layout(tok, c, 2) for c in captions])
    h0, h1 = te(layout[:, :77])[0], te(layout[:, 77:])[0]
    expected = torch.cat([h0[:, :1], h0[:, 1:76], h1[:, 1:76], h1[:, 76:]], dim=1)
    torch.testing.assert_close(cond.hidden_states, expected, rtol=1e-6, atol=1e-6)


def test_sdxl_long_prompt_pooled_from_first_chunk(tiny_parts):
    parts = tiny_parts["sdxl"]
    captions = [caption_of(120), caption_of(3)]
    cond = SDXL.encode_prompt(parts, captions, max_token_length=225)
    assert cond.hidden_states.shape == (2, 227, 32 + 48) and cond.pooled.shape == (2, 48)
    te2, tok2 = parts.text_encoders[1], parts.tokenizers[1]
    first_chunk = torch.tensor([expected_layout(tok2, c, 3)[:77] for c in captions])
    torch.testing.assert_close(cond.pooled, te2(first_chunk).text_embeds, rtol=1e-6, atol=1e-6)  # HF's own pooling
    ids1 = torch.tensor([expected_layout(parts.tokenizers[0], c, 3) for c in captions])
    h = parts.text_encoders[0](ids1[:, 154:], output_hidden_states=True).hidden_states[-2]  # third chunk, CLIP-L
    torch.testing.assert_close(cond.hidden_states[:, 151:226, :32], h[:, 1:76], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("family", "clip_skip"), [("sd1", None), ("sd1", 2), ("sd2", None)])
def test_unpadded_prompts_end_at_the_longest_caption(family, clip_skip, tiny_parts):
    """--no_token_padding (train_db.py): <BOS> tokens <EOS>, padded only to the batch's longest caption (longer ones
    truncated at 77). The encoder's causal mask makes the outputs the padded ones cut there."""
    parts, fam = tiny_parts[family], {"sd1": SD1, "sd2": SD2}[family]
    tok = parts.tokenizers[0]
    for lengths in ((7, 3), (1, 1), (80, 2)):
        captions = [caption_of(n, offset=n) for n in lengths]
        ids = fam.tokenize(parts, captions, pad=False)[0]
        longest = min(max(lengths), 75) + 2
        bodies = [tok(c, add_special_tokens=False).input_ids[:75] for c in captions]
        expected = [
            [tok.bos_token_id, *b, tok.eos_token_id] + [tok.pad_token_id] * (longest - len(b) - 2) for b in bodies
        ]
        assert ids.tolist() == expected
        cond = fam.encode_prompt(parts, captions, clip_skip=clip_skip, pad=False)
        padded = fam.encode_prompt(parts, captions, clip_skip=clip_skip)
        assert cond.hidden_states.shape == (2, longest, 32) and padded.hidden_states.shape == (2, 77, 32)
        torch.testing.assert_close(cond.hidden_states, padded.hidden_states[:, :longest], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="--no_token_padding with --max_token_length 150 is not supported yet"):
        SD1.tokenize(parts, ["a"], max_token_length=150, pad=False)


def test_bad_prompt_options(tiny_parts):
    with pytest.raises(ValueError, match="--max_token_length 100: expected 75, 150 or 225"):
        SD1.tokenize(tiny_parts["sd1"], ["a"], max_token_length=100)
    with pytest.raises(ValueError, match="--clip_skip 3: the text encoder has 2 layers"):
        SD1.encode_prompt(tiny_parts["sd1"], ["a"], clip_skip=3)
    ignored = SDXL.encode_prompt(tiny_parts["sdxl"], ["a"], clip_skip=2)  # ignored with a warning, as sd-scripts
    torch.testing.assert_close(ignored.hidden_states, SDXL.encode_prompt(tiny_parts["sdxl"], ["a"]).hidden_states)


def test_text_encoder_gradients_flow(tiny_parts):
    parts = copy.deepcopy(tiny_parts["sd1"])
    te = parts.text_encoders[0].requires_grad_(True)
    SD1.encode_prompt(parts, CAPTIONS, clip_skip=2, max_token_length=150).hidden_states.square().mean().backward()
    assert te.get_input_embeddings().weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------ latents
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_latents_use_the_vae_scale(family, tiny_parts):
    parts = tiny_parts[family]
    fam = {"sd1": SD1, "sdxl": SDXL}[family]
    assert fam.vae_scale == parts.vae.config.scaling_factor  # 0.18215 / 0.13025 as released
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = fam.encode_latents(parts, pixels, generator=torch.Generator().manual_seed(3))
    dist = parts.vae.encode(pixels).latent_dist
    torch.testing.assert_close(latents, dist.sample(generator=torch.Generator().manual_seed(3)) * fam.vae_scale)
    assert latents.shape == (2, 4, 4, 4)
    expected = parts.vae.decode(latents / fam.vae_scale).sample.clamp(-1, 1)
    torch.testing.assert_close(fam.decode_latents(parts, latents), expected)


def test_fp16_sdxl_vae_is_upcast(tiny_parts):
    parts = copy.deepcopy(tiny_parts["sdxl"])
    parts.vae.half()
    latents = SDXL.encode_latents(parts, torch.zeros(1, 3, 16, 16, dtype=torch.float16))
    assert next(parts.vae.parameters()).dtype == torch.float32 and latents.dtype == torch.float16


# ------------------------------------------------------------------------------------------------ names
def test_sdxl_adapter_names_are_the_single_file_names(tiny_parts, tmp_path):
    parts = tiny_parts["sdxl"]
    sd, _ = load_state_dict(SDXL.save(parts, tmp_path / "m.safetensors"))
    roots = {r.prefix: (r.module, r.rename) for r in SDXL.adapter_roots(parts)}
    assert list(roots) == ["lora_unet", "lora_te1", "lora_te2"]
    unet, rename = roots["lora_unet"]
    layers = [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)]
    assert all(f"model.diffusion_model.{rename(n)}.weight" in sd for n in layers)  # ldm names diffusers accepted
    name = "lora_unet_" + rename("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q").replace(".", "_")
    assert name == "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    for prefix, te in (("lora_te1", parts.text_encoders[0]), ("lora_te2", parts.text_encoders[1])):
        module, rename = roots[prefix]
        assert module is te
        canonical = hf_state_dict(module)
        linears = [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(f"{rename(n)}.weight" in canonical for n in linears)
        assert any(rename(n) == "text_model.encoder.layers.0.self_attn.q_proj" for n in linears)


def test_sd_adapter_names_and_metadata_strings(tiny_parts):
    roots = SD1.adapter_roots(tiny_parts["sd1"])
    assert [(r.prefix, r.module) for r in roots] == [
        ("lora_unet", tiny_parts["sd1"].denoiser),
        ("lora_te", tiny_parts["sd1"].text_encoders[0]),
    ]
    assert roots[0][2]("down_blocks.0.attentions.0.proj_in") == "down_blocks.0.attentions.0.proj_in"
    assert roots[1][2]("encoder.layers.1.mlp.fc1").endswith("text_model.encoder.layers.1.mlp.fc1")
    # the strings sd-scripts writes (sd-scripts' library/sai_model_spec.py)
    assert [SD1.base_model_version(), SD1.base_model_version("v_prediction")] == ["sd_v1", "sd_v1_v"]
    assert [SD2.base_model_version(), SD2.base_model_version("v_prediction")] == ["sd_v2", "sd_v2_v"]
    assert SDXL.base_model_version("v_prediction") == "sdxl_base_v1-0"
    assert SD2.modelspec_architecture("lora", "v_prediction") == "stable-diffusion-v2-768-v/lora"
    assert SD2.modelspec_architecture("textual-inversion") == "stable-diffusion-v2-512/textual-inversion"
    assert SDXL.modelspec_architecture("lora") == "stable-diffusion-xl-v1-base/lora"
    assert (SD1.ti_embedding_keys, SDXL.ti_embedding_keys) == (("emb_params",), ("clip_l", "clip_g"))
    resolutions = (SD1.default_resolution(), SD2.default_resolution("v_prediction"), SDXL.default_resolution())
    assert resolutions == (512, 768, 1024)
