#!/usr/bin/env python3
"""Paired whole-process benchmark: kohya-ss/sd-scripts vs this checkout (and optionally a second, "before" one).

    python3 benchmarks/bench_vs_sdscripts.py --sdscripts ~/sd-scripts --sdsvenv ~/sd-scripts/venv \\
        [--before ~/sdtrain-old] --cases sd1,sdxl --pairs 5 --steps 10,40 --threads 2

Every side trains the same tiny model (real SD1/SDXL block layouts, small widths) on the same data with the same
flags under ``accelerate launch --cpu --num_processes 1`` and ``/usr/bin/time -v``, each with its own venv's
accelerate, one after the other for every pair and step count: sd-scripts, [before,] sdtrain in the first pair, the
reverse in the second, and so on (a side's place in the pair does not favour it). sd-scripts runs unmodified
through benchmarks/peer/run_sdscripts_tiny.py (patches its hard-coded UNet widths to the tiny model's) with the
torchvision stand-in benchmarks/peer/sds_shims on PYTHONPATH; sd-scripts is never a dependency of sdtrain.

Per run: whole-process wall and CPU (user+sys) seconds, peak RSS, time to first step (launch -> first update of the
"steps" progress bar; stamps come from a sitecustomize.py put first on PYTHONPATH), s/step (median interval of
steps 3..N of those stamps; their mean; the process's CPU seconds from step 2 to N over N - 2, read at the stamps:
the loop's CPU free of start-up and save) and, per pair, (wall(N_max) - wall(N_min)) / (N_max - N_min) as a stamp-free s/step.
The output file's key+shape set of every side is compared. Results: OUT/runs.jsonl, OUT/summary.md, one folder
per run with its log. ``--summarize OUT`` re-prints the tables of an earlier run.

musubi-tuner's families (``--musubi ~/musubi --sdsvenv VENV --cases qwen_image,zimage,flux2,qwen_image_edit,flux2_dev``, an invocation of
their own; benchmarks/peer/musubi_cases.py): each side first runs its caching scripts on the run's own dataset TOML
(untimed), then the training script is timed as above; the reference side is labelled "musubi-tuner".
OneTrainer's families (``--onetrainer ~/sdtrain-peer/onetrainer --sdsvenv ~/sdtrain-peer/otvenv --cases
pixart_sigma,pixart_alpha``, an invocation of their own; benchmarks/peer/onetrainer_cases.py): its ``scripts/train.py``
on a JSON config each run writes (the same numbers as our flags), under the same launcher; the side is "OneTrainer".

Assets (tiny models, 8-image dataset, sd-scripts' tokenizer cache) live in ``--assets`` (default $PEER_WORK or
~/.cache/sdtrain-bench): built there on first use with the sd-scripts venv's python (its diffusers/transformers
write files both sides read). Measure on an idle machine; on 2 cores a second busy process makes ratios noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEER = HERE / "peer"
sys.path.insert(0, str(PEER))
from dit_cases import DIT_CASES, dit_flags, reference_wrapper  # noqa: E402
from musubi_cases import MUSUBI_CASES, cache_commands, control_folder, train_flags, write_dataset_toml  # noqa: E402
from onetrainer_cases import ONETRAINER_CASES, TRAIN, our_flags, write_config  # noqa: E402
from pairs import fmt, safetensors_summary, summarize  # noqa: E402

HOOK = r"""
import os, time
_f = os.environ.get("BENCH_STAMPS")
if _f:
    try:
        import tqdm.std as _t
        _orig = _t.tqdm.update
        def _update(self, n=1):
            r = _orig(self, n)
            try:
                if str(getattr(self, "desc", "") or "").startswith("steps") and not getattr(self, "disable", False):
                    with open(_f, "a") as fh:
                        fh.write("%.6f %d %.6f\n" % (time.time(), self.n, time.process_time()))
            except Exception:
                pass
            return r
        _t.tqdm.update = _update
        _orig_iter = _t.tqdm.__iter__
        def _iter(self):  # a bar driven by iteration (OneTrainer's "step"): update() is never called
            if str(getattr(self, "desc", "") or "") != "step" or getattr(self, "disable", False):
                yield from _orig_iter(self)
                return
            n = self.n
            for obj in _orig_iter(self):
                yield obj  # the caller asks for the next batch: its step is done
                n += 1
                with open(_f, "a") as fh:
                    fh.write("%.6f %d %.6f\n" % (time.time(), n, time.process_time()))
        _t.tqdm.__iter__ = _iter
    except Exception:
        pass
