"""Device memory per phase of a whole real-size FLUX.2 klein LoRA run at 1024 px (flux_2_train_network.py).

    python benchmarks/flux2_memory.py                                   # every row, on the simulated device (any CPU)
    python benchmarks/flux2_memory.py --rows klein-9b:fp8:0 --no_sample
    python benchmarks/flux2_memory.py --tiny                            # the same runs on the tiny model (a smoke check)

The run is flux_2_train_network.run unchanged on the released architectures (klein 4B: 5 + 20 blocks of 3072 with
Qwen3-4B; klein 9B: 8 + 24 blocks of 4096 with Qwen3-8B) and FLUX.2's AE, built from the family's ``reference`` and
``autoencoders/flux2.RELEASED`` as uninitialised host memory (no file read: only ``family.load`` is replaced; the
tokenizer is the shipped one). Float8 storage (rows ``VARIANT:fp8:N``: musubi-tuner's ``--fp8_base --fp8_scaled
--fp8_text_encoder``, the DiT with the family's ``fp8_skip``, the text encoder with "norm") is done by this loader on
the meta device with the run's rule.

Settings (musubi-tuner's documented line): ``--gradient_checkpointing --mixed_precision bf16``, latents and text
outputs cached in the run, batch 1, ``networks.lora_flux_2`` rank 32, AdamW, one 1024 px image, one sample after two
steps (1024 px, 4 steps, klein base's true CFG 4 with the negative prompt), the save. Rows ``VARIANT:MODE:N``: klein-4b
or klein-9b, bf16 or fp8 weights, ``--blocks_to_swap N`` (0: none).

library/measure/simulated_device.py counts every device-resident tensor per phase with real shapes and lifetimes,
attention as the fused kernel a GPU runs. A row meets its goal when every phase's peak + 1 GiB (CUDA context) is at
most the issue's goal (klein 4B 8 GiB, klein 9B 12 GiB). Prints one JSON line per row, then a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "benchmarks"))

ROWS = ("klein-4b:bf16:0", "klein-4b:fp8:0", "klein-9b:bf16:0", "klein-9b:fp8:0", "klein-9b:fp8:6", "dev:fp8:0",
        "dev:fp8:24")  # fmt: skip
VARIANTS, MODES = ("klein-4b", "klein-9b", "dev"), ("bf16", "fp8")
GOALS_GIB, CONTEXT_GIB = {"klein-4b": 8.0, "klein-9b": 12.0, "dev": 24.0}, 1.0
SETTINGS = ["--mixed_precision", "bf16", "--gradient_checkpointing", "--timestep_sampling", "flux2_shift",
            "--weighting_scheme", "none"]  # fmt: skip


class RealSizeLoader:
    """``family.load`` that returns a released FLUX.2 klein architecture as uninitialised host memory (module
    docstring), with the tokenizers, scheduler and settings of the tiny model at ``path``. :meth:`prepare` makes the
    parts before the run, outside the simulated device."""

    def __init__(self, family) -> None:
        self.family, self.tiny_load, self.parts = family, family.load, None

    def prepare(self, variant: str, dtype, fp8: bool) -> None:
        from accelerate import init_empty_weights

        from library.device.fp8 import store_in_fp8
        from library.families.autoencoders import flux2 as ae
        from library.families.flux2.family import reference

        ref = reference(self.family.name, variant.replace("klein-", "klein-base-"))
        self.variant = variant
        with init_empty_weights(include_buffers=True):
            vae = ae.factory(ae.RELEASED)()

        def empty(module, fp8_skip=None):
            module = module.to(dtype).requires_grad_(False)
            if fp8 and fp8_skip is not None:  # --fp8_base's cast, on meta (the run's cast skips stored layers)
                store_in_fp8(module, dtype, skip=fp8_skip)  # scaled or not: the same bytes (meta has no max)
            return module.to_empty(device="cpu").eval()

        denoiser = empty(ref.denoiser, self.family.fp8_skip)
        encoders = [empty(te, ("norm",)) for te in ref.text_encoders]
        vae = vae.to(dtype).to_empty(device="cpu").eval().requires_grad_(False)
        self.parts = dataclasses.replace(ref, denoiser=denoiser, vae=vae, text_encoders=encoders,
                                         source=f"real-size FLUX.2 {variant}")  # fmt: skip

    def __call__(self, path, *, dtype=None, device="cpu", **options):
        import torch

        tiny = self.tiny_load(Path(path) / "dev" if self.variant == "dev" else path, dtype=torch.float32,
                              device=device, **options)  # fmt: skip
        parts, self.parts = self.parts, None
        if parts is None:
            raise RuntimeError("RealSizeLoader: call prepare() before each run")
        dev = parts.scheduler_config["model_version"] == "dev"
        config = dict(tiny.scheduler_config, model_version=parts.scheduler_config["model_version"],
                      guidance_distilled=dev, default_steps=4, default_guidance=1.0 if dev else 4.0)  # fmt: skip
        return dataclasses.replace(parts, tokenizers=tiny.tokenizers, scheduler_config=config, family=tiny.family,
                                   options=tiny.options)  # fmt: skip


def measure(row: str, args: argparse.Namespace, work: Path) -> dict:
    import torch

    import flux_2_train_network
    from library.families import get_family
    from library.measure.simulated_device import simulated_device

    variant, name, swap = row.split(":")
    swap = int(swap)
    argv = ["--dit", str(work / "tiny"), "--model_version", variant.replace("klein-", "klein-base-"), "--dataset_config", str(work / "dataset.toml"),
            "--output_dir", str(work / "out"), "--output_name", f"lora-{variant}-{name}{swap}",
            "--network_module", "networks.lora_flux_2", "--network_dim", "32", "--network_alpha", "32",
            "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--max_train_steps", "2",
            "--max_data_loader_n_workers", "0", "--seed", "0", *SETTINGS]  # fmt: skip
    if swap:
        argv += ["--blocks_to_swap", str(swap)]
    if name == "fp8":
        argv += ["--fp8_base", "--fp8_scaled", "--fp8_text_encoder"]
    argv += args.extra.split()
    if not args.no_sample:
        argv += ["--sample_prompts", str(work / "prompts.txt"), "--sample_every_n_steps", "2"]
    family = get_family("flux2")
    start = time.time()
    if isinstance(family.load, RealSizeLoader):
        family.load.prepare(variant, torch.bfloat16, fp8=name == "fp8")
    with simulated_device() as sim:
        flux_2_train_network.run(argv)
    table = {k: round(v / 1024, 2) for k, v in sim.phase_table().items()}  # MiB -> GiB
    highest = max(table.values())
    return {"row": row, "variant": variant, "weights": name, "blocks_to_swap": swap, "peak_gib": table,
            "highest_gib": highest, "goal_gib": GOALS_GIB[variant],
            "meets_goal": highest + CONTEXT_GIB <= GOALS_GIB[variant], "wall_s": round(time.time() - start, 1),
            "extra": args.extra, "model": "tiny" if args.tiny else f"real-size {variant}"}  # fmt: skip


def prepare_work(work: Path, resolution: int) -> None:
    """One image and its caption at ``resolution`` in musubi-tuner's dataset TOML, the sample prompt, and the tiny
    model whose tokenizer and settings the real-size loader takes (a folder under ``work/tiny``)."""
    from library.families import get_family
    from library.run.demo import make_example_dataset

    if not (work / "data").exists():
        make_example_dataset(work / "four", size=resolution)
        (work / "data").mkdir(parents=True)
        for f in sorted((work / "four" / "10_sks shape").iterdir())[:2]:
            (work / "data" / f.name).write_bytes(f.read_bytes())
    (work / "dataset.toml").write_text(
        f'[general]\nresolution = [{resolution}, {resolution}]\ncaption_extension = ".txt"\nbatch_size = 1\n\n'
        f'[[datasets]]\nimage_directory = "{(work / "data").as_posix()}"\nnum_repeats = 1\n'
    )
    (work / "prompts.txt").write_text(f"a red circle --w {resolution} --h {resolution} --s 4 --n blurry\n")
    if not (work / "tiny").exists():
        family = get_family("flux2")
        family.tiny.write_folder(family.tiny.build(), work / "tiny")
        write_tiny_dev(work / "tiny" / "dev")


def write_tiny_dev(folder: Path) -> None:
    """A tiny dev folder for the real-size loader's tokenizer and settings: the tiny DiT with guidance, a tiny
    Mistral 3 and a word-level tokenizer with Mistral's chat markers (Mistral's own is not shipped)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from library.families.autoencoders import flux2 as ae
    from library.families.encoders import mistral3
    from library.families.flux2 import model as M
    from library.files.weights import save_state_dict

    special = ["<unk>", "<s>", "</s>", "<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(special + ["a", "red", "circle"])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", additional_special_tokens=special[4:])  # fmt: skip
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}[SYSTEM_PROMPT]"
                          "{{ m.content[0].text }}[/SYSTEM_PROMPT]{% else %}[INST]{{ m.content[0].text }}[/INST]"
                          "{% endif %}{% endfor %}")  # fmt: skip
    for sub in ("transformer", "text_encoder", "vae"):
        (folder / sub).mkdir(parents=True)
    fast.save_pretrained(folder / "tokenizer")
    dit = M.build(dict(M.TINY, guidance_embeds=True))
    dit.save_config(folder / "transformer")
    save_state_dict(dict(dit.state_dict()), folder / "transformer" / "diffusion_pytorch_model.safetensors", {})
    te = mistral3.factory(mistral3.TINY)()
    save_state_dict({"model.language_model." + k: v for k, v in te.state_dict().items()},
                    folder / "text_encoder" / "model.safetensors", {})  # fmt: skip
    save_state_dict(
        dict(ae.factory(ae.TINY)().state_dict()), folder / "vae" / "diffusion_pytorch_model.safetensors", {}
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), help="VARIANT:MODE:N rows")
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--no_sample", action="store_true", help="leave the sampling round out")
    parser.add_argument("--extra", default="", help="flags added to every row (one string)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (checks the runs, not the memory)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    for row in args.rows:
        parts = row.split(":")
        if len(parts) != 3 or parts[0] not in VARIANTS or parts[1] not in MODES or not parts[2].isdigit():
            parser.error(f"--rows {row}: expected VARIANT:MODE:N ({'|'.join(VARIANTS)} : {'|'.join(MODES)} : N)")
    import torch
    from bench_block_swap import fused_attention
    from bench_flux_memory import lazy_host_copies, uncounted_swap_check

    from library.families import get_family

    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="flux2mem-"))
    prepare_work(work, args.resolution)
    if not args.tiny:
        family = get_family("flux2")
        if not isinstance(family.load, RealSizeLoader):
            family.load = RealSizeLoader(family)
        lazy_host_copies()
    uncounted_swap_check()
    fused_attention(torch)  # SDPA as the fused kernel a GPU runs
    rows = []
    for row in args.rows:
        result = measure(row, args, work)
        rows.append(result)
        print(json.dumps(result), flush=True)
    phases = list(rows[0]["peak_gib"])
    print(f"\n| model | weights | --blocks_to_swap | {' | '.join(phases)} | highest + {CONTEXT_GIB:g} GiB | goal |")
    print("|---" * (len(phases) + 5) + "|")
    for r in rows:
        cells = " | ".join(str(r["peak_gib"].get(p, "")) for p in phases)
        print(f"| {r['variant']} | {r['weights']} | {r['blocks_to_swap']} | {cells} | "
              f"{r['highest_gib'] + CONTEXT_GIB:.2f} | {'<=' if r['meets_goal'] else 'OVER'} {r['goal_gib']:g} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
