"""Sampling: sample images during training (sd-scripts' flags and prompt files) and text-to-image for gen_img.py.

    from library import sampling
    cfg = sampling.SampleConfig.from_args(args)              # validates --sample_* and the prompt file up front
    if sampling.should_sample(cfg, step=global_step):         # sd-scripts' rules (epochs override steps)
        sampling.sample_during_training(cfg, family, parts, output_dir=..., output_name=..., step=global_step)

Modules: ``prompts`` (prompt-line syntax, .txt/.toml/.json files), ``schedulers`` (the 16 sampler names),
``config`` (flags, SampleConfig, should_sample), ``generate`` (diffusers pipelines + our prompt encoder),
``images`` (file names, PNG text chunks, grids, trackers), ``training`` (one sampling round, RNG-neutral).
"""

from .config import SampleConfig, add_sample_args, should_sample
from .generate import generate, generate_batch, random_seed, resolve, same_settings, to_pil
from .images import make_grid, png_info, sample_file_name
from .prompts import PromptSpec, parse_prompt_line, read_prompt_file
from .schedulers import ALL_SAMPLER_NAMES, SAMPLER_NAMES, make_scheduler
from .training import sample_during_training

__all__ = [
    "ALL_SAMPLER_NAMES",
    "SAMPLER_NAMES",
    "PromptSpec",
    "SampleConfig",
    "add_sample_args",
    "generate",
    "generate_batch",
    "make_grid",
    "make_scheduler",
    "parse_prompt_line",
    "png_info",
    "random_seed",
    "read_prompt_file",
    "resolve",
    "same_settings",
    "sample_during_training",
    "sample_file_name",
    "should_sample",
    "to_pil",
]
