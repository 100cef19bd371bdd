"""Sample prompts: the sd-scripts prompt-line syntax and the .txt / .toml / .json prompt files.

A prompt line is ``<prompt> --<opt> <value> --<opt> <value> ...``, split on ``" --"`` as sd-scripts does (so a
prompt cannot contain ``" --"``); option names are case-insensitive. Options (sd-scripts ``train_util.
line_to_prompt_dict`` and ``gen_img.py``):

=========  =========================  ==========================================================================
option     PromptSpec field           value
=========  =========================  ==========================================================================
``--n``    negative_prompt            the rest of the segment
``--w``    width                      pixels, a multiple of 8, >= 64
``--h``    height                     pixels, a multiple of 8, >= 64
``--d``    seeds                      an integer seed, or ``s1,s2,...`` (gen_img: one per image of the prompt)
``--l``    scale                      classifier-free guidance scale (float)
``--s``    steps                      denoising steps, 1..1000
``--ss``   sampler                    one of :data:`library.sampling.schedulers.SAMPLER_NAMES` (or ``ddpm``)
``--am``   network_multipliers        ``m1,m2,...``: one multiplier per ``--network_weights`` file (gen_img)
``--f``    file_name                  output file name (gen_img)
``--ow``   original_width             SDXL size conditioning (also ``--oh``; ``--nw``/``--nh`` for the
                                      negative prompt; ``--ct``/``--cl`` crop top/left)
``--g``    guidance                   embedded guidance (float >= 0) for models that take it (FLUX.1 dev; see
                                      ``flow_generate.py``); SD / SDXL ignore it with a note, as sd-scripts
``--ctr``  cfg_trunc_ratio            flow matching: true CFG only while the model time 1 - σ is below it
                                      (sd-scripts' Lumina 2 option; default the family's, none for the others)
``--rcfg`` renorm_cfg                 flow matching: the guided velocity's norm capped at this times the
                                      conditional one (0: off; default the family's)
=========  =========================  ==========================================================================

Unlike sd-scripts, which skips a value it cannot parse, silently rounds sizes down to a multiple of 8, clamps steps
and falls back to DDIM for an unknown sampler, every such line is an error here that names the file and line; all
problems of a file are reported at once. Options for features we do not have (img2img ``--t``, CLIP guidance
``--c``, negative scale ``--nl``, Deep Shrink ``--ds*``, Gradual Latent ``--gl*``, ControlNet ``--cn``) are errors
that say so, never silently dropped.

.toml: a ``[prompt]`` table of defaults plus ``[[prompt.subset]]`` entries merged over it; .json: a list of
prompt lines and/or tables. Table keys are sd-scripts' (``prompt``, ``negative_prompt``, ``width``, ``height``,
``sample_steps``, ``scale``, ``seed``, ``sample_sampler``, ...; see :data:`TABLE_KEYS`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from library.cli.parse import guidance_problems
from library.cli.problems import ConfigError, did_you_mean

from .schedulers import ALL_SAMPLER_NAMES

log = logging.getLogger(__name__)

MIN_SIZE = 64
MAX_STEPS = 1000


@dataclass(frozen=True)
class PromptSpec:
    """One prompt and its settings. ``None`` means "use the default" (see :meth:`with_defaults`).

    ``index``: position in the prompt file (names the sample files). ``seeds``: empty = a fresh random seed per
    image; otherwise image i of this prompt uses ``seeds[i]`` (the last one + i beyond the list).
    """

    prompt: str
    negative_prompt: str = ""
    width: int | None = None
    height: int | None = None
    seeds: tuple[int, ...] = ()
    scale: float | None = None
    steps: int | None = None
    sampler: str | None = None
    network_multipliers: tuple[float, ...] | None = None
    file_name: str | None = None
    original_width: int | None = None
    original_height: int | None = None
    original_width_negative: int | None = None
    original_height_negative: int | None = None
    crop_top: int | None = None
    crop_left: int | None = None
    guidance: float | None = None
    cfg_trunc_ratio: float | None = None
    renorm_cfg: float | None = None
    control_image: str | None = None  # --cn: the conditioning image of a ControlNet (read with ``controls=True``)
    index: int = 0

    @property
    def seed(self) -> int | None:
        return self.seeds[0] if self.seeds else None

    def seed_for(self, image: int) -> int | None:
        """Seed of the ``image``-th image of this prompt (None: draw a random one)."""
        if not self.seeds:
            return None
        return self.seeds[image] if image < len(self.seeds) else self.seeds[-1] + image - len(self.seeds) + 1

    def with_defaults(self, **defaults: Any) -> PromptSpec:
        """A copy where every field that is None takes the value in ``defaults`` (if given)."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = set(defaults) - fields
        if unknown:
            raise TypeError(f"PromptSpec has no field(s) {sorted(unknown)}")
        return dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})


