"""Put known bugs into the code one at a time, run the tests meant to catch each, take the bug out (run by hand).

    python benchmarks/check_mutations.py [--only WORDS ...] [--list]

Each mutation replaces one exact piece of source text (it must occur once) and runs the tests that name the
behaviour; a mutation is caught when pytest fails. The file is restored after every run, also on Ctrl-C. Refuses to
start when a file it would touch has uncommitted changes. Prints one line per mutation and its failing tests.
The table of issue 25's closing note came from these; when a refactor moves the text, update the entry.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (what the bug is, file, text as it is, text with the bug, tests that must fail)
MUTATIONS = [
    ("--ema_decay ignored", "library/run/trainer.py", "self.params, ema_cfg.ema_decay,", "self.params, 0.999,",
     ["tests/test_wiring.py::test_ema_file_follows_the_documented_recurrence"]),
    ("live and EMA files swapped", "library/run/trainer.py",
     'ema_path = path.with_name(path.stem + "-ema" + path.suffix)\n                    ema_meta',
     'ema_path = path\n                    path = path.with_name(path.stem + "-ema" + path.suffix)\n                    ema_meta',
     ["tests/test_wiring.py::test_ema_file_follows_the_documented_recurrence"]),
    ("SDXL original size and crop swapped", "library/families/sd/sdxl.py",
     "return self.time_ids(*([[int(v) for v in pair] for pair in x] for x in lists))",
     "return self.time_ids(*([[int(v) for v in pair] for pair in x] for x in (lists[1], lists[0], lists[2])))",
     ["tests/test_wiring.py::test_sdxl_step_hands_the_unet_diffusers_time_ids"]),
    ("gradients summed over processes", "library/run/trainer.py", 'p.grad = self.acc.reduce(p.grad, reduction="mean")',
     'p.grad = self.acc.reduce(p.grad, reduction="sum")',
     ["tests/test_fine_tune_multiprocess.py::test_two_processes_agree_and_equal_one_process_with_the_total_batch"]),
    ("--gradient_checkpointing ignored", "library/run/setup.py",
     "    if run.gradient_checkpointing or offload:\n        enable_checkpointing(", "    if False:\n        enable_checkpointing(",
     ["tests/test_wiring.py::test_gradient_checkpointing_checkpoints_and_lowers_the_step_peak",
      "tests/test_gpu_paths.py::test_trained_text_encoder_checkpoints_its_layers"]),
    ("accumulation divided twice", "library/run/runtime.py", "        gradient_accumulation_steps=1,",
     "        gradient_accumulation_steps=cfg.gradient_accumulation_steps,", ["tests/test_accumulation.py"]),
    ("SD1 up-block index off by one", "library/families/sd/blocks.py",
     'return 1 + idx if side == "down" else 13 + idx', 'return 1 + idx if side == "down" else 12 + idx',
     ["tests/test_corpus.py::test_train_network_readme_network_args"]),
    ("conv_alpha defaults to conv_dim", "networks/config.py",
     "alpha = 1.0 if self.conv_alpha is None else self.conv_alpha",
     "alpha = float(dim) if self.conv_alpha is None else self.conv_alpha",
     ["tests/test_corpus.py::test_train_network_readme_network_args"]),
    ("euler_a built as plain Euler", "library/sampling/schedulers.py",
     '"euler_a": ("EulerAncestralDiscreteScheduler", {}),', '"euler_a": ("EulerDiscreteScheduler", {}),',
     ["tests/test_sampling_generate.py"]),
    ("--learning_rate_te read as unset", "library/families/sd/full_training.py",
     '        lrs = (getattr(args, "learning_rate_te", None),)',
     "        lrs = (None,)", ["tests/test_flags_fine_tune.py"]),
    ("multi-vector token spelt in reverse", "library/run/token_embeddings.py",
     'return text.replace(self.token, " ".join(self.names))',
     'return text.replace(self.token, " ".join(reversed(self.names)))', ["tests/test_reference_steps.py"]),
    ("noise schedule read one timestep late", "library/objectives/noising.py",
     "return self.alphas_cumprod[t.to(self.alphas_cumprod.device, torch.long)]",
     "return self.alphas_cumprod[(t.to(self.alphas_cumprod.device, torch.long) + 1).clamp(max=len(self.alphas_cumprod) - 1)]",
     ["tests/test_reference_steps.py"]),
    ("SDXL pooled output read at the last token", "library/families/sd/text.py",
     "index = (ids == eos_token_id).int().argmax(dim=1).to(last_hidden.device)",
     "index = torch.full((ids.shape[0],), ids.shape[1] - 1, dtype=torch.long, device=last_hidden.device)",
     ["tests/test_reference_loop.py"]),
    ("LoRA scale alpha instead of alpha / rank", "networks/layers.py", "return self.alpha / r if r else 1.0",
     "return self.alpha if r else 1.0", ["tests/test_reference_loop.py"]),
    ("files carry alpha = rank", "networks/layers.py", '        out["alpha"] = self.alpha.detach()',
     '        out["alpha"] = torch.tensor(float(self.rank or 1))',
     ["tests/test_train_network.py::test_lora_loads_in_diffusers_and_changes_the_output"]),
]  # fmt: skip


def run_one(name: str, rel: str, old: str, new: str, tests: list[str]) -> bool:
    path = ROOT / rel
    text = path.read_text()
    if text.count(old) != 1:
        print(f"?? {name}: the text to change occurs {text.count(old)} times in {rel}; update this entry")
        return False
    path.write_text(text.replace(old, new))
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "-x", *tests]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(text)
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    caught = result.returncode != 0
    print(f"{'caught' if caught else 'MISSED'}: {name} ({rel})")
    for line in failed[:3]:
        print(f"    {line[:160]}")
    return caught


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=[], help="run the mutations whose name contains one of these")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or any(w in m[0] for w in args.only)]
    if args.list:
        for name, rel, *_, tests in chosen:
            print(f"{name}: {rel} -> {' '.join(tests)}")
        return 0
    files = sorted({m[1] for m in chosen})
    dirty = subprocess.run(["git", "status", "--porcelain", *files], cwd=ROOT, capture_output=True, text=True).stdout
    if dirty.strip():
        print(f"uncommitted changes in files this would edit:\n{dirty}commit or stash them first")
        return 2
    missed = sum(not run_one(*m) for m in chosen)
    print(f"{len(chosen) - missed} of {len(chosen)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
