"""kohya-ss/musubi-tuner's dataset TOML (``[general]`` + ``[[datasets]]`` with ``image_directory`` /
``image_jsonl_file``, ``resolution = [w, h]``, ``num_repeats``, ``cache_directory``), read by any script that reads
``--dataset_config``: :func:`is_musubi` tells the layout apart (a dataset with one of musubi-tuner's source keys and no
``subsets``) and :func:`to_sdscripts` rewrites it as sd-scripts' document (each dataset one subset), which is then
validated and resolved as usual.

Meanings (musubi-tuner's ``dataset/config_utils.py``): ``resolution`` an int or ``[width, height]`` (default
``[960, 544]``); ``enable_bucket`` / ``bucket_no_upscale`` (default false); ``caption_extension`` (default ``.txt``
here); ``batch_size`` / ``num_repeats`` (default 1); ``image_jsonl_file``: one ``{"image_path", "caption"}`` object
per line (sd-scripts' fine-tune metadata reader takes JSONL). Buckets step by the model's size multiple (musubi-tuner:
16 for Qwen-Image) and range from half the shorter side to twice the longer one (musubi-tuner keeps the area and
has no limits: the same buckets for ordinary aspect ratios).

``cache_directory``: where the caches go (:func:`cache_directory`: the scripts with musubi-tuner's names read it as
``--cache_dir``; the other scripts warn that it is not read). The entries are ours (content-keyed, never stale),
not musubi-tuner's ``*_qi.safetensors`` files, which are not read. Refused with a message:
video datasets (``video_directory``, ``video_jsonl_file``, frame keys), the edit models' control images
(``control_directory``, ``no_resize_control``, ``control_resolution``) unless the model takes them (the edit models:
``to_sdscripts(control_images=True)``, read by library/data/control_images.py), ``multiple_target``, FramePack's ``fp_*`` keys,
``debug_dataset``, and any unknown key.
"""

from __future__ import annotations

import tomllib

from library.cli.problems import Problems

SOURCES = ("image_directory", "image_jsonl_file", "video_directory", "video_jsonl_file")
COMMON = ("resolution", "caption_extension", "batch_size", "num_repeats", "enable_bucket", "bucket_no_upscale")
VIDEO = ("video_directory", "video_jsonl_file", "target_frames", "frame_extraction", "frame_stride", "frame_sample",
         "max_frames", "source_fps")  # fmt: skip
CONTROL = ("control_directory", "no_resize_control", "control_resolution", "multiple_target")
FRAMEPACK = ("fp_latent_window_size", "fp_1f_clean_indices", "fp_1f_target_index", "fp_1f_no_post")
DEFAULT_RESOLUTION = [960, 544]


def is_musubi(doc: dict) -> bool:
    """Whether ``doc`` is musubi-tuner's layout (a dataset names its images directly, without ``subsets``)."""
    datasets = doc.get("datasets")
    return isinstance(datasets, list) and any(
        isinstance(d, dict) and "subsets" not in d and any(k in d for k in SOURCES) for d in datasets
    )


def _size(value, where: str, problems: Problems) -> list[int] | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return [value, value]
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return [int(value[0]), int(value[1])]
    problems.error(where, f"resolution must be an integer or [width, height], got {value!r}")
    return None


def _check_keys(table: dict, where: str, problems: Problems, allowed: tuple[str, ...]) -> None:
    for key in table:
        if key in allowed:
            continue
        if key in VIDEO:
            problems.error(where, f"{key}: video datasets are not supported (musubi-tuner's video models); the image "
                           "models here train on image_directory / image_jsonl_file")  # fmt: skip
        elif key == "multiple_target":
            problems.error(where, "multiple_target is not supported (one target image per control set); drop it")
        elif key in CONTROL:
            problems.error(where, f"{key}: the edit models' control images: this model does not take them; train an "
                           "edit model (--model_version edit ...) or drop control_directory")  # fmt: skip
        elif key in FRAMEPACK:
            problems.error(where, f"{key}: FramePack's setting; not for these models")
        elif key == "debug_dataset":
            problems.error(where, "debug_dataset is not supported; drop it")
        else:
            problems.error(where, f"unknown key {key!r} in a musubi-tuner dataset config (known: "
                           f"{', '.join(allowed)})")  # fmt: skip


