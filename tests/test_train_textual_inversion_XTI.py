"""train_textual_inversion_XTI.py and --XTI_embeddings generation on the tiny SD1 model, in-process.

Oracles: sd-scripts' file layout (train_textual_inversion_XTI.py ``save_weights``: the 16 layer names, (n, dim)
each); a plain loop written from the method (each cross-attention layer given the prompt encoded with its own rows,
through forward pre-hooks on diffusers' attention modules, torch AdamW and clip_grad_norm_) trains the same rows on
the same draws; a resumed run repeats the uninterrupted one bit for bit; generation (gen_img_diffusers.py
--XTI_embeddings) reads each layer's rows (swapping two layers changes the image, equal rows give the plain
textual-inversion image).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _token_helpers import TOKEN, token_dataset
from PIL import Image

import gen_img
import gen_img_diffusers
import train_textual_inversion_XTI
from library.files.weights import load_state_dict, save_state_dict

# sd-scripts' XTI layers (train_textual_inversion_XTI.py), in the order its hijacked UNet forward feeds them
SD_SCRIPTS_LAYERS = ["IN01", "IN02", "IN04", "IN05", "IN07", "IN08", "MID", "OUT03", "OUT04", "OUT05", "OUT06",
                     "OUT07", "OUT08", "OUT09", "OUT10", "OUT11"]  # fmt: skip
# the diffusers modules of those layers, in the same order (XTI_hijack.py: 2 per down block, mid, 3 per up block)
DIFFUSERS_LAYERS = ([f"down_blocks.{i}.attentions.{j}" for i in range(3) for j in range(2)] + ["mid_block.attentions.0"]
                    + [f"up_blocks.{i}.attentions.{j}" for i in range(1, 4) for j in range(3)])  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return token_dataset(tmp_path_factory.mktemp("data"))


def args_for(model, dataset, out, *extra, steps=3):
    return [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(dataset), "--caption_extension", ".txt",
        "--resolution", "64", "--output_dir", str(out), "--token_string", TOKEN, "--init_word", "shape",
        "--num_vectors_per_token", "2", "--learning_rate", "5e-2", "--train_batch_size", "2",
        "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0", "--seed", "1", *extra,
    ]  # fmt: skip


def test_xti_rows_equal_a_plain_per_layer_loop_and_resume_is_exact(tiny_dir, dataset, tmp_path, monkeypatch):
    """Our rows after 4 steps equal the plain loop's on the same draws; a run resumed from the state saved at step 2
    repeats the uninterrupted one bit for bit."""
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    import library.objectives.ddpm as O
    from library.run import loop

    draws, captions = [], []
    make_example, batch_loss = O.make_example, loop.batch_loss

    def recorded_example(cfg, latents, schedule, generator=None, **kwargs):
        out = make_example(cfg, latents, schedule, generator, **kwargs)
        draws.append((latents.detach().clone(), out.noise.clone(), out.timesteps.clone()))
        return out

    def recorded_loss(m, batch, generator, **kwargs):
        captions.append(list(batch.captions))
        return batch_loss(m, batch, generator, **kwargs)

    monkeypatch.setattr(O, "make_example", recorded_example)
    monkeypatch.setattr(loop, "batch_loss", recorded_loss)
    steps, common = 4, ["--save_model_as", "safetensors", "--save_every_n_steps", "2", "--save_state"]
    result = train_textual_inversion_XTI.run(args_for(tiny_dir / "sd1", dataset, tmp_path / "a", *common,
                                                      steps=steps))  # fmt: skip
    ours, meta = load_state_dict(result.output)
    assert list(ours) == SD_SCRIPTS_LAYERS and result.output.name == f"{TOKEN}.safetensors"
    assert all(t.shape == (2, 32) and t.dtype == torch.float32 for t in ours.values())
    assert meta["ss_token_string"] == TOKEN and len(draws) == len(captions) == steps

    state = tmp_path / "a" / f"{TOKEN}-step00000002-state"
    resumed = train_textual_inversion_XTI.run(args_for(tiny_dir / "sd1", dataset, tmp_path / "b", *common,
                                                       "--resume", str(state), steps=steps))  # fmt: skip
    assert resumed.losses == result.losses and resumed.steps == steps
    again = load_state_dict(resumed.output)[0]
    assert list(again) == SD_SCRIPTS_LAYERS and all(torch.equal(again[k], ours[k]) for k in ours)

    # the reference: the fresh model, the init word's rows in every layer, each layer conditioned on its own rows
    pipe = StableDiffusionPipeline.from_pretrained(tiny_dir / "sd1", safety_checker=None)
    unet, te, tok = pipe.unet, pipe.text_encoder, pipe.tokenizer
    scheduler = DDPMScheduler.from_pretrained(tiny_dir / "sd1", subfolder="scheduler")
    for module in (unet, te):
        module.requires_grad_(False)
    names = [TOKEN, f"{TOKEN}1"]
    tok.add_tokens(names)
    te.resize_token_embeddings(len(tok))
    base = tok.convert_tokens_to_ids(names)
    table = te.get_input_embeddings()
    init = table.weight[tok.encode("shape", add_special_tokens=False)[0]].detach()
    rows = torch.nn.Parameter(init.repeat(16, 2, 1).clone())  # (layers, vectors, dim)
    optimizer = torch.optim.AdamW([rows], lr=5e-2)
    layer_of = {}

    def embed_hook(module, inputs, output):
        ids = inputs[0]
        for v, i in enumerate(base):
            output = torch.where((ids == i).unsqueeze(-1), rows[layer_of["now"], v], output)
        return output

    table.register_forward_hook(embed_hook)
    contexts = []
    for index, path in enumerate(DIFFUSERS_LAYERS):
        attn = unet.get_submodule(f"{path}.transformer_blocks.0.attn2")
        attn.register_forward_pre_hook(lambda m, a, kw, i=index: (a, {**kw, "encoder_hidden_states": contexts[i]}),
                                       with_kwargs=True)  # fmt: skip
    for (latents, noise, t), texts in zip(draws[:steps], captions[:steps]):  # the uninterrupted run's
        texts = [c.replace(TOKEN, " ".join(names)) for c in texts]  # sd-scripts' multi-vector replacement
        ids = tok(texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        contexts.clear()
        for layer in range(16):
            layer_of["now"] = layer
            contexts.append(te(ids).last_hidden_state)
        pred = unet(scheduler.add_noise(latents, noise, t), t, encoder_hidden_states=contexts[0]).sample
        torch.nn.functional.mse_loss(pred.float(), noise.float()).backward()
        torch.nn.utils.clip_grad_norm_([rows], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ref = rows.detach()
    moved = [float((ref[i] - init).norm()) for i in range(16)]
    errors = [float((ours[name] - ref[i]).norm()) / moved[i] for i, name in enumerate(SD_SCRIPTS_LAYERS)]
    assert min(moved) > 1e-3  # every layer trained
    assert max(errors) < 1e-3, errors
    spread = max(float((ref[i] - ref[0]).norm()) for i in range(16))
    assert spread > 0.1 * max(moved)  # the layers' rows differ: each was trained on its own layer's gradient


def test_bad_weights_file_is_refused_naming_it(tiny_dir, dataset, tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_state_dict({"emb_params": torch.zeros(2, 32)}, plain)
    with pytest.raises(ValueError, match="plain.safetensors.*one tensor per cross-attention layer"):
        train_textual_inversion_XTI.run(args_for(tiny_dir / "sd1", dataset, tmp_path / "o", "--weights", str(plain)))


def test_generation_uses_each_layers_rows(tiny_dir, tmp_path):
    """Each layer's rows reach its layer: swapping two layers' rows changes the image; the same rows in every layer
    give the image of the plain embedding with those rows (gen_img.py without XTI). Three XTI files in one run."""
    torch.manual_seed(0)
    rows = {name: torch.randn(2, 32) * 2 for name in SD_SCRIPTS_LAYERS}
    files = {
        "xtoka": rows,
        "xtokb": {**rows, "IN01": rows["OUT11"], "OUT11": rows["IN01"]},  # two layers swapped
        "xtokc": {name: rows["MID"].clone() for name in SD_SCRIPTS_LAYERS},  # one set of rows everywhere
    }
    for token, tensors in files.items():
        save_state_dict(tensors, tmp_path / f"{token}.safetensors")
    save_state_dict({"emb_params": rows["MID"]}, tmp_path / "plain" / "xtokc.safetensors")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a photo of ({t}:1.2) --d 3 --n bad --f {t}.png\n" for t in files))
    common = ["--ckpt", str(tiny_dir / "sd1"), "--steps", "2", "--W", "64", "--H", "64", "--scale", "6", "--sampler",
              "ddim"]  # fmt: skip
    xti = gen_img_diffusers.run([*common, "--from_file", str(prompts), "--outdir", str(tmp_path / "img"),
                                 "--XTI_embeddings", *(str(tmp_path / f"{t}.safetensors") for t in files)])  # fmt: skip
    plain = gen_img.run([*common, "--prompt", "a photo of (xtokc:1.2) --d 3 --n bad", "--outdir", str(tmp_path / "p"),
                         "--textual_inversion_embeddings", str(tmp_path / "plain" / "xtokc.safetensors")])  # fmt: skip
    a, b, c = (np.asarray(Image.open(tmp_path / "img" / f"{t}.png"), np.int16) for t in files)
    d = np.asarray(Image.open(plain[0]), np.int16)
    assert len(xti) == 3
    assert np.abs(a - b).max() > 2  # IN01 and OUT11 read their own rows
    assert np.abs(c - d).max() <= 1  # one set of rows in every layer: plain textual inversion
    assert np.abs(a - c).max() > 2