# ----------------------------------------------------------------------------------------------------------------------
# Values


def _int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        return float(str(text).strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _size(text: str) -> int:
    value = _int(text)
    if value < MIN_SIZE or value % 8:
        lower = max(MIN_SIZE, value - value % 8)
        raise ValueError(f"{value} must be a multiple of 8 and at least {MIN_SIZE}; try {lower}")
    return value


def _steps(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= MAX_STEPS:
        raise ValueError(f"{value} is out of range; use 1 to {MAX_STEPS} steps")
    return value


def _seeds(text: Any) -> tuple[int, ...]:
    if isinstance(text, (list, tuple)):
        return tuple(_int(v) for v in text)
    return tuple(_int(v) for v in str(text).split(","))


def _sampler(text: str) -> str:
    name = str(text).strip().lower()
    if name not in ALL_SAMPLER_NAMES:
        hint = did_you_mean(name, ALL_SAMPLER_NAMES, otherwise=f"use one of {', '.join(ALL_SAMPLER_NAMES)}")
        raise ValueError(f"unknown sampler {name!r}{hint}")
    return name


def _floats(text: Any) -> tuple[float, ...]:
    if isinstance(text, (list, tuple)):
        return tuple(_float(v) for v in text)
    return tuple(_float(v) for v in str(text).split(","))


def _nonneg_float(text: Any) -> float:
    value = _float(text)
    if not 0 <= value < float("inf"):
        raise ValueError(f"{value} must be a finite number >= 0")
    return value


def _guidance(text: Any) -> float:
    value = _float(text)
    for problem in guidance_problems("the guidance", value):
        raise ValueError(problem)
    return value


def _text(text: Any) -> str:
    return str(text).strip()


def _nonneg(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise ValueError(f"{value} must be >= 0")
    return value


# Inline option -> (PromptSpec field, converter). Longest names first is not needed: names are matched exactly.
OPTIONS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "n": ("negative_prompt", _text),
    "w": ("width", _size),
    "h": ("height", _size),
    "d": ("seeds", _seeds),
    "l": ("scale", _float),
    "s": ("steps", _steps),
    "ss": ("sampler", _sampler),
    "am": ("network_multipliers", _floats),
    "f": ("file_name", _text),
    "ow": ("original_width", _nonneg),
    "oh": ("original_height", _nonneg),
    "nw": ("original_width_negative", _nonneg),
    "nh": ("original_height_negative", _nonneg),
    "ct": ("crop_top", _nonneg),
    "cl": ("crop_left", _nonneg),
    "g": ("guidance", _guidance),
    "ctr": ("cfg_trunc_ratio", _nonneg_float),
    "rcfg": ("renorm_cfg", _nonneg_float),
}
IGNORED_OPTIONS: dict[str, str] = {}
GUIDANCE_IGNORED_NOTE = (
    "embedded guidance (--g) is an input only some models have; this model ignores it, as in sd-scripts"
)
UNSUPPORTED_OPTIONS = {
    "t": "img2img strength (--t): img2img is not supported",
    "c": "CLIP-guided prompt (--c): CLIP guidance is not supported",
    "nl": "negative scale (--nl): a separate negative-prompt scale is not supported",
    "cn": "ControlNet image (--cn): ControlNet is not supported",
    "fs": "flow shift (--fs) is for flow-matching models only",
    **{k: "Deep Shrink (--dsd1/--dst1/--dsd2/--dst2/--dsr) is not supported" for k in ("dsd1", "dst1", "dsd2", "dst2")},
    "dsr": "Deep Shrink (--dsd1/--dst1/--dsd2/--dst2/--dsr) is not supported",
    **{k: "Gradual Latent (--glt/--glr/--gle/--gls/--glsn/--glus) is not supported" for k in ("glt", "glr", "gle")},
    **{k: "Gradual Latent (--glt/--glr/--gle/--gls/--glsn/--glus) is not supported" for k in ("gls", "glsn", "glus")},
}

# Table keys (.toml / .json) -> PromptSpec field, converter.
TABLE_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "prompt": ("prompt", _text),
    "negative_prompt": ("negative_prompt", _text),
    "width": ("width", _size),
    "height": ("height", _size),
    "seed": ("seeds", _seeds),
    "scale": ("scale", _float),
    "sample_steps": ("steps", _steps),
    "sample_sampler": ("sampler", _sampler),
    "network_multipliers": ("network_multipliers", _floats),
    "file_name": ("file_name", _text),
    "original_width": ("original_width", _nonneg),
    "original_height": ("original_height", _nonneg),
    "original_width_negative": ("original_width_negative", _nonneg),
    "original_height_negative": ("original_height_negative", _nonneg),
    "crop_top": ("crop_top", _nonneg),
    "crop_left": ("crop_left", _nonneg),
    "guidance_scale": ("guidance", _guidance),
    "cfg_trunc_ratio": ("cfg_trunc_ratio", _nonneg_float),
    "renorm_cfg": ("renorm_cfg", _nonneg_float),
}
# read only where a ControlNet samples (``controls=True``): sd-scripts' --cn / controlnet_image
CONTROL_OPTION, CONTROL_KEY = "cn", "controlnet_image"
IGNORED_KEYS = {"enum"}


# ----------------------------------------------------------------------------------------------------------------------
# Parsing


def parse_prompt_line(line: str, *, where: str = "prompt", index: int = 0, controls: bool = False) -> PromptSpec:
    """Parse one prompt line (module docstring). Raises ``ConfigError`` listing every bad option, each prefixed by
    ``where`` (e.g. ``"prompts.txt:3"``). ``controls``: a ControlNet samples, so ``--cn <image>`` is read."""
    segments = line.strip().split(" --")
    values: dict[str, Any] = {"prompt": segments[0].strip(), "index": index}
    problems: list[str] = []
    for segment in segments[1:]:
        name, _, value = segment.strip().partition(" ")
        key = name.lower()
        if not key:
            continue
        if key in IGNORED_OPTIONS:
            log.info("%s: %s", where, IGNORED_OPTIONS[key])
            continue
        if key == CONTROL_OPTION and controls:
            values["control_image"] = _control_image(value, f"{where}: --{name}", problems)
            continue
        if key in UNSUPPORTED_OPTIONS:
            problems.append(f"{where}: {UNSUPPORTED_OPTIONS[key]}; remove --{name}")
            continue
        if key not in OPTIONS:
            hint = did_you_mean(key, [*OPTIONS, *UNSUPPORTED_OPTIONS], show="--{}".format,
                                otherwise=f"known options: --{', --'.join(OPTIONS)}")  # fmt: skip
            problems.append(f"{where}: unknown option --{name}{hint}")
            continue
        field, convert = OPTIONS[key]
        if not value.strip() and key != "n":
            problems.append(f"{where}: --{name} needs a value")
            continue
        try:
            values[field] = convert(value)
        except ValueError as e:
            problems.append(f"{where}: --{name}: {e}")
    if problems:
        raise ConfigError(problems)
    return PromptSpec(**values)


def _control_image(value: Any, where: str, problems: list[str]) -> str | None:
    path = str(value).strip()
    if not path or not Path(path).is_file():
        problems.append(f"{where}: conditioning image {path!r} not found")
        return None
    return path


def parse_prompt_table(table: Mapping[str, Any], *, where: str, index: int = 0, controls: bool = False) -> PromptSpec:
    """Build a PromptSpec from a TOML/JSON table with sd-scripts' keys; ``ConfigError`` names ``where`` and the key.
    ``controls``: a ControlNet samples, so ``controlnet_image`` is read."""
    values: dict[str, Any] = {"index": index}
    problems: list[str] = []
    for key, value in table.items():
        if key in IGNORED_KEYS:
            continue
        if key == CONTROL_KEY and controls:
            values["control_image"] = _control_image(value, f"{where}: {key}", problems)
            continue
        if key not in TABLE_KEYS:
            hint = did_you_mean(key, TABLE_KEYS, otherwise=f"known keys: {', '.join(TABLE_KEYS)}")
            problems.append(f"{where}: unknown key {key!r}{hint}")
            continue
        field, convert = TABLE_KEYS[key]
        try:
            values[field] = convert(value)
        except ValueError as e:
            problems.append(f"{where}: {key}: {e}")
    if "prompt" not in values and not problems:
        problems.append(f"{where}: no 'prompt' key")
    if problems:
        raise ConfigError(problems)
    return PromptSpec(**values)


def read_prompt_file(path: str | Path, *, controls: bool = False) -> list[PromptSpec]:
    """All prompts of a .txt / .toml / .json prompt file (module docstring), in file order (``index`` 0, 1, ...).
    ``controls``: a ControlNet samples them, so ``--cn`` / ``controlnet_image`` are read (else refused).

    Raises ``FileNotFoundError`` for a missing file and ``ConfigError`` (a ``ValueError``) listing every bad line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--sample_prompts / --from_file {path}: no such file")
    suffix = path.suffix.lower()
    text = path.read_text(encoding="utf-8")
    if suffix == ".toml":
        entries = _toml_entries(path, text)
    elif suffix == ".json":
        entries = _json_entries(path, text)
    else:  # .txt and anything else: one prompt per line, as sd-scripts' gen_img --from_file
        entries = [
            (f"{path}:{n}", line)
            for n, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
    specs, problems = [], []
    for index, (where, entry) in enumerate(entries):
        try:
            if isinstance(entry, str):
                specs.append(parse_prompt_line(entry, where=where, index=index, controls=controls))
            else:
                specs.append(parse_prompt_table(entry, where=where, index=index, controls=controls))
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems)
    if not specs:
        raise ConfigError([f"{path}: no prompts in the file (empty lines and '#' comments are skipped)"])
    return specs


def _toml_entries(path: Path, text: str) -> list[tuple[str, Any]]:
    import toml

    try:
        data = toml.loads(text)
    except toml.TomlDecodeError as e:
        raise ConfigError([f"{path}: not valid TOML: {e}"]) from e
    table = data.get("prompt")
    if not isinstance(table, dict) or not isinstance(table.get("subset"), list):
        raise ConfigError([f"{path}: expected a [prompt] table with [[prompt.subset]] entries (sd-scripts' layout)"])
    defaults = {k: v for k, v in table.items() if k != "subset"}
    out = []
    for i, subset in enumerate(table["subset"]):
        if not isinstance(subset, dict):
            raise ConfigError([f"{path}: prompt.subset[{i}] must be a table"])
        out.append((f"{path}: prompt.subset[{i}]", {**defaults, **subset}))
    return out


def _json_entries(path: Path, text: str) -> list[tuple[str, Any]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError([f"{path}:{e.lineno}: not valid JSON: {e.msg}"]) from e
    if not isinstance(data, list):
        raise ConfigError([f"{path}: expected a JSON list of prompt lines or tables"])
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, (str, dict)):
            raise ConfigError([f"{path}: [{i}] must be a prompt line (string) or a table, got {type(item).__name__}"])
        out.append((f"{path}: [{i}]", item))
    return out