"""

# name: (entry script, model, extra flags, resolution, batch)
CASES = {
    "sd1": ("train_network.py", "tiny-sd1-real", [], 64, 2),
    "sdxl": ("sdxl_train_network.py", "tiny-sdxl-real", [], 64, 2),
    "sd2": ("train_network.py", "tiny-sd2-real", ["--v2", "--v_parameterization"], 64, 2),  # SD2 768-v's layout
    "sd1_cache_unet": ("train_network.py", "tiny-sd1-real", ["--cache_latents", "--network_train_unet_only"], 64, 2),
    "sdxl_cache_unet": (
        "sdxl_train_network.py",
        "tiny-sdxl-real",
        ["--cache_latents", "--network_train_unet_only"],
        64,
        2,
    ),  # fmt: skip
    "sd1_real": ("train_network.py", "real-sd1", ["--cache_latents", "--network_train_unet_only"], 512, 1),
}


@dataclass(frozen=True)
class Side:
    label: str
    checkout: Path
    venv: Path
    sdscripts: bool = False


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdscripts", type=Path, help="sd-scripts checkout (source tree with train_network.py)")
    ap.add_argument("--sdsvenv", type=Path, help="its venv (default: SDSCRIPTS/venv, else SDSCRIPTS/.venv)")
    ap.add_argument(
        "--musubi",
        type=Path,
        help="musubi-tuner checkout, the reference of the musubi cases (with "
        "--sdsvenv: a venv that runs it; cases of the two references run in separate invocations)",
    )
    ap.add_argument(
        "--onetrainer",
        type=Path,
        help="OneTrainer checkout, the reference of the PixArt cases (with --sdsvenv: a venv that runs it; an "
        "invocation of their own)",
    )
    ap.add_argument("--sdtrain", type=Path, default=ROOT, help="the sdtrain checkout measured (default: this one)")
    ap.add_argument("--sdtrain_venv", type=Path, help="default: SDTRAIN/.venv, else the running interpreter's venv")
    ap.add_argument("--before", type=Path, help="a second sdtrain checkout (with its .venv) measured as 'before'")
    ap.add_argument("--before_venv", type=Path, help="default: BEFORE/.venv")
    ap.add_argument(
        "--cases",
        default="sd1,sdxl",
        help=f"comma list of {', '.join([*CASES, *DIT_CASES])}; or of {', '.join(MUSUBI_CASES)}; or of "
        f"{', '.join(ONETRAINER_CASES)}",
    )
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", default="10,40", help="comma list of --max_train_steps values, each run in every pair")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="accelerate --num_cpu_threads_per_process")
    ap.add_argument("--network_dim", type=int, default=8)
    ap.add_argument("--extra", default="", help="extra flags appended on every side (one string, split on spaces)")
    ap.add_argument("--assets", type=Path, default=Path(os.environ.get("PEER_WORK", "~/.cache/sdtrain-bench")))
    ap.add_argument("--out", type=Path, default=None, help="default: ASSETS/results/<date-time>")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--rss_interval", type=float, default=0.5, help="RSS sampling period in s (0 = off)")
    ap.add_argument("--summarize", type=Path, metavar="OUT", help="only re-print the tables of an earlier run")
    ap.add_argument(
        "--kit",
        type=Path,
        default=Path("/work/shared/peer/helpers"),
        help="the peer kit's helpers folder (its run_sdscripts_tiny.py patches sd-scripts' SD3 configs)",
    )
    a = ap.parse_args(argv)
    a.assets = a.assets.expanduser()
    cases = a.cases.split(",")
    known = [*CASES, *DIT_CASES, *MUSUBI_CASES, *ONETRAINER_CASES]
    for c in cases:
        if c not in known:
            ap.error(f"unknown case {c!r}; known: {', '.join(known)}")
    a.musubi_run = any(c in MUSUBI_CASES for c in cases)
    a.onetrainer_run = any(c in ONETRAINER_CASES for c in cases)
    if a.musubi_run and not all(c in MUSUBI_CASES for c in cases):
        ap.error(f"the musubi-tuner cases ({', '.join(MUSUBI_CASES)}) run in an invocation of their own")
    if a.onetrainer_run and not all(c in ONETRAINER_CASES for c in cases):
        ap.error(f"the OneTrainer cases ({', '.join(ONETRAINER_CASES)}) run in an invocation of their own")
    if a.summarize is None and a.musubi_run and (a.musubi is None or a.sdsvenv is None):
        ap.error("--musubi PATH (a musubi-tuner checkout) and --sdsvenv VENV (a venv that runs it) are required")
    if a.summarize is None and a.onetrainer_run and (a.onetrainer is None or a.sdsvenv is None):
        ap.error("--onetrainer PATH (a OneTrainer checkout) and --sdsvenv VENV (a venv that runs it) are required")
    if a.summarize is None and not a.musubi_run and not a.onetrainer_run and a.sdscripts is None:
        ap.error("--sdscripts PATH (an sd-scripts checkout) is required")
    return a


def venv_of(checkout: Path, given: Path | None, names=(".venv",), fallback: Path | None = None) -> Path:
    if given is not None:
        return given
    for n in names:
        if (checkout / n / "bin" / "accelerate").exists():
            return checkout / n
    if fallback is not None and (fallback / "bin" / "accelerate").exists():
        return fallback
    raise SystemExit(f"error: no venv with accelerate found for {checkout} (looked for {', '.join(names)}); "
                     "pass it with the matching --*venv flag")  # fmt: skip


def make_sides(a: argparse.Namespace) -> list[Side]:
    here = a.sdtrain.expanduser().resolve()
    ours = Side("sdtrain", here, venv_of(here, a.sdtrain_venv, fallback=Path(sys.prefix)))
    if a.musubi_run:
        musubi = a.musubi.expanduser().resolve()
        if not (musubi / "src" / "musubi_tuner" / "qwen_image_train_network.py").exists():
            raise SystemExit(f"error: {musubi} is not a musubi-tuner checkout (no src/musubi_tuner/)")
        sides = [Side("musubi-tuner", musubi, a.sdsvenv.expanduser(), sdscripts=True)]
    elif a.onetrainer_run:
        onetrainer = a.onetrainer.expanduser().resolve()
        if not (onetrainer / TRAIN).exists() or not (onetrainer / "modules" / "modelSetup").exists():
            raise SystemExit(f"error: {onetrainer} is not a OneTrainer checkout (no {TRAIN} / modules/modelSetup)")
        sides = [Side("OneTrainer", onetrainer, a.sdsvenv.expanduser(), sdscripts=True)]
    else:
        sds = a.sdscripts.expanduser().resolve()
        if not (sds / "train_network.py").exists() or not (sds / "library" / "train_util.py").exists():
            raise SystemExit(
                f"error: {sds} is not an sd-scripts checkout (no train_network.py / library/train_util.py)"
            )
        sides = [Side("sd-scripts", sds, venv_of(sds, a.sdsvenv, ("venv", ".venv")), sdscripts=True)]
    if a.before is not None:
        before = a.before.expanduser().resolve()
        sides.append(Side("before", before, venv_of(before, a.before_venv)))
    return sides + [ours]


def ensure_assets(a: argparse.Namespace, sds: Side, cases: list[str]) -> None:
    """Tiny models, dataset and tokenizer cache under ASSETS, built where missing (models with this python and
    sdtrain's library; the dataset with sd-scripts' python)."""
    py = str(sds.venv / "bin" / "python")
    models = a.assets / "models"
    known = {**DIT_CASES, **MUSUBI_CASES, **ONETRAINER_CASES}
    dit = [c for c in cases if c in known and not (models / known[c].folder).exists()]
    if dit:  # written with this checkout's library (its tiny builders)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        python = str(venv_of(ROOT, a.sdtrain_venv, fallback=Path(sys.prefix)) / "bin" / "python")  # sdtrain's venv
        subprocess.run([python, str(PEER / "tiny_families.py"), str(models), "--only",
                        ",".join(known[c].family for c in dit)], check=True, env=env)  # fmt: skip
    for kind in ("sd1", "sd2", "sdxl"):
        if (
            any(c in CASES and CASES[c][1] == f"tiny-{kind}-real" for c in cases)
            and not (models / f"tiny-{kind}-real").exists()
        ):
            python = str(venv_of(ROOT, a.sdtrain_venv, fallback=Path(sys.prefix)) / "bin" / "python")  # has torch
            subprocess.run([python, str(PEER / "tiny_models.py"), str(models), "--layout", "real", "--only", kind],
                           check=True)  # fmt: skip
    tok = a.assets / "tokcache"
    for src, dst in (("tiny-sd1-real/tokenizer", "openai_clip-vit-large-patch14"),
                     ("tiny-sdxl-real/tokenizer_2", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k"),
                     ("tiny-sdxl-real/tokenizer_2", "stabilityai_stable-diffusion-2")):  # fmt: skip
        if (models / src).exists() and not (tok / dst).exists():
            shutil.copytree(models / src, tok / dst)
    if not (a.assets / "data" / "train").exists():
        subprocess.run([py, str(PEER / "make_dataset.py"), str(a.assets / "data" / "train")], check=True)
    if "sd1_real" in cases:
        sys.path.insert(0, str(HERE))
        from real_size_model import build  # the released SD1.5 architecture, random weights

        build("sd1", models / "real-sd1")  # nothing is written when the folder already holds a model
    if "sd1_real" in cases and not (a.assets / "data512" / "train").exists():
        subprocess.run([py, str(PEER / "make_dataset.py"), str(a.assets / "data512" / "train"), "--n", "2", "--res",
                        "512"], check=True)  # fmt: skip


def tree_max_rss_kb(root: int) -> int:
    """Largest VmRSS (kB) among root and its descendants, from /proc (Linux)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    best, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as f:
                best = max([best] + [int(line.split()[1]) for line in f if line.startswith("VmRSS:")])
        except OSError:
            pass
    return best


