"""Our LoRA training against a plain diffusers + peft loop, step by step, on the tiny SD1 model (run by hand).

    OMP_NUM_THREADS=1 python benchmarks/compare_reference_lora.py --lr 1e-4 [--seeds 0 1 2 3] [--steps 200]
        [--variants matched attn_only ...]

The base model is the tiny SD1 with its VAE made deterministic and unit-scale (see ``sharpen_vae``) and its UNet
first trained on eight pattern images, so that it has something to forget. For each seed, ``train_network.run``
trains a LoRA in-process on the four example images while hooks record every step's draws (latents, noise,
timesteps, captions), the initial adapter weights and the adapter weights after every optimizer step. A plain loop
then trains with peft (``inject_adapter_in_model``) on diffusers' UNet and CLIP text encoder from the same initial
weights on the same draws (``DDPMScheduler.add_noise``, ``F.mse_loss``, ``torch.optim.AdamW``,
``clip_grad_norm_``), once per variant: "matched" changes nothing, every other variant changes one setting (see
``VARIANTS``). One evaluator judges all results: ΔW merged into fresh copies of the base weights, then the fixed-noise
denoising loss (5 timesteps, fixed noise, VAE posterior means) on the training images ("learned") and on the eight
pattern images with their captions ("forgetting").

Printed: one JSON row per seed (loss changes; per module group the mean ratio of our per-step ΔW-update norm to the
reference's and their mean cosine), then a table: mean ± standard deviation over seeds, and the paired difference in
forgetting between ours and each variant with its t statistic.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

EVAL_TIMESTEPS = (100, 300, 500, 700, 900)
COLOURS = {
    "pink": (0.9, 0.5, 0.7),
    "grey": (0.5, 0.5, 0.5),
    "teal": (0.1, 0.6, 0.6),
    "brown": (0.5, 0.3, 0.1),
    "yellow": (1.0, 0.9, 0.1),
    "black": (0.0, 0.0, 0.0),
    "white": (1.0, 1.0, 1.0),
    "red": (0.5, 0.05, 0.05),
}
PROBES = (  # the "world" the base model is first trained on, and the forgetting probe: (pattern, colour a, colour b)
    ("horizontal stripes", "pink", "grey"),
    ("vertical stripes", "teal", "white"),
    ("a checkerboard", "teal", "brown"),
    ("a checkerboard", "black", "yellow"),
    ("a gradient", "black", "yellow"),
    ("a gradient", "red", "white"),
    ("scattered dots", "white", "red"),
    ("scattered dots", "yellow", "grey"),
)


# ---------------------------------------------------------------------------------------------------- data
def make_probe_images(size: int = 64) -> list[tuple[str, torch.Tensor]]:
    """Eight pattern images unlike the training shapes, as (caption, (3, H, W) in [-1, 1])."""
    y, x = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    dots = torch.rand(size, size, generator=torch.Generator().manual_seed(7)) > 0.95
    masks = {
        "horizontal stripes": (y // 8) % 2 == 0,
        "vertical stripes": (x // 8) % 2 == 0,
        "a checkerboard": ((y // 16) + (x // 16)) % 2 == 0,
        "scattered dots": dots,
    }
    out = []
    for pattern, ca, cb in PROBES:
        a, b = (torch.tensor(COLOURS[c])[:, None, None] for c in (ca, cb))
        if pattern == "a gradient":
            t = (x.float() / (size - 1))[None]
            img = a * (1 - t) + b * t
        else:
            img = torch.where(masks[pattern][None], a, b)
        caption = f"{pattern}, {ca} and {cb}" if pattern != "scattered dots" else f"{pattern}, {ca} on {cb}"
        out.append((caption, img.expand(3, size, size) * 2 - 1))
    return out


def sharpen_vae(vae, pixels: torch.Tensor) -> None:
    """Make the random tiny VAE usable for this experiment: a posterior with (almost) no spread and scaled latents of
    unit standard deviation, as a trained SD VAE gives. (The random VAE's posterior std is ~1.1 against a mean spread
    of ~0.2, so sampled latents would be mostly VAE noise and no image would matter.)"""
    with torch.no_grad():
        qc = vae.quant_conv
        qc.weight[4:] = 0
        qc.bias[4:] = -30.0  # logvar: std = exp(-15)
        std = float(vae.encode(pixels).latent_dist.mean.std()) * vae.config.scaling_factor
        qc.weight[:4] /= std
        qc.bias[:4] /= std


def make_base_model(folder: Path, steps: int, seed: int = 0) -> Path:
    """The tiny SD1 model with its UNet first trained (full, AdamW 1e-3, batch 4) on the probe images, so that it
    knows something a LoRA can make it forget; written as a diffusers folder."""
    from library.families.sd.tiny import build_tiny, save_diffusers

    torch.manual_seed(seed)
    parts = build_tiny("sd1")
    unet, te, vae, tok = parts.denoiser, parts.text_encoders[0], parts.vae, parts.tokenizers[0]
    from diffusers import DDPMScheduler

    sharpen_vae(vae, torch.stack([i for _, i in make_probe_images()]))

    sched = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    items = make_probe_images()
    with torch.no_grad():
        latents = vae.encode(torch.stack([i for _, i in items])).latent_dist.mean * vae.config.scaling_factor
        ids = tok([c for c, _ in items], padding="max_length", max_length=77, truncation=True, return_tensors="pt")
        cond = te(ids.input_ids)[0]
    unet.requires_grad_(True)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    unet.train()
    for _ in range(steps):
        idx = torch.randperm(len(items), generator=g)[:4]
        noise = torch.randn(latents[idx].shape, generator=g)
        t = torch.randint(0, 1000, (4,), generator=g)
        loss = F.mse_loss(unet(sched.add_noise(latents[idx], noise, t), t, cond[idx]).sample, noise)
        loss.backward()
        opt.step()
        opt.zero_grad()
    unet.eval()
    return save_diffusers(parts, folder)


def load_training_images(data_dir: Path) -> list[tuple[str, torch.Tensor]]:
    import numpy as np
    from PIL import Image

    out = []
    for png in sorted(data_dir.rglob("*.png")):
        arr = torch.from_numpy(np.asarray(Image.open(png).convert("RGB"), dtype=np.float32) / 127.5 - 1.0)
        out.append((png.with_suffix(".txt").read_text().strip(), arr.permute(2, 0, 1)))
    return out


# ---------------------------------------------------------------------------------------------------- evaluator
class Evaluator:
    """Fixed-noise denoising loss of base weights + ΔW (merged), with diffusers' own modules: independent of both
    trainers. Latents are the VAE posterior means (deterministic)."""

    def __init__(self, model_dir: Path, images: dict[str, list[tuple[str, torch.Tensor]]]):
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        self.unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet").eval()
        self.te = CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder").eval()
        self.tok = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
        self.sched = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler")
        vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae").eval()
        self.sets = {}
        with torch.no_grad():
            for name, items in images.items():
                pixels = torch.stack([img for _, img in items])
                latents = vae.encode(pixels).latent_dist.mean * vae.config.scaling_factor
                self.sets[name] = ([c for c, _ in items], latents)

    def loss(self, deltas: dict[tuple[int, str], torch.Tensor] | None = None) -> dict[str, float]:
        unet, te = copy.deepcopy(self.unet), copy.deepcopy(self.te)
        roots = [unet, te]
        with torch.no_grad():
            for (root, path), delta in (deltas or {}).items():
                w = roots[root].get_submodule(path).weight
                w.add_(delta.reshape(w.shape))
            out = {}
            for name, (captions, latents) in self.sets.items():
                ids = self.tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt")
                cond = te(ids.input_ids)[0]
                total = 0.0
                for i, t in enumerate(EVAL_TIMESTEPS):
                    g = torch.Generator().manual_seed(123 + i)
                    noise = torch.randn(latents.shape, generator=g)
                    tt = torch.full((len(captions),), t, dtype=torch.long)
                    pred = unet(self.sched.add_noise(latents, noise, tt), tt, cond).sample
                    total += float(F.mse_loss(pred, noise))
                out[name] = total / len(EVAL_TIMESTEPS)
        return out


# ---------------------------------------------------------------------------------------------------- our run
def run_ours(model_dir: Path, data_dir: Path, out_dir: Path, seed: int, a) -> dict:
    """train_network.run in-process; returns targets, initial params, per-step draws and per-step params."""
    import library.objectives.ddpm as objectives
    import library.run.train_step as training
    import train_network
    from library.run import loop

    rec: dict = {"draws": [], "captions": [], "steps": [], "grad_norms": []}
    orig_init, orig_step, orig_sync = (loop.Trainer.__init__, loop.Trainer.step_done,
                                       loop.Trainer.sync_gradients)  # fmt: skip
    orig_make, orig_cond = objectives.make_example, training.batch_cond

    def snapshot(network) -> dict:
        return {n: {k: p.detach().clone() for k, p in network.layer(n).adapter.params.items()} for n in network.names}

    def init(self, *args, **kw):
        orig_init(self, *args, **kw)
        rec["network"] = self.trainable
        rec["targets"] = {n: (self.trainable._slots[n].target.root, self.trainable._slots[n].target.path)
                          for n in self.trainable.names}  # fmt: skip
        rec["init"] = snapshot(self.trainable)
        rec["alpha"] = {n: float(self.trainable.layer(n).adapter.alpha) for n in self.trainable.names}

    def step_done(self, loss):
        orig_step(self, loss)
        rec["steps"].append(snapshot(self.trainable))

    def sync(self):
        grads = [p.grad for p in self.params if p.grad is not None]
        rec["grad_norms"].append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        orig_sync(self)

    def make_example(cfg, latents, schedule, generator=None, **kw):
        ex = orig_make(cfg, latents, schedule, generator, **kw)
        if "timesteps" not in kw or kw["timesteps"] is None:
            rec["draws"].append((latents.detach().clone(), ex.noise.detach().clone(), ex.timesteps.clone()))
        return ex

    def batch_cond(m, batch, generator=None):
        rec["captions"].append(list(batch.captions))
        return orig_cond(m, batch, generator)

    argv = [
        "--pretrained_model_name_or_path", str(model_dir), "--train_data_dir", str(data_dir),
        "--caption_extension", ".txt", "--resolution", "64", "--output_dir", str(out_dir), "--output_name", "ours",
        "--network_module", "networks.lora", "--network_dim", str(a.dim), "--network_alpha", str(a.alpha),
        "--learning_rate", str(a.lr), "--train_batch_size", "2", "--max_train_steps", str(a.steps),
        "--max_data_loader_n_workers", "0", "--seed", str(seed), "--max_grad_norm", str(a.max_grad_norm),
        *a.ours_args,
    ]  # fmt: skip
    loop.Trainer.__init__, loop.Trainer.step_done = init, step_done
    loop.Trainer.sync_gradients = sync
    objectives.make_example, training.batch_cond = make_example, batch_cond
    try:
        train_network.run(argv, family_names=("sd1", "sd2"))
    finally:
        loop.Trainer.__init__, loop.Trainer.step_done = orig_init, orig_step
        loop.Trainer.sync_gradients = orig_sync
        objectives.make_example, training.batch_cond = orig_make, orig_cond
    rec.pop("network")
    return rec


# ---------------------------------------------------------------------------------------------------- reference
# Reference variants: one setting of the plain loop changed at a time (name -> overrides of MATCHED).
MATCHED = {"targets": "same", "text_encoder": True, "max_grad_norm": None, "adamw": {}, "init": "ours"}
VARIANTS = {
    "matched": {},
    "attn_only": {"targets": "attn"},  # UNet: to_q/to_k/to_v/to_out.0 only (diffusers' LoRA examples)
    "attn_ff": {"targets": "attn_ff"},  # UNet: attention and feed-forward, no proj_in / proj_out
    "transformer_only": {"targets": "transformer"},  # UNet: no ResNet / up- / down-sampler convs (LoCon's extra)
    "unet_only": {"text_encoder": False},  # no text-encoder LoRA (diffusers' train_text_to_image_lora)
    "no_clip": {"max_grad_norm": 0.0},
    "no_weight_decay": {"adamw": {"weight_decay": 0.0}},
    "gaussian_init": {"init": "gaussian"},  # peft init_lora_weights="gaussian" (diffusers' examples)
}
ATTN = ("to_q", "to_k", "to_v", "to_out.0")
FF = ("ff.net.0.proj", "ff.net.2")


def reference_targets(ours: dict, v: dict) -> dict[str, tuple[int, str]]:
    out = {}
    for name, (root, path) in ours["targets"].items():
        if root == 1 and not v["text_encoder"]:
            continue
        if root == 0 and v["targets"] == "attn" and not path.endswith(ATTN):
            continue
        if root == 0 and v["targets"] == "attn_ff" and not path.endswith(ATTN + FF):
            continue
        if root == 0 and v["targets"] == "transformer" and ".attentions." not in path:
            continue
        out[name] = (root, path)
    return out


def attach_peft_lora(model, paths: dict[str, str], dim: int, alpha: float, init) -> dict:
    """peft's LoRA on ``model`` at ``paths`` (our module name -> module path); ``init``: our initial tensors per name
    ({"lora_down", "lora_up"}, copied into lora_A / lora_B), or peft's ``init_lora_weights`` value. Returns our name ->
    the peft layer, its lora_A / lora_B trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=dim, lora_alpha=alpha, target_modules=sorted(set(paths.values())), lora_dropout=0.0,
                        init_lora_weights=init if not isinstance(init, dict) else True)  # fmt: skip
    inject_adapter_in_model(config, model)
    modules = {n: model.get_submodule(p) for n, p in paths.items()}
    with torch.no_grad():
        for n, m in modules.items():
            if isinstance(init, dict):
                m.lora_A["default"].weight.copy_(init[n]["lora_down"])
                m.lora_B["default"].weight.copy_(init[n]["lora_up"])
            m.lora_A["default"].weight.requires_grad_(True)
            m.lora_B["default"].weight.requires_grad_(True)
    return modules