def read_musubi(path: str | None) -> dict | None:
    """musubi-tuner's dataset config at ``path``; None for another layout or a file that does not read (the full
    read reports it)."""
    if not path or not str(path).lower().endswith(".toml"):
        return None
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return doc if is_musubi(doc) else None


def cache_directory(path: str | None) -> str | None:
    """The ``cache_directory`` of musubi-tuner's dataset config at ``path`` (the first dataset's, else
    ``[general]``'s); None for another layout or none given. The entries are content-keyed, so several datasets
    can share the first one's folder."""
    doc = read_musubi(path)
    if doc is None:
        return None
    named = [d["cache_directory"] for d in doc["datasets"] if isinstance(d, dict) and "cache_directory" in d]
    general = (doc.get("general") or {}).get("cache_directory")
    found = named[0] if named else general
    return str(found) if isinstance(found, str) and found else None


def to_sdscripts(doc: dict, source: str, problems: Problems, size_multiple: int = 16,
                 read_cache_directory: bool = False, control_images: bool = False) -> dict:  # fmt: skip
    """sd-scripts' document for musubi-tuner's ``doc`` (module docstring); problems name ``source`` and the table.
    ``read_cache_directory``: the caller reads ``cache_directory`` (:func:`cache_directory`), so it is not warned
    about. ``control_images``: the model takes control images, so ``control_directory``, ``no_resize_control`` and
    ``control_resolution`` go to the subset (library/data/control_images.py reads them)."""
    control = CONTROL[:3] if control_images else ()
    general = dict(doc.get("general") or {})
    for key in doc:
        if key not in ("general", "datasets"):
            problems.error(source, f"unknown table [{key}] (musubi-tuner's dataset config has [general] and "
                           "[[datasets]])")  # fmt: skip
    _check_keys(general, f"{source}: [general]", problems, COMMON + ("cache_directory",) + control[1:])
    out_general = {k: general[k] for k in ("caption_extension", "batch_size", "enable_bucket", "bucket_no_upscale",
                                           "num_repeats") if k in general}  # fmt: skip
    out_general.setdefault("caption_extension", ".txt")
    datasets = []
    for i, ds in enumerate(doc.get("datasets") or []):
        where = f"{source}: datasets[{i}]"
        if not isinstance(ds, dict):
            problems.error(where, "expected a table")
            continue
        if "subsets" in ds:
            problems.error(where, "mixes sd-scripts' [[datasets.subsets]] with musubi-tuner's image_directory "
                           "datasets; use one layout in a file")  # fmt: skip
            continue
        _check_keys(ds, where, problems, COMMON + SOURCES + ("cache_directory",) + control)
        given = [k for k in ("image_directory", "image_jsonl_file") if k in ds]
        if len(given) != 1:
            if not any(k in ds for k in VIDEO):
                problems.error(where, "needs exactly one of image_directory or image_jsonl_file")
            continue
        if ("cache_directory" in ds or "cache_directory" in general) and not read_cache_directory:
            problems.warn(where, "cache_directory is read by the scripts with musubi-tuner's names (its training and "
                          "caching scripts); here pass --cache_dir to keep the caches on disk")  # fmt: skip
        size = _size(ds.get("resolution", general.get("resolution", DEFAULT_RESOLUTION)), where, problems)
        subset = {"image_dir": ds["image_directory"]} if "image_directory" in ds else {
            "metadata_file": ds["image_jsonl_file"]}  # fmt: skip
        for key in ("num_repeats", "caption_extension", *control):
            if key in ds:
                subset[key] = ds[key]
            elif key in control[1:] and key in general:
                subset[key] = general[key]
        out = {k: ds[k] for k in ("batch_size", "enable_bucket", "bucket_no_upscale") if k in ds}
        if size is not None:
            out["resolution"] = size
            step = size_multiple
            out["bucket_reso_steps"] = step
            out["min_bucket_reso"] = max(step, (min(size) // 2) // step * step)
            out["max_bucket_reso"] = max(size) * 2 // step * step
        out["subsets"] = [subset]
        datasets.append(out)
    return {"general": out_general, "datasets": datasets}
