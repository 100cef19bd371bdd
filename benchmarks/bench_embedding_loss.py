"""Fixed-noise denoising loss on the training images before and after training: textual inversion alone, a LoRA
alone and pivotal tuning (LoRA + new token), on the tiny SD1 model and the four example images whose captions start
with the new token (run by hand; the numbers go into docs/training.md).

    OMP_NUM_THREADS=1 python benchmarks/bench_embedding_loss.py [--steps 200]

The loss is library.training.validation_loss over the training images at timesteps 100/300/500/700/900 with noise
from seed 123 (deterministic: the same weights give the same value). Checked on the way: textual inversion leaves
every UNet weight and every existing token row bit-identical; "blank captions" is the loss at the start with every
caption replaced by "" (how far the tiny model's text path can move the loss at all).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_network  # noqa: E402
import train_textual_inversion  # noqa: E402
from library.demo import make_example_dataset, make_tiny_model  # noqa: E402
from library.training import validation_loss  # noqa: E402

TOKEN = "shapetok"


def _fixed_noise_loss(run) -> float:
    return validation_loss(run.step_models, run.make_loader().epoch(0), 123, [100, 300, 500, 700, 900])


def _measured(module, argv: list[str]) -> dict:
    """Run ``module.main(argv)`` with its ``train`` wrapped: loss before / after, blank-caption loss, and whether the
    UNet and the old token rows stayed bit-identical."""
    out: dict = {}
    original = module.train

    def train(run, trainable, groups):
        trained = {id(p) for p in trainable.parameters()}
        unet = {k: p.detach().clone() for k, p in run.parts.unet.named_parameters() if id(p) not in trained}
        tables = [te.get_input_embeddings().weight.detach().clone() for te in run.parts.text_encoders]
        out["before"] = _fixed_noise_loss(run)
        rewrite = run.step_models.caption_rewrite
        run.step_models.caption_rewrite = lambda captions, generator: ["" for _ in captions]
        out["blank_captions_at_start"] = _fixed_noise_loss(run)
        run.step_models.caption_rewrite = rewrite
        result = original(run, trainable, groups)
        out["after"] = _fixed_noise_loss(run)
        out["drop_percent"] = round(100 * (1 - out["after"] / out["before"]), 2)
        now = dict(run.parts.unet.named_parameters())
        out["base_unet_unchanged"] = all(torch.equal(v, now[k]) for k, v in unet.items())  # adapters aside
        out["old_token_rows_unchanged"] = all(
            torch.equal(t, te.get_input_embeddings().weight[: t.shape[0]])
            for t, te in zip(tables, run.parts.text_encoders)
        )
        return result

    module.train = train
    try:
        module.main(argv)
    finally:
        module.train = original
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    model, data = make_tiny_model(tmp / "model", "sd1"), make_example_dataset(tmp / "data")
    for txt in data.rglob("*.txt"):
        txt.write_text(txt.read_text().replace("sks shape", f"{TOKEN} shape"))
    common = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension",
              ".txt", "--resolution", "64", "--train_batch_size", "2", "--max_train_steps", str(args.steps),
              "--max_data_loader_n_workers", "0", "--seed", "1"]  # fmt: skip
    ti = ["--token_string", TOKEN, "--init_word", "shape", "--num_vectors_per_token", "2", "--learning_rate", "5e-2"]
    lora = ["--network_module", "networks.lora", "--network_dim", "8", "--network_alpha", "8", "--network_args",
            "conv_dim=8", "conv_alpha=8", "--learning_rate", "3e-3"]  # fmt: skip
    pivotal = [*lora, "--embedding", f"{TOKEN}=shape:2", "--embedding_lr", "5e-2"]
    results = {
        "textual inversion": _measured(train_textual_inversion, [*common, *ti, "--output_dir", str(tmp / "ti")]),
        "LoRA": _measured(train_network, [*common, *lora, "--output_dir", str(tmp / "lora")]),
        "pivotal tuning": _measured(train_network, [*common, *pivotal, "--output_dir", str(tmp / "pivotal")]),
    }
    print(json.dumps({"steps": args.steps, **results}, indent=1))


if __name__ == "__main__":
    main()
