"""fine_tune.py and train_textual_inversion.py against hand-written reference loops on the same draws.

Our run is recorded (each step's latents, noise, timesteps and captions); the reference then replays those steps
with diffusers and transformers only: the model folder read by ``from_pretrained``, the captions tokenized by the
folder's CLIP tokenizer (77 tokens, padded), ``DDPMScheduler.add_noise``, the UNet, ``F.mse_loss``,
``clip_grad_norm_`` and ``torch.optim.AdamW`` with sd-scripts' defaults. Textual inversion adds the new token the way
sd-scripts does (``tok tok1 ...`` in the captions, rows started from the init word's embedding, only the new rows
trained). Every trained tensor's update must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fine_tune
import library.objectives.ddpm as O
import library.run.train_step as T
import train_textual_inversion
from library.files.weights import load_state_dict
from library.run.demo import make_example_dataset, make_tiny_model

STEPS, LR, CLIP = 2, 1e-3, 0.5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("ref") / "model", "sd1")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = make_example_dataset(tmp_path_factory.mktemp("ref_data"))
    for txt in folder.rglob("*.txt"):
        txt.write_text(txt.read_text().replace("sks shape", "shapetok shape"))
    return folder


def record(monkeypatch) -> list[dict]:
    """Each batch's captions as the text encoder saw them and its latents, noise and timesteps."""
    steps: list[dict] = []
    make_example, encode = O.make_example, T.encode_captions

    def recorded_example(cfg, latents, schedule, generator=None, **kwargs):
        out = make_example(cfg, latents, schedule, generator, **kwargs)
        steps[-1].update(latents=latents.detach().clone(), noise=out.noise.clone(), t=out.timesteps.clone())
        return out

    def recorded_captions(family, parts, captions, *args, **kwargs):
        steps.append({"captions": list(captions)})
        return encode(family, parts, captions, *args, **kwargs)

    monkeypatch.setattr(O, "make_example", recorded_example)  # the DDPM objective's draws
    monkeypatch.setattr(T, "encode_captions", recorded_captions)
    return steps


def argv_for(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
        "--resolution", "64", "--output_dir", str(out), "--output_name", "t", "--train_batch_size", "2",
        "--max_train_steps", str(STEPS), "--max_data_loader_n_workers", "0", "--seed", "4", "--optimizer_type",
        "AdamW", "--learning_rate", str(LR), "--max_grad_norm", str(CLIP), "--save_state", *extra,
    ]  # fmt: skip


def reference_parts(model: Path):
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    return (UNet2DConditionModel.from_pretrained(model, subfolder="unet"),
            CLIPTextModel.from_pretrained(model / "text_encoder"),
            CLIPTokenizer.from_pretrained(model / "tokenizer"),
            DDPMScheduler.from_pretrained(model, subfolder="scheduler"))  # fmt: skip


def tokens(tokenizer, captions: list[str]) -> torch.Tensor:
    return tokenizer(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids


def step_loss(unet, text_encoder, tokenizer, scheduler, step: dict) -> torch.Tensor:
    noisy = scheduler.add_noise(step["latents"], step["noise"], step["t"])
    hidden = text_encoder(tokens(tokenizer, step["captions"]))[0]
    pred = unet(noisy, step["t"], encoder_hidden_states=hidden).sample
    return F.mse_loss(pred.float(), step["noise"].float())


# At 64 px the mid block sees one latent pixel: its self-attention has one key, so the softmax is 1 and the gradients
# of to_q / to_k are zero but for float noise, which Adam turns into lr-sized steps that differ between any two runs
SINGLE_TOKEN = tuple(f"mid_block.attentions.0.transformer_blocks.0.attn1.to_{x}." for x in "qk")


def assert_same_updates(ours: dict, ref: dict, start: dict) -> None:
    """Each tensor's update (after - start) agrees to 1e-3 of its norm, and most tensors moved."""
    moved = 0
    for name, value in ref.items():
        if name.startswith(SINGLE_TOKEN):
            continue
        d_ref, d_ours = value.double() - start[name].double(), ours[name].double() - start[name].double()
        if d_ref.norm() == 0:
            continue
        moved += 1
        assert float((d_ours - d_ref).norm() / d_ref.norm()) < 1e-3, name
    assert moved > 0.9 * len(ref), (moved, len(ref))


def test_fine_tune_steps_equal_a_plain_diffusers_loop(model, data, tmp_path, monkeypatch):
    steps = record(monkeypatch)
    result = fine_tune.run(argv_for(model, data, tmp_path, "--save_model_as", "safetensors"))
    assert result.steps == STEPS and len(steps) == STEPS
    ours = {k[len("unet.") :]: v for k, v in load_state_dict(result.state / "trained.safetensors")[0].items()
            if k.startswith("unet.")}  # fmt: skip

    unet, text_encoder, tokenizer, scheduler = reference_parts(model)
    start = {k: v.detach().clone() for k, v in unet.state_dict().items()}
    text_encoder.requires_grad_(False)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=LR, foreach=False)  # torch's defaults, as sd-scripts
    for step in steps:
        loss = step_loss(unet, text_encoder, tokenizer, scheduler, step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    assert_same_updates(ours, dict(unet.state_dict()), start)


def test_textual_inversion_steps_equal_a_plain_loop(model, data, tmp_path, monkeypatch):
    steps = record(monkeypatch)
    result = train_textual_inversion.run(argv_for(model, data, tmp_path, "--token_string", "shapetok", "--init_word",
                                                  "shape", "--num_vectors_per_token", "2"))  # fmt: skip
    assert result.steps == STEPS and len(steps) == STEPS
    assert all("shapetok shapetok1" in c for s in steps for c in s["captions"])  # sd-scripts' multi-vector spelling
    ours = torch.load(result.output, weights_only=True)["emb_params"]  # (2, D), the rows as trained

    unet, text_encoder, tokenizer, scheduler = reference_parts(model)
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    init = tokenizer.encode("shape", add_special_tokens=False)
    tokenizer.add_tokens(["shapetok", "shapetok1"])
    text_encoder.resize_token_embeddings(len(tokenizer))
    table = text_encoder.get_input_embeddings().weight
    new = tokenizer.convert_tokens_to_ids(["shapetok", "shapetok1"])
    with torch.no_grad():
        for i, row in enumerate(new):  # the init word's vectors, cycled over the new rows (sd-scripts)
            table[row] = table[init[i % len(init)]]
    rows = torch.nn.Parameter(table[new].detach().clone())
    start = rows.detach().clone()
    optimizer = torch.optim.AdamW([rows], lr=LR, foreach=False)
    for step in steps:
        with torch.no_grad():
            table[new] = rows.detach()
        table.requires_grad_(True)
        loss = step_loss(unet, text_encoder, tokenizer, scheduler, step)
        loss.backward()
        rows.grad = table.grad[new].clone()
        table.grad = None
        table.requires_grad_(False)
        torch.nn.utils.clip_grad_norm_([rows], CLIP)
        optimizer.step()
        optimizer.zero_grad()
    assert_same_updates({"rows": ours.float()}, {"rows": rows.detach()}, {"rows": start})
