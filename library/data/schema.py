"""The dataset-config schema: the keys, where each may appear, its checks and their messages.

The dataset-config schema: every key sd-scripts' ``library/config_util.py`` accepts, where it may appear, and
what values it takes, with error messages that name the file, the key path and the fix.

A message looks like ``dataset.toml: datasets[1].subsets[0].num_repeats: expected an integer >= 1, got "ten"``.
Unknown keys get a "did you mean"; keys that exist but sit at the wrong level say where they belong. The
validator collects every problem instead of stopping at the first.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from library.cli.problems import Problems, did_you_mean

from .resolution import parse_resolutions

G, D, S = "general", "dataset", "subset"
_ALL = frozenset({G, D, S})
_GD = frozenset({G, D})
_S = frozenset({S})

INTERPOLATIONS = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area", "box")


def show(value: object) -> str:
    """A user value as it would appear in the file: strings quoted, tables and lists as JSON."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except TypeError:
        return repr(value)


Check = Callable[[object], str | None]  # returns an error text ("expected ..., got ...") or None when valid


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_check(minimum: int | None = None) -> Check:
    want = "an integer" + (f" >= {minimum}" if minimum is not None else "")

    def check(v: object) -> str | None:
        if _is_int(v) and (minimum is None or v >= minimum):
            return None
        return f"expected {want}, got {show(v)}"

    return check


def number_check(minimum: float | None = None, maximum: float | None = None) -> Check:
    bounds = ""
    if minimum is not None and maximum is not None:
        bounds = f" between {minimum:g} and {maximum:g}"
    elif minimum is not None:
        bounds = f" >= {minimum:g}"

    def check(v: object) -> str | None:
        ok = _is_number(v) and (minimum is None or v >= minimum) and (maximum is None or v <= maximum)
        return None if ok else f"expected a number{bounds}, got {show(v)}"

    return check


def bool_check(v: object) -> str | None:
    return None if isinstance(v, bool) else f"expected true or false, got {show(v)}"


def str_check(v: object) -> str | None:
    return None if isinstance(v, str) else f"expected a string, got {show(v)}"


def nonempty_str_check(v: object) -> str | None:
    return None if isinstance(v, str) and v else f"expected a non-empty string, got {show(v)}"


def table_check(v: object) -> str | None:
    return None if isinstance(v, dict) else f"expected a table, got {show(v)}"


def choice_check(choices: tuple[str, ...]) -> Check:
    def check(v: object) -> str | None:
        if isinstance(v, str) and v in choices:
            return None
        return f"expected one of {', '.join(choices)}, got {show(v)}"

    return check


def float_pair_check(v: object) -> str | None:
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_number(x) for x in v):
        return None
    return f"expected two numbers like [2.0, 4.0], got {show(v)}"


def resolution_check(v: object) -> str | None:
    try:
        parse_resolutions(v)
    except ValueError as e:
        return str(e)
    return None


def size_check(v: object) -> str | None:
    ok = _is_int(v) and v > 0 or isinstance(v, list) and len(v) == 2 and all(_is_int(x) and x > 0 for x in v)
    return None if ok else f"expected an integer or [width, height], got {show(v)}"


@dataclass(frozen=True)
class Key:
    check: Check
    levels: frozenset[str]


KEYS: dict[str, Key] = {
    # dataset-level (general or [[datasets]])
    "batch_size": Key(int_check(1), _GD),
    "resolution": Key(resolution_check, _GD),
    "enable_bucket": Key(bool_check, _GD),
    "bucket_no_upscale": Key(bool_check, _GD),
    "min_bucket_reso": Key(int_check(1), _GD),
    "max_bucket_reso": Key(int_check(1), _GD),
    "bucket_reso_steps": Key(int_check(1), _GD),
    "skip_image_resolution": Key(resolution_check, _GD),
    "validation_split": Key(number_check(0, 1), _GD),
    "validation_seed": Key(int_check(), _GD),
    "network_multiplier": Key(number_check(), _GD),
    # subset-level, also settable in [general] / [[datasets]]
    "resize_interpolation": Key(choice_check(INTERPOLATIONS), _ALL),
    "num_repeats": Key(int_check(1), _ALL),
    "shuffle_caption": Key(bool_check, _ALL),
    "flip_aug": Key(bool_check, _ALL),
    "color_aug": Key(bool_check, _ALL),
    "random_crop": Key(bool_check, _ALL),
    "enable_wildcard": Key(bool_check, _ALL),
    "keep_tokens": Key(int_check(0), _ALL),
    "keep_tokens_separator": Key(str_check, _ALL),
    "secondary_separator": Key(str_check, _ALL),
    "caption_separator": Key(nonempty_str_check, _ALL),
    "caption_prefix": Key(str_check, _ALL),
    "caption_suffix": Key(str_check, _ALL),
    "token_warmup_min": Key(int_check(0), _ALL),
    "token_warmup_step": Key(number_check(0), _ALL),
    "face_crop_aug_range": Key(float_pair_check, _ALL),
    "custom_attributes": Key(table_check, _ALL),
    "caption_dropout_rate": Key(number_check(0, 1), _ALL),
    "caption_tag_dropout_rate": Key(number_check(0, 1), _ALL),
    "caption_dropout_every_n_epochs": Key(int_check(0), _ALL),
    "caption_extension": Key(str_check, _ALL),
    "cache_info": Key(bool_check, _ALL),
    "class_tokens": Key(str_check, _ALL),
    "alpha_mask": Key(bool_check, _ALL),
    # subset only
    "image_dir": Key(nonempty_str_check, _S),
    "is_reg": Key(bool_check, _S),
    "metadata_file": Key(nonempty_str_check, _S),
    "conditioning_data_dir": Key(nonempty_str_check, _S),
    # the edit models' control images (library/data/control_images.py checks them)
    "control_directory": Key(nonempty_str_check, _S),
    "no_resize_control": Key(bool_check, _ALL),
    "control_resolution": Key(size_check, _ALL),
}