def run_reference(model_dir: Path, ours: dict, a, variant: str, seed: int) -> dict:
    """A plain diffusers + peft loop on our draws, from our initial weights, with ``VARIANTS[variant]`` changed."""
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    v = {**MATCHED, **VARIANTS[variant]}
    max_grad_norm = a.max_grad_norm if v["max_grad_norm"] is None else v["max_grad_norm"]
    torch.manual_seed(seed)  # the gaussian init
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet")
    te = CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder")
    tok = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
    sched = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler")
    roots = [unet, te]
    targets = reference_targets(ours, v)
    modules: dict = {}
    for root, model in enumerate(roots):
        model.requires_grad_(False)
        paths = {n: p for n, (r, p) in targets.items() if r == root}
        if paths:
            init = ours["init"] if v["init"] == "ours" else v["init"]
            modules.update(attach_peft_lora(model, paths, a.dim, a.alpha, init))
    params = [p for m in modules.values() for p in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
    opt = torch.optim.AdamW(params, lr=a.lr, **v["adamw"])
    unet.train(), te.train()
    snapshot = lambda: {n: {"lora_down": m.lora_A["default"].weight.detach().clone(),  # noqa: E731
                            "lora_up": m.lora_B["default"].weight.detach().clone()} for n, m in modules.items()}  # fmt: skip
    init_params, steps, grad_norms = snapshot(), [], []
    for (latents, noise, t), captions in zip(ours["draws"], ours["captions"]):
        ids = tok(captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        with torch.set_grad_enabled(v["text_encoder"]):
            cond = te(ids)[0]
        pred = unet(sched.add_noise(latents, noise, t), t, cond).sample
        loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        loss.backward()
        grad_norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(snapshot())
    scales = {n: m.scaling["default"] for n, m in modules.items()}
    return {"targets": targets, "init": init_params, "steps": steps, "grad_norms": grad_norms, "scale": scales}


# ---------------------------------------------------------------------------------------------------- comparison
def delta_w(params: dict, scale: float) -> torch.Tensor:
    up, down = params["lora_up"], params["lora_down"]
    return (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)) * scale


def group_of(name: str) -> str:
    if name.startswith("lora_te_"):
        return "te"
    for key in ("proj_in", "proj_out", "attn1", "attn2", "ff_net"):
        if key in name:
            return "unet " + key
    return "unet other"


def compare_steps(ours: dict, ref: dict, a) -> dict[str, dict[str, float]]:
    """Per module group (modules both runs train): mean over steps of the ratio of our per-step ΔW-update norm to
    the reference's, and the mean cosine between the two updates."""
    ratios: dict[str, list[float]] = {}
    cosines: dict[str, list[float]] = {}
    names = [n for n in ours["targets"] if n in ref["targets"]]
    scale_o = {n: ours["alpha"][n] / a.dim for n in names}
    prev_o = {n: delta_w(ours["init"][n], scale_o[n]) for n in names}
    prev_r = {n: delta_w(ref["init"][n], ref["scale"][n]) for n in names}
    for so, sr in zip(ours["steps"], ref["steps"]):
        acc: dict[str, list[float]] = {}
        for n in names:
            wo, wr = delta_w(so[n], scale_o[n]), delta_w(sr[n], ref["scale"][n])
            uo, ur = (wo - prev_o[n]).flatten(), (wr - prev_r[n]).flatten()
            prev_o[n], prev_r[n] = wo, wr
            g = acc.setdefault(group_of(n), [0.0, 0.0, 0.0])
            g[0] += float(uo.norm() ** 2)
            g[1] += float(ur.norm() ** 2)
            g[2] += float(uo @ ur)
        for g, (no, nr, dot) in acc.items():
            if nr > 0:
                ratios.setdefault(g, []).append(math.sqrt(no / nr))
                cosines.setdefault(g, []).append(dot / math.sqrt(no * nr) if no > 0 else 0.0)
    return {g: {"update_norm_ratio": statistics.mean(ratios[g]), "cosine": statistics.mean(cosines[g])}
            for g in sorted(ratios)}  # fmt: skip


def final_deltas(targets: dict, final: dict, scales: dict) -> dict:
    return {targets[n]: delta_w(final[n], scales[n]) for n in targets}


def summarise(rows: list[dict], variants: list[str]) -> None:
    def cell(vals: list[float]) -> str:
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return f"{statistics.mean(vals):+.2f} ± {sd:.2f}"

    print("| run | learned: train-image loss change, % | forgetting: unrelated-image loss change, % | "
          "forgetting, ours − run (paired t) |")  # fmt: skip
    print("|---|---|---|---|")
    print(f"| ours | {cell([r['ours']['learned'] for r in rows])} | {cell([r['ours']['forget'] for r in rows])} | |")
    for v in variants:
        diffs = [r["ours"]["forget"] - r[v]["forget"] for r in rows]
        sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        t = statistics.mean(diffs) / (sd / math.sqrt(len(diffs))) if sd > 0 else float("nan")
        t = float("nan") if abs(statistics.mean(diffs)) < 0.005 else t  # equal to float precision
        print(f"| reference, {v} | {cell([r[v]['learned'] for r in rows])} | {cell([r[v]['forget'] for r in rows])} "
              f"| {statistics.mean(diffs):+.2f} ± {sd:.2f} ({t:.1f}) |")  # fmt: skip
    if "matched" in variants:
        groups = [g for r in rows for g in r["matched"]["per_step_updates"].values()]
        ratios, cosines = [g["update_norm_ratio"] for g in groups], [g["cosine"] for g in groups]
        print(f"matched, every module group and seed: per-step update norm ratio ours/reference "
              f"{min(ratios):.7f} .. {max(ratios):.7f}, cosine >= {min(cosines):.7f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--alpha", type=float, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="both runs (a variant may change the reference's)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--ours_args", nargs="*", default=[], help="extra flags for train_network.py")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--base_steps", type=int, default=400, help="steps that teach the base model the probe images")
    p.add_argument("--summarise", nargs="*", default=None, metavar="LOG",
                   help="print the table from the JSON rows in earlier outputs (e.g. seeds run in two processes)")  # fmt: skip
    a = p.parse_args()
    if a.summarise is not None:
        by_seed: dict[int, dict] = {}  # rows of one seed from several outputs are merged
        for f in a.summarise:
            for row in (json.loads(x) for x in Path(f).read_text().splitlines() if x[:1] == "{"):
                by_seed.setdefault(row["seed"], {}).update(row)
        rows = [by_seed[k] for k in sorted(by_seed)]
        summarise(rows, [v for v in VARIANTS if all(v in r for r in rows)])
        return
    torch.set_num_threads(a.threads)
    import logging

    logging.disable(logging.WARNING)
    from library.run.demo import make_example_dataset

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_base_model(tmp / "base", a.base_steps)
        data_dir = make_example_dataset(tmp / "data")
        ev = Evaluator(model_dir, {"train": load_training_images(data_dir), "probe": make_probe_images()})
        base = ev.loss()

        def changes(losses: dict) -> dict:
            return {"learned": 100 * (losses["train"] / base["train"] - 1),
                    "forget": 100 * (losses["probe"] / base["probe"] - 1)}  # fmt: skip

        for seed in a.seeds:
            ours = run_ours(model_dir, data_dir, tmp / f"out{seed}", seed, a)
            ours_scale = {n: ours["alpha"][n] / a.dim for n in ours["targets"]}
            row = {"seed": seed, "ours": changes(ev.loss(final_deltas(ours["targets"], ours["steps"][-1], ours_scale)))}
            for v in a.variants:
                ref = run_reference(model_dir, ours, a, v, seed)
                row[v] = changes(ev.loss(final_deltas(ref["targets"], ref["steps"][-1], ref["scale"])))
                row[v]["grad_norm_step1"] = (ours["grad_norms"][0], ref["grad_norms"][0])
                row[v]["per_step_updates"] = compare_steps(ours, ref, a)
            rows.append(row)
            print(json.dumps(row, default=lambda x: round(x, 6) if isinstance(x, float) else x), flush=True)
    print(
        f"\nthreads: {torch.get_num_threads()}; seeds {a.seeds}; {a.steps} steps, dim {a.dim}, alpha {a.alpha}, "
        f"lr {a.lr}; base fixed-noise loss: train images {base['train']:.5f}, unrelated {base['probe']:.5f}"
    )
    summarise(rows, a.variants)


if __name__ == "__main__":
    main()