class RssSampler(threading.Thread):
    """Polls the run's process tree every ``interval`` s: (unix time, largest process RSS kB)."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.samples, self.stop = pid, interval, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.samples.append((time.time(), tree_max_rss_kb(self.pid)))


def parse_time_v(path: Path) -> dict:
    vals = {}
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        k, _, v = line.strip().rpartition(": ")
        vals[k] = v
    user, sys_ = vals.get("User time (seconds)"), vals.get("System time (seconds)")
    rss = vals.get("Maximum resident set size (kbytes)")
    return {"cpu_s": float(user) + float(sys_) if user and sys_ else None,
            "peak_rss_mb": int(rss) / 1024 if rss else None}  # fmt: skip


def launcher(a: argparse.Namespace, side: Side) -> list[str]:
    return [str(side.venv / "bin" / "accelerate"), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", str(a.threads)]  # fmt: skip


def musubi_commands(a: argparse.Namespace, side: Side, case: str, steps: int, rdir: Path):
    """(caching commands, the timed training command) of a musubi-tuner case: the reference's scripts under
    src/musubi_tuner through run_reference_tiny.py, ours from the checkout root, on the run's own dataset TOML."""
    models = a.assets / "models"
    toml = write_dataset_toml(rdir / "dataset.toml", a.assets / "data" / "train" / "10_sks", rdir / "cache",
                              control_folder(case, models))  # fmt: skip

    def entry(script: str) -> list[str]:
        if side.sdscripts:
            return [str(PEER / "run_reference_tiny.py"), str(side.checkout / "src" / "musubi_tuner" / script)]
        return [script]

    python = str(side.venv / "bin" / "python")
    caches = [[python, *entry(c[0]), *c[1:]] for c in cache_commands(case, models, toml)]
    train = launcher(a, side) + entry(MUSUBI_CASES[case].train) + train_flags(case, models, toml, steps, rdir / "out")
    return caches, train + a.extra.split()


