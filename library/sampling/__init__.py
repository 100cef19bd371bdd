"""Sampling: sample images during training (sd-scripts' flags and prompt files) and text-to-image for gen_img.py.

    from library import sampling
    cfg = sampling.SampleConfig.from_args(args)              # validates --sample_* and the prompt file up front
    if sampling.should_sample(cfg, step=global_step):         # sd-scripts' rules (epochs override steps)
        sampling.sample_during_training(cfg, family, parts, output_dir=..., output_name=..., step=global_step)

Modules: ``prompts`` (prompt-line syntax, .txt/.toml/.json files), ``schedulers`` (the 16 sampler names),
``flow`` (the flow-matching Euler sampler of FLUX / Chroma), ``flow_generate`` (it, for a flow-matching family),
``config`` (flags, SampleConfig, should_sample), ``generate`` (diffusers pipelines + our prompt encoder),
``images`` (file names, PNG text chunks, grids, trackers), ``training`` (one sampling round, RNG-neutral).
"""

from .config import SampleConfig, add_sample_args, should_sample
from .flow import flow_sigmas, packed_noise, sample_euler, with_cfg
from .flow_generate import generate_flow_latents, uses_flow_sampler
from .generate import generate, generate_batch, random_seed, resolve, same_settings, to_pil
from .images import make_grid, png_info, sample_file_name
from .prompts import PromptSpec, parse_prompt_line, read_prompt_file
from .schedulers import ALL_SAMPLER_NAMES, SAMPLER_NAMES, make_scheduler
from .training import cache_sample_prompts, check_sample_prompts, sample_during_training

__all__ = [
    "ALL_SAMPLER_NAMES",
    "SAMPLER_NAMES",
    "PromptSpec",
    "SampleConfig",
    "add_sample_args",
    "check_sample_prompts",
    "flow_sigmas",
    "packed_noise",
    "generate",
    "generate_batch",
    "generate_flow_latents",
    "make_grid",
    "make_scheduler",
    "parse_prompt_line",
    "png_info",
    "random_seed",
    "read_prompt_file",
    "resolve",
    "same_settings",
    "sample_during_training",
    "cache_sample_prompts",
    "sample_euler",
    "sample_file_name",
    "should_sample",
    "to_pil",
    "uses_flow_sampler",
    "with_cfg",
]
