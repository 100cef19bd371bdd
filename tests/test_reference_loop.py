"""train_network.py against a plain diffusers + peft training loop, step by step (oracle: peft's LoRA layers,
diffusers' UNet and scheduler, ``F.mse_loss``, ``torch.optim.AdamW``, ``clip_grad_norm_``).

The loop is the one in benchmarks/compare_reference_lora.py (which measures learning and forgetting over seeds); here
it replays a short run of ours on the same draws from the same initial weights, and every adapter weight must agree
after every step. Alpha differs from the rank and the clip threshold is low enough to act, so the scale and the
clipping are part of what is compared; LoCon (conv_dim) covers the 3x3 convolutions.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from library.run import loop
from library.run.demo import make_example_dataset

# At 64 px the mid block sees one latent pixel: its self-attention has one key, so the softmax is 1 and the gradients
# of to_q / to_k are exactly zero but for float noise, which Adam turns into lr-sized steps that differ between runs.
SINGLE_TOKEN = tuple(f"lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_{x}" for x in "qk")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_reference_lora.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("compare_reference_lora", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lora_steps_equal_a_plain_peft_loop(bench, tiny_dir, tmp_path):
    data = make_example_dataset(tmp_path / "data")
    a = SimpleNamespace(dim=4, alpha=2.0, lr=1e-2, steps=4, max_grad_norm=0.05,
                        ours_args=["--network_args", "conv_dim=4", "conv_alpha=2"])  # fmt: skip
    ours = bench.run_ours(tiny_dir / "sd1", data, tmp_path / "out", 0, a)
    ref = bench.run_reference(tiny_dir / "sd1", ours, a, "matched", 0)

    assert len(ours["steps"]) == len(ref["steps"]) == 4
    assert ours["grad_norms"][0] > a.max_grad_norm  # clipping acts
    kinds = {bench.group_of(n) for n in ours["targets"]}
    assert {"te", "unet attn1", "unet ff_net", "unet proj_in", "unet other"} <= kinds  # "other": ResNet convs
    assert set(ref["targets"]) == set(ours["targets"])
    for n in ours["targets"]:
        assert ref["scale"][n] == pytest.approx(ours["alpha"][n] / a.dim)
    worst, moved = 0.0, 0
    for step_ours, step_ref in zip(ours["steps"], ref["steps"]):
        for n in ours["targets"]:
            if n.startswith(SINGLE_TOKEN):
                continue
            w_ours = bench.delta_w(step_ours[n], ours["alpha"][n] / a.dim)
            w_ref = bench.delta_w(step_ref[n], ref["scale"][n])
            if w_ref.norm() > 0:
                moved += 1
                worst = max(worst, float((w_ours - w_ref).norm() / w_ref.norm()))
    assert moved > 0.9 * 4 * len(ours["targets"])  # the comparison is not of untouched weights
    # Adam turns float noise in a near-zero gradient element into up to one lr-sized step, so single elements may
    # differ; each module's ΔW as a whole must agree
    assert worst < 1e-3, worst


def test_sdxl_lora_steps_equal_a_plain_peft_loop(bench, tmp_path, monkeypatch):
    """SDXL: our UNet LoRA (alpha 2, rank 4) against diffusers + peft on the same draws, step by step. The reference
    conditions the UNet with diffusers' own StableDiffusionXLPipeline.encode_prompt (both encoders' penultimate
    states, the second's pooled projection) and _get_add_time_ids for the batch's sizes; peft's LoRA layers, from
    our initial weights; F.mse_loss, clip_grad_norm_ (low enough to act) and torch AdamW. Every module's ΔW agrees."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler, StableDiffusionXLPipeline

    import library.objectives.ddpm as O
    import library.run.train_step as T
    import sdxl_train_network
    from library.run.demo import make_tiny_model
    from library.run.trainer import Trainer

    model = make_tiny_model(tmp_path / "model", "sdxl")
    data = make_example_dataset(tmp_path / "data")
    dim, alpha, lr, clip, steps = 4, 2.0, 1e-2, 0.05, 3
    rec: dict = {"draws": [], "batches": [], "steps": []}
    init, step_done, make_example = Trainer.__init__, Trainer.step_done, O.make_example
    batch_loss = T.batch_loss

    def snapshot(network):
        return {n: {k: p.detach().clone() for k, p in network.layer(n).adapter.params.items()} for n in network.names}

    def recorded_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        net = self.trainable
        rec["targets"] = {n: net._slots[n].target.path for n in net.names}
        rec["init"] = snapshot(net)

    def recorded_step(self, loss):
        step_done(self, loss)
        rec["steps"].append(snapshot(self.trainable))

    def recorded_example(cfg, latents, schedule, generator=None, **kwargs):
        out = make_example(cfg, latents, schedule, generator, **kwargs)
        rec["draws"].append((latents.detach().clone(), out.noise.clone(), out.timesteps.clone()))
        return out

    def recorded_loss(m, batch, generator, **kwargs):
        rec["batches"].append((list(batch.captions), batch.original_sizes.tolist(), batch.crop_top_lefts.tolist(),
                               batch.target_sizes.tolist()))  # fmt: skip
        return batch_loss(m, batch, generator, **kwargs)

    monkeypatch.setattr(Trainer, "__init__", recorded_init)
    monkeypatch.setattr(Trainer, "step_done", recorded_step)
    monkeypatch.setattr(O, "make_example", recorded_example)  # the DDPM objective's draws

    monkeypatch.setattr(loop, "batch_loss", recorded_loss)
    argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension",
            ".txt", "--resolution", "64", "--output_dir", str(tmp_path / "out"), "--network_module", "networks.lora",
            "--network_dim", str(dim), "--network_alpha", str(alpha), "--network_train_unet_only", "--learning_rate",
            str(lr), "--train_batch_size", "2", "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0",
            "--seed", "5", "--max_grad_norm", str(clip), "--optimizer_type", "AdamW"]  # fmt: skip
    assert sdxl_train_network.run(argv).steps == steps and len(rec["draws"]) == steps

    pipe = StableDiffusionXLPipeline.from_pretrained(model)
    unet, scheduler = pipe.unet, DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    for module in (unet, pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        module.requires_grad_(False)
    modules = bench.attach_peft_lora(unet, rec["targets"], dim, alpha, rec["init"])  # peft's layers, our init
    params = [p for m in modules.values() for p in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
    optimizer = torch.optim.AdamW(params, lr=lr, foreach=False)
    projection = pipe.text_encoder_2.config.projection_dim
    ratios = []
    for (latents, noise, t), (captions, originals, crops, targets), ours in zip(rec["draws"], rec["batches"],
                                                                               rec["steps"]):  # fmt: skip
        with torch.no_grad():
            embeds, _, pooled, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False)
        time_ids = torch.cat([pipe._get_add_time_ids(tuple(o), tuple(c), tuple(s), torch.float32, projection)
                              for o, c, s in zip(originals, crops, targets)])  # fmt: skip
        pred = unet(scheduler.add_noise(latents, noise, t), t, encoder_hidden_states=embeds,
                    added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample  # fmt: skip
        F.mse_loss(pred.float(), noise.float()).backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for n, m in modules.items():
            w_ref = m.lora_B["default"].weight @ m.lora_A["default"].weight * m.scaling["default"]
            w_ours = ours[n]["lora_up"] @ ours[n]["lora_down"] * (alpha / dim)
            if w_ref.norm() > 0:
                ratios.append(float((w_ours - w_ref).norm() / w_ref.norm()))
    assert len(ratios) > 0.9 * steps * len(modules)  # the comparison is not of untouched weights
    # float noise in near-zero gradient elements becomes lr-sized Adam steps in the first step (up to 2e-3 of a
    # module's ΔW here, shrinking with each step); an alpha, scale or conditioning error is of order 1
    assert sorted(ratios)[len(ratios) // 2] < 1e-4 and max(ratios) < 5e-3, (sorted(ratios)[len(ratios) // 2],
                                                                             max(ratios))  # fmt: skip