def command(a: argparse.Namespace, side: Side, case: str, steps: int, rdir: Path) -> list[str]:
    if case in MUSUBI_CASES:
        return musubi_commands(a, side, case, steps, rdir)[1]
    if case in ONETRAINER_CASES and side.sdscripts:  # its config file carries what our flags say
        config = write_config(case, a.assets / "models", a.assets / "data" / "train" / "10_sks", steps, rdir)
        return launcher(a, side) + [TRAIN, "--config-path", str(config)] + a.extra.split()
    drop, save_as = (), "safetensors"
    if case in ONETRAINER_CASES:
        script, res, batch, wrapper = ONETRAINER_CASES[case].script, 64, 1, None
        model = our_flags(case, a.assets / "models")
    elif case in DIT_CASES:
        script, res, batch, wrapper = DIT_CASES[case].script, 64, 1, reference_wrapper(case, a.kit)
        model = dit_flags(case, a.assets / "models")
        drop, save_as = DIT_CASES[case].drop, DIT_CASES[case].save_as
        if side.sdscripts:
            script = DIT_CASES[case].reference_script or script
    else:
        script, name, extra, res, batch = CASES[case]
        wrapper = PEER / "run_sdscripts_tiny.py"
        model = ["--pretrained_model_name_or_path", str(a.assets / "models" / name), "--network_module",
                 "networks.lora", "--network_dim", str(a.network_dim), "--network_alpha", str(a.network_dim), "--seed",
                 "42", "--sdpa", *extra]  # fmt: skip
    data = a.assets / ("data512" if case == "sd1_real" else "data") / "train"
    flags = model + [
        "--tokenizer_cache_dir", str(a.assets / "tokcache"), "--train_data_dir", str(data),
        "--caption_extension", ".txt", "--resolution", str(res), "--train_batch_size", str(batch),
        "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--max_train_steps", str(steps),
        "--mixed_precision", "no", "--max_data_loader_n_workers", "0",
        "--output_dir", str(rdir / "out"), "--output_name", "lora", "--save_model_as", save_as,
    ] + a.extra.split()  # fmt: skip
    for flag in drop:
        i = flags.index(flag)
        del flags[i : i + 2]
    launch = launcher(a, side)
    if side.sdscripts:
        return launch + [str(wrapper), script] + flags
    return launch + [script] + flags


