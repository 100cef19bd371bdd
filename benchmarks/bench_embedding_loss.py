"""Fixed-noise denoising loss on the training images before and after training textual inversion alone, a LoRA alone
and pivotal tuning (LoRA + new token), on a tiny SD1 base that depends on its text (run by hand; the numbers go into
docs/training.md).

    OMP_NUM_THREADS=1 python benchmarks/bench_embedding_loss.py [--base_steps 1200] [--steps 200]   # ~3 min

A freshly built tiny model barely listens to its text (blanking every caption moves its loss ~1.5 %): its random
VAE's latents carry almost nothing of the image (std 0.04 after the 0.18215 scale, under sampling noise of std ~1),
and its UNet never learned to read the text. So its VAE is first rescaled to usable latents and the model fully
fine-tuned (fine_tune.py in-process, UNet and text encoder) on four concepts on one grey background that only the
caption tells apart ("a red square", "a blue circle", ...; three images each). Its text dependence is reported as the loss
with blank captions and with each caption swapped for another concept's. Then the red-square images alone, captioned
with a new token initialised from an unrelated word ("dog"), train textual inversion / a LoRA / pivotal tuning on
that base; their references are the loss with the true caption "a red square", with blank captions and with "a blue
circle".

The loss is library.run.train_step.validation_loss over the training images at timesteps 100/300/500/700/900 with noise
from seed 123 (deterministic: the same weights give the same value). Checked on the way: textual inversion leaves
every UNet weight and every existing token row bit-identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fine_tune  # noqa: E402
import train_network  # noqa: E402
import train_textual_inversion  # noqa: E402
from library.run.demo import make_concept_dataset  # noqa: E402
from library.run.train_step import validation_loss  # noqa: E402

TOKEN = "shapetok"
CONCEPTS = (
    ("a red square", (220, 40, 40), "square"),
    ("a blue circle", (40, 60, 220), "circle"),
    ("a yellow triangle", (230, 210, 40), "triangle"),
    ("a green cross", (40, 170, 60), "cross"),
)
SWAP = {CONCEPTS[i][0]: CONCEPTS[(i + 1) % len(CONCEPTS)][0] for i in range(len(CONCEPTS))}


def _fixed_noise_loss(run) -> float:
    return validation_loss(run.step_models, run.make_loader().epoch(0), 123, [100, 300, 500, 700, 900])


def _reference_losses(run, references: dict) -> dict:
    """The fixed-noise loss with every caption rewritten by each of ``references`` (name: caption -> caption)."""
    out, rewrite = {}, run.step_models.caption_rewrite
    for name, change in references.items():
        run.step_models.caption_rewrite = lambda captions, generator: [change(c) for c in captions]  # noqa: B023
        out[name] = _fixed_noise_loss(run)
    run.step_models.caption_rewrite = rewrite
    return out


def _measured(module, argv: list[str], references: dict) -> dict:
    """Run ``module.run(argv)`` with its ``train`` wrapped: loss before / after, the reference losses before / after,
    and whether the untrained UNet weights and the old token rows stayed bit-identical."""
    out: dict = {}
    original = module.train

    def train(run, trainable, groups):
        trained = {id(p) for p in trainable.parameters()}
        unet = {k: p.detach().clone() for k, p in run.parts.denoiser.named_parameters() if id(p) not in trained}
        tables = [te.get_input_embeddings().weight.detach().clone() for te in run.parts.text_encoders]
        out["before"] = _fixed_noise_loss(run)
        out["references_before"] = _reference_losses(run, references)
        start = time.perf_counter()
        result = original(run, trainable, groups)
        out["seconds"] = round(time.perf_counter() - start, 1)
        out["after"] = _fixed_noise_loss(run)
        out["references_after"] = _reference_losses(run, references)
        out["change_percent"] = round(100 * (out["after"] / out["before"] - 1), 1)
        now = dict(run.parts.denoiser.named_parameters())
        out["untrained_unet_weights_unchanged"] = all(torch.equal(v, now[k]) for k, v in unet.items())
        out["old_token_rows_unchanged"] = all(
            torch.equal(t, te.get_input_embeddings().weight[: t.shape[0]])
            for t, te in zip(tables, run.parts.text_encoders)
        )
        out["result"] = result
        return result

    module.train = train
    try:
        module.run(argv)
    finally:
        module.train = original
    return out


def tiny_model_with_usable_latents(folder: Path, pixels: torch.Tensor) -> Path:
    """The tiny SD1 model with its random VAE made usable for this: the latent means of ``pixels`` rescaled to unit
    standard deviation after SD's 0.18215 scale (the freshly built VAE gives 0.04) and the latent variance made
    negligible (it is ~1, which buries the image under sampling noise); the decoder undoes the rescale."""
    from library.families.sd.tiny import build_tiny, save_diffusers

    parts = build_tiny("sd1")
    vae = parts.vae
    with torch.no_grad():
        k = 1 / (vae.encode(pixels).latent_dist.mean.std().item() * 0.18215)
        vae.quant_conv.weight[:4] *= k  # mean channels
        vae.quant_conv.bias[:4] *= k
        vae.quant_conv.weight[4:] = 0  # log-variance channels: std e^-10
        vae.quant_conv.bias[4:] = -20.0
        vae.post_quant_conv.weight /= k
    return save_diffusers(parts, folder)


def _pixels(folder: Path) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    images = [np.asarray(Image.open(p).convert("RGB"), np.float32) for p in sorted(folder.rglob("*.png"))]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2) / 127.5 - 1


def text_dependent_base(tmp: Path, steps: int, lr: float, common: list[str]) -> tuple[Path, dict]:
    """The tiny SD1 model fully fine-tuned on the four concepts: its folder and its loss figures."""
    data = make_concept_dataset(tmp / "concepts", CONCEPTS)
    model = tiny_model_with_usable_latents(tmp / "model", _pixels(data))
    argv = [*common, "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
            "--train_batch_size", "4", "--max_train_steps", str(steps), "--learning_rate", str(lr), "--train_text_encoder",
            "--save_model_as", "diffusers", "--output_dir", str(tmp / "base"), "--output_name", "base"]  # fmt: skip
    references = {"blank_captions": lambda c: "", "swapped_captions": lambda c: SWAP.get(c.strip(), c)}
    figures = _measured(fine_tune, argv, references)
    del figures["untrained_unet_weights_unchanged"], figures["old_token_rows_unchanged"]  # all of it is trained
    return Path(figures.pop("result").output), figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_steps", type=int, default=1200)
    parser.add_argument("--base_lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ti_lr", type=float, default=5e-2)
    parser.add_argument("--vectors", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    common = ["--caption_extension", ".txt", "--resolution", "64", "--max_data_loader_n_workers", "0", "--seed", "1"]
    base, base_figures = text_dependent_base(tmp, args.base_steps, args.base_lr, common)
    concept = make_concept_dataset(tmp / "concept", CONCEPTS[:1])
    for txt in concept.rglob("*.txt"):
        txt.write_text(f"{TOKEN}\n")
    common += ["--pretrained_model_name_or_path", str(base), "--train_data_dir", str(concept),
               "--train_batch_size", "3", "--max_train_steps", str(args.steps)]  # fmt: skip
    ti = ["--token_string", TOKEN, "--init_word", "dog", "--num_vectors_per_token", str(args.vectors),
          "--learning_rate", str(args.ti_lr)]  # fmt: skip
    lora = ["--network_module", "networks.lora", "--network_dim", "8", "--network_alpha", "8", "--network_args",
            "conv_dim=8", "conv_alpha=8", "--learning_rate", "3e-3"]  # fmt: skip
    pivotal = [*lora, "--embedding", f"{TOKEN}=dog:{args.vectors}", "--embedding_lr", str(args.ti_lr)]
    true, other = CONCEPTS[0][0], CONCEPTS[1][0]
    references = {"true_caption": lambda c: true, "blank_captions": lambda c: "", "other_caption": lambda c: other}
    results = {
        "textual inversion": _measured(
            train_textual_inversion, [*common, *ti, "--output_dir", str(tmp / "ti")], references
        ),
        "LoRA": _measured(train_network, [*common, *lora, "--output_dir", str(tmp / "lora")], references),
        "pivotal tuning": _measured(
            train_network, [*common, *pivotal, "--output_dir", str(tmp / "pivotal")], references
        ),
    }
    for figures in results.values():
        figures.pop("result")
    print(json.dumps({"args": vars(args), "text-dependent base (fine_tune)": base_figures, **results}, indent=1))


if __name__ == "__main__":
    main()