# Names users put in a dataset file that are command-line flags (or flag spellings) instead.
CLI_ONLY: dict[str, str] = {
    "prior_loss_weight": "it is a command-line flag: pass --prior_loss_weight",
    "max_token_length": "it is a command-line flag: pass --max_token_length",
    "debug_dataset": "it is a command-line flag (--debug_dataset)",
    "train_batch_size": 'the dataset-file name is "batch_size"',
    "dataset_repeats": 'the dataset-file name is "num_repeats"',
    "in_json": 'the dataset-file name is "metadata_file" (in a [[datasets.subsets]] table)',
    "train_data_dir": 'the dataset-file name is "image_dir" (in a [[datasets.subsets]] table)',
    "reg_data_dir": "use a [[datasets.subsets]] table with image_dir and is_reg = true",
    "caption_extention": 'the dataset-file name is "caption_extension"',
}

_LEVEL_HOME = {
    frozenset({S}): "a [[datasets.subsets]] table",
    _GD: "[general] or a [[datasets]] table",
}


def _unknown_key_message(key: str) -> str:
    if key in CLI_ONLY:
        return f"not a dataset-file key; {CLI_ONLY[key]}"
    hint = did_you_mean(
        key, [*KEYS, *CLI_ONLY], show='"{}"'.format, otherwise="the keys are listed in docs/data.md (Dataset file keys)"
    )
    return "unknown key" + hint


def validate_table(table: dict, level: str, where: str, problems: Problems) -> None:
    """Check every key of one table (``level`` is general/dataset/subset); ``where`` is e.g. ``f.toml: datasets[0]``."""
    for key, value in table.items():
        path = f"{where}.{key}"
        spec = KEYS.get(key)
        if spec is None:
            if not (level == D and key == "subsets"):
                problems.error(path, _unknown_key_message(key))
            continue
        if level not in spec.levels:
            problems.error(path, f"{key} can only be set in {_LEVEL_HOME[spec.levels]}")
            continue
        text = spec.check(value)
        if text:
            problems.error(path, text)


def validate_document(doc: object, source: str, problems: Problems) -> None:
    """Validate a whole parsed dataset file: top level ``general`` (table) and ``datasets`` (array of tables)."""
    if not isinstance(doc, dict):
        problems.error(source, f"expected a table with [general] and [[datasets]], got {show(doc)}")
        return
    for key in doc:
        if key not in ("general", "datasets"):
            hint = did_you_mean(key, ["general", "datasets"], show='"{}"'.format,
                                otherwise="the top level holds only [general] and [[datasets]]")  # fmt: skip
            problems.error(f"{source}: {key}", f"unknown top-level key{hint}")
    general = doc.get("general", {})
    if not isinstance(general, dict):
        problems.error(f"{source}: general", f"expected a table ([general]), got {show(general)}")
    else:
        validate_table(general, G, f"{source}: general", problems)
    datasets = doc.get("datasets", [])
    if not isinstance(datasets, list) or not all(isinstance(d, dict) for d in datasets):
        problems.error(f"{source}: datasets", "expected an array of tables ([[datasets]])")
        return
    if not datasets:
        problems.error(f"{source}: datasets", "no [[datasets]] table; add one with at least one [[datasets.subsets]]")
    for i, dataset in enumerate(datasets):
        validate_table(dataset, D, f"{source}: datasets[{i}]", problems)
        subsets = dataset.get("subsets", [])
        if not isinstance(subsets, list) or not all(isinstance(s, dict) for s in subsets):
            problems.error(f"{source}: datasets[{i}].subsets", "expected an array of tables ([[datasets.subsets]])")
            continue
        if not subsets:
            problems.error(f"{source}: datasets[{i}]", "has no [[datasets.subsets]]; add one with image_dir")
        for j, subset in enumerate(subsets):
            validate_table(subset, S, f"{source}: datasets[{i}].subsets[{j}]", problems)