def run_one(a: argparse.Namespace, side: Side, case: str, steps: int, pair: int, out: Path) -> dict:
    rdir = out / "runs" / f"{case}_N{steps}_p{pair}_{side.label}"
    rdir.mkdir(parents=True, exist_ok=True)
    stamps, timef, log = rdir / "stamps.txt", rdir / "time_v.txt", rdir / "log.txt"
    env = dict(os.environ, HF_HUB_OFFLINE="1", BENCH_STAMPS=str(stamps))
    env.pop("TQDM_DISABLE", None)
    shims = PEER / "sds_shims" if case in CASES else a.kit / "sds_shims"  # DiT paths need the kit's fuller one
    musubi_src = [str(side.checkout / "src")] if case in MUSUBI_CASES and side.sdscripts else []
    stand_in = side.sdscripts and case not in ONETRAINER_CASES  # OneTrainer's venv has torchvision (README)
    path = [str(out / "_hook")] + ([str(shims)] if stand_in else []) + musubi_src
    env["PYTHONPATH"] = os.pathsep.join(path)
    cwd = side.checkout / "src" if musubi_src else side.checkout
    cmd = command(a, side, case, steps, rdir)
    if case in MUSUBI_CASES:  # the caching scripts first, untimed, into the run's cache folder
        for cache in musubi_commands(a, side, case, steps, rdir)[0]:
            with open(rdir / "cache_log.txt", "a") as lf:
                lf.write(" ".join(cache) + "\n")
                lf.flush()
                rc = subprocess.run(cache, cwd=cwd, env=dict(env, BENCH_STAMPS=""), stdout=lf, stderr=subprocess.STDOUT,
                                    timeout=a.timeout).returncode  # fmt: skip
            if rc != 0:
                return {"case": case, "side": side.label, "steps": steps, "pair": pair, "rc": rc, "wall_s": 0.0,
                        "threads": a.threads, "log": str(rdir / "cache_log.txt")}  # fmt: skip
    data = a.assets / ("data512" if case == "sd1_real" else "data") / "train"
    before = sorted(p for p in data.rglob("*"))
    with open(log, "w") as lf:
        lf.write(" ".join(cmd) + "\n")
        lf.flush()
        t0, m0 = time.time(), time.monotonic()
        p = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(timef)] + cmd, cwd=cwd, env=env, stdout=lf,
                             stderr=subprocess.STDOUT)  # fmt: skip
        sampler = RssSampler(p.pid, a.rss_interval) if a.rss_interval > 0 else None
        if sampler:
            sampler.start()
        try:
            p.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        wall = time.monotonic() - m0
        if sampler:
            sampler.stop.set()
            sampler.join()
    rec = {"case": case, "side": side.label, "steps": steps, "pair": pair, "rc": p.returncode, "wall_s": wall,
           "threads": a.threads, "log": str(log)}  # fmt: skip
    rec.update(parse_time_v(timef))
    st = (
        [tuple(map(float, ln.split())) for ln in stamps.read_text().splitlines() if ln.strip()]
        if stamps.exists()
        else []
    )
    rec["stamped_steps"] = len(st)
    if st:
        rec["ttfs_s"] = st[0][0] - t0
        diffs = [b[0] - a_[0] for a_, b in zip(st, st[1:])][1:]  # intervals of steps 3..N
        rec["s_per_step"] = statistics.median(diffs) if diffs else None
        if len(st) > 2 and st[-1][1] > st[1][1]:  # the loop alone (steps 3..N): no start-up, no final save
            rec["loop_s_per_step"] = (st[-1][0] - st[1][0]) / (st[-1][1] - st[1][1])
            if len(st[1]) > 2:  # the process's CPU seconds at each stamp (all its threads)
                rec["loop_cpu_s_per_step"] = (st[-1][2] - st[1][2]) / (st[-1][1] - st[1][1])
        if sampler and sampler.samples:  # sampled peak up to the end of step 1 (load, caching, step 1) and after
            rec["rss_to_step1_mb"] = max([kb for t, kb in sampler.samples if t <= st[0][0]] or [0]) / 1024
            rec["rss_after_step1_mb"] = max([kb for t, kb in sampler.samples if t > st[0][0]] or [0]) / 1024
    f = rdir / "out" / "lora.safetensors"
    if not f.exists():  # a full fine-tune's diffusers prior folder (Würstchen 2)
        f = rdir / "out" / "lora" / "prior" / "diffusion_pytorch_model.safetensors"
    if f.exists():
        s = safetensors_summary(str(f))
        rec["keys"] = s.pop("shapes")
        rec["output"] = s
    if sorted(p for p in data.rglob("*")) != before:  # a side wrote into the shared dataset (e.g. a cache file)
        rec["dataset_changed"] = [str(p) for p in sorted(set(data.rglob("*")) ^ set(before))][:10]
    return rec


def side_order(sides: list, pair: int) -> list:
    """The order the sides run in ``pair``: as given in even pairs (the reference first), reversed in odd ones."""
    return list(sides) if pair % 2 == 0 else list(reversed(sides))


def commit_of(checkout: Path) -> str:
    """The checkout's short commit, or the one recorded next to an exported tree (``<checkout>.commit``)."""
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], text=True, capture_output=True)
    if out.returncode == 0:
        return out.stdout.strip()
    note = checkout.with_name(checkout.name + ".commit")
    return note.read_text().strip()[:9] if note.exists() else "unknown"


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.summarize:
        recs = [json.loads(line) for line in open(a.summarize / "runs.jsonl")]
        inv = json.load(open(a.summarize / "invocation.json"))
        text = summarize(recs, inv["sides"], inv["steps"])
        (a.summarize / "summary.md").write_text(text)
        print(text)
        return
    sides, cases = make_sides(a), a.cases.split(",")
    steps = [int(s) for s in a.steps.split(",")]
    ensure_assets(a, sides[0], cases)
    out = a.out or a.assets / "results" / time.strftime("%Y%m%d-%H%M%S")
    (out / "_hook").mkdir(parents=True, exist_ok=True)
    (out / "_hook" / "sitecustomize.py").write_text(HOOK)
    commits = {s.label: commit_of(s.checkout) for s in sides}
    (out / "invocation.json").write_text(json.dumps(
        {"argv": sys.argv, "sides": [s.label for s in sides], "steps": steps, "commits": commits,
         "paths": {s.label: str(s.checkout) for s in sides}, "start": time.strftime("%Y-%m-%d %H:%M:%S"),
         "loadavg_start": os.getloadavg()}, indent=1))  # fmt: skip
    print(f"sides: {', '.join(f'{s.label} {commits[s.label]} ({s.checkout})' for s in sides)}; out: {out}", flush=True)
    recs = []
    with open(out / "runs.jsonl", "a") as jl:
        for case in cases:
            for pair in range(a.pairs):
                for n in steps:
                    for side in side_order(sides, pair):
                        load = os.getloadavg()[0]
                        rec = run_one(a, side, case, n, pair, out)
                        rec["loadavg_1m_before"] = load
                        recs.append(rec)
                        jl.write(json.dumps(rec) + "\n")
                        jl.flush()
                        print(f"{time.strftime('%H:%M:%S')} {case:15s} N={n:<3d} pair {pair} {side.label:10s} "
                              f"rc={rec['rc']} wall={rec['wall_s']:.1f}s cpu={fmt(rec.get('cpu_s'), 1)}s "
                              f"s/step={fmt(rec.get('s_per_step'))} ttfs={fmt(rec.get('ttfs_s'), 2)} "
                              f"rss={fmt(rec.get('peak_rss_mb'), 0)}MB modules={rec.get('output', {}).get('modules')} "
                              f"load={load:.1f}", flush=True)  # fmt: skip
    text = summarize(recs, [s.label for s in sides], steps)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
