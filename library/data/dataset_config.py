"""From flags and dataset files to validated, resolved ``DatasetConfig`` objects.

Three sources, as sd-scripts users have them (sd-scripts' ``library/config_util.py``): a ``--dataset_config``
TOML/JSON file; ``--train_data_dir`` / ``--reg_data_dir`` with ``<repeats>_<class tokens>`` sub-folders; ``--in_json``
metadata (fine-tune mode) with ``--dataset_repeats``. All three become the same document (``general`` + ``datasets`` +
``subsets``), validated by ``schema`` and resolved subset -> dataset -> general -> command line -> default (the first
value that is set wins, as sd-scripts' ``BlueprintGenerator``). Every problem is reported at once, before any image or
model is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from library.cli.parse import bom_hint
from library.cli.problems import ConfigError, Problems

from . import control_images, musubi_dataset
from .buckets import BucketSpec
from .captions import CaptionConfig
from .conditioning import REFUSED_WITH_CONDITIONING
from .control_images import ControlSettings
from .data_args import DataArgs
from .resolution import Size, format_size, parse_resolutions
from .schema import show, validate_document
from .sources import has_images, list_images

try:  # Python 3.11+
    import tomllib as _toml

    def _toml_loads(text: str) -> dict:
        return _toml.loads(text)

    _TomlError: type[Exception] = _toml.TOMLDecodeError
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import toml as _toml  # type: ignore[no-redef]

    def _toml_loads(text: str) -> dict:
        return _toml.loads(text)

    _TomlError = _toml.TomlDecodeError  # type: ignore[attr-defined]

CLI = "command line"
_CLI_FLAG = {"batch_size": "train_batch_size", "num_repeats": "dataset_repeats", "resolution": "resolution"}


@dataclass(frozen=True)
class SubsetConfig:
    """One image folder or metadata file with its resolved per-subset settings."""

    where: str  # for messages: "dataset.toml: datasets[0].subsets[1]" or "--train_data_dir 10_dog"
    kind: str  # "dreambooth" (images + caption files) | "finetune" (metadata JSON)
    image_dir: str | None
    metadata_file: str | None
    conditioning_data_dir: str | None
    is_reg: bool
    class_tokens: str | None
    caption_extension: str
    num_repeats: int
    captions: CaptionConfig
    flip_aug: bool = False
    color_aug: bool = False
    random_crop: bool = False
    face_crop_aug_range: tuple[float, float] | None = None
    alpha_mask: bool = False
    resize_interpolation: str | None = None
    custom_attributes: dict = field(default_factory=dict)
    control: ControlSettings | None = None  # the edit models' control_directory (library/data/control_images.py)


@dataclass(frozen=True)
class DatasetConfig:
    """One dataset: subsets that share resolution(s), batch size and bucket settings."""

    where: str
    subsets: tuple[SubsetConfig, ...]
    batch_size: int
    resolutions: tuple[Size, ...]
    enable_bucket: bool
    min_bucket_reso: int
    max_bucket_reso: int
    bucket_reso_steps: int
    bucket_no_upscale: bool
    skip_image_resolution: Size | None = None

    def bucket_spec(self, resolution: int = 0) -> BucketSpec:
        """The bucket settings at training resolution number ``resolution``."""
        return BucketSpec(
            self.resolutions[resolution],
            self.enable_bucket,
            self.min_bucket_reso,
            self.max_bucket_reso,
            self.bucket_reso_steps,
            self.bucket_no_upscale,
        )


def read_dataset_file(path: str) -> dict:
    """Parse a ``.toml`` or ``.json`` dataset file; syntax errors name the file and the line."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".toml", ".json"):
        raise ConfigError([f"--dataset_config {path}: expected a .toml or .json file, got {ext or 'no extension'}"])
    if not os.path.isfile(path):
        raise ConfigError([f"--dataset_config {path}: file not found"])
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return _toml_loads(text) if ext == ".toml" else json.loads(text)
    except (_TomlError, json.JSONDecodeError) as e:
        raise ConfigError([f"{path}: not valid {ext[1:].upper()}: {e}{bom_hint(text)}"]) from None


def _folder_subsets(parent: str, flag: str, is_reg: bool, problems: Problems) -> list[dict]:
    """sd-scripts' ``<repeats>_<class tokens>`` folder convention (sd-scripts' ``library/config_util.py:
    generate_dreambooth_subsets_config_by_subdirs``)."""
    if not os.path.isdir(parent):
        problems.error(f"{flag} {parent}", "folder not found")
        return []
    subsets = []
    for entry in sorted(os.scandir(parent), key=lambda e: e.name):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        head, _, rest = entry.name.partition("_")
        where = f"{flag} {os.path.join(parent, entry.name)}"
        if not head.isdigit():
            if has_images(entry.path):
                problems.error(
                    where,
                    f'folder name has no repeat count; rename it "<repeats>_<class tokens>", e.g. "10_{entry.name}"',
                )
            continue
        if int(head) < 1:
            problems.error(where, f"repeat count {int(head)} must be >= 1; rename the folder or move it out")
            continue
        subset = {"image_dir": entry.path, "num_repeats": int(head), "class_tokens": rest, "is_reg": is_reg}
        subsets.append({**subset, "_where": where})
    loose = list_images(parent)[0]
    if loose:
        text = (
            f"{len(loose)} images lie directly in this folder and are not used; {flag} must be the parent of "
            '"<repeats>_<class tokens>" folders (move them into e.g. "10_name")'
        )
        (problems.error if not subsets else problems.warn)(f"{flag} {parent}", text)
    elif not subsets and not is_reg:
        problems.error(f"{flag} {parent}", 'no "<repeats>_<class tokens>" sub-folders with images found')
    return subsets


def command_line_document(args: DataArgs, problems: Problems) -> dict:
    """The dataset document that ``--train_data_dir`` / ``--reg_data_dir`` / ``--in_json`` describe."""
    if args.in_json:
        subset = {"metadata_file": args.in_json, "_where": f"--in_json {args.in_json}"}
        if args.train_data_dir:
            subset["image_dir"] = args.train_data_dir
        return {"datasets": [{"subsets": [subset]}]}
    if not args.train_data_dir:
        problems.error(CLI, "no dataset given; pass --dataset_config, --train_data_dir or --in_json")
        return {"datasets": []}
    if args.conditioning_images:  # sd-scripts' ControlNet trainers: the folder itself, paired with its conditioning
        if not args.conditioning_data_dir:
            problems.error("--conditioning_data_dir", "required with --train_data_dir: the conditioning images' folder")
        subset = {"image_dir": args.train_data_dir, "conditioning_data_dir": args.conditioning_data_dir}
        return {"datasets": [{"subsets": [{**subset, "_where": f"--train_data_dir {args.train_data_dir}"}]}]}
    subsets = _folder_subsets(args.train_data_dir, "--train_data_dir", False, problems)
    if args.reg_data_dir:
        subsets += _folder_subsets(args.reg_data_dir, "--reg_data_dir", True, problems)
    return {"datasets": [{"subsets": subsets}]}


def _pick(key: str, tables: list[dict], cli: dict, default: object = None) -> object:
    for table in tables:
        if table.get(key) is not None:
            return table[key]
    value = cli.get(key)
    return default if value is None else value


def _key_where(where: str, key: str, source: str) -> str:
    return f"--{_CLI_FLAG.get(key, key)}" if source == CLI else f"{where}.{key}"


def _caption_config(tables: list[dict], cli: dict) -> CaptionConfig:
    values = {name: _pick(name, tables, cli) for name in CaptionConfig.field_names()}
    return CaptionConfig(**{k: v for k, v in values.items() if v is not None})


_SUBSET_FLAGS = {"metadata_file": "--in_json", "image_dir": "--train_data_dir"}  # a command-line subset's keys


def _missing(sub: dict, where: str, key: str, what: str, problems: Problems) -> None:
    """A subset's file or folder ``key`` that does not exist: named by its key path in a dataset file, or by the
    flag that gave it when the command line made the subset (``where`` is then that flag, e.g. ``--in_json m.json``)."""
    if where.startswith("--") and key in _SUBSET_FLAGS:
        problems.error(f"{_SUBSET_FLAGS[key]} {sub[key]}", f"{what} not found")
    else:
        problems.error(f"{where}.{key}", f"{what} {show(sub[key])} not found")


def _resolve_subset(sub: dict, where: str, kind: str, tables: list[dict], cli: dict, problems: Problems):
    if kind == "dreambooth" and not sub.get("image_dir"):
        problems.error(f"{where}.image_dir", "required for a subset without metadata_file; set the image folder")
        return None
    for key in ("image_dir", "conditioning_data_dir"):
        if sub.get(key) and not os.path.isdir(sub[key]):
            _missing(sub, where, key, "folder", problems)
    meta = sub.get("metadata_file")
    if meta and not os.path.isfile(meta):
        _missing(sub, where, "metadata_file", "file", problems)
    if cli.get("conditioning_images"):
        _check_conditioning(sub, where, tables, cli, problems)
    elif sub.get("conditioning_data_dir") and not cli.get("masked_loss"):
        problems.error(f"{where}.conditioning_data_dir", "masks need --masked_loss; add the flag or remove the key")
    if _pick("cache_info", tables, {}):
        problems.warn(f"{where}.cache_info", "has no effect: sdtrain reads image headers directly; ignored")
    face = _pick("face_crop_aug_range", tables, cli)
    return SubsetConfig(
        where=where,
        kind=kind,
        image_dir=sub.get("image_dir"),
        metadata_file=meta,
        conditioning_data_dir=sub.get("conditioning_data_dir"),
        is_reg=bool(sub.get("is_reg", False)),
        class_tokens=_pick("class_tokens", tables, {}),
        caption_extension=_pick("caption_extension", tables, cli, ".caption"),
        num_repeats=_pick("num_repeats", tables, cli, 1),
        captions=_caption_config(tables, cli),
        flip_aug=_pick("flip_aug", tables, cli, False),
        color_aug=_pick("color_aug", tables, cli, False),
        random_crop=_pick("random_crop", tables, cli, False),
        face_crop_aug_range=tuple(face) if face else None,
        alpha_mask=_pick("alpha_mask", tables, cli, False),
        resize_interpolation=_pick("resize_interpolation", tables, cli),
        custom_attributes=dict(_pick("custom_attributes", tables, {}, {})),
        control=control_images.subset_settings(sub, tables, cli, problems, where),
    )


def _check_conditioning(sub: dict, where: str, tables: list[dict], cli: dict, problems: Problems) -> None:
    """A subset of a trainer that takes conditioning images: it names their folder, and nothing cuts the training
    image unlike its conditioning image (library/data/conditioning.py)."""
    if sub.get("metadata_file"):
        problems.error(f"{where}.metadata_file", "conditioning images pair with an image folder (image_dir), as in "
                       "sd-scripts; use image_dir with caption files")  # fmt: skip
    if not sub.get("conditioning_data_dir"):
        problems.error(f"{where}.conditioning_data_dir", "required: this trainer trains on conditioning images; set "
                       "the folder that holds one per training image (same base name)")  # fmt: skip
    for name, why in REFUSED_WITH_CONDITIONING.items():
        if _pick(name, tables, cli):
            problems.error(_key_where(where, name, CLI if where.startswith("--") else ""), f"not supported with "
                           f"conditioning images: {why}; turn it off")  # fmt: skip


def _resolve_subsets(dataset: dict, where: str, general: dict, cli: dict, problems: Problems) -> list[SubsetConfig]:
    raw = dataset.get("subsets", [])
    kinds = {"finetune" if s.get("metadata_file") else "dreambooth" for s in raw}
    if len(kinds) > 1:
        problems.error(where, "mixes subsets with and without metadata_file; put them in two [[datasets]]")
        return []
    kind = kinds.pop() if kinds else "dreambooth"
    subsets, seen = [], set()
    for j, sub in enumerate(raw):
        sub_where = sub.get("_where", f"{where}.subsets[{j}]")
        ident = sub.get("metadata_file") or sub.get("image_dir")
        if ident in seen:
            problems.warn(sub_where, f"same folder/metadata as an earlier subset of this dataset ({ident}); ignored")
            continue
        seen.add(ident)
        resolved = _resolve_subset(sub, sub_where, kind, [sub, dataset, general], cli, problems)
        if resolved:
            subsets.append(resolved)
    return subsets


def _check_buckets(ds: DatasetConfig, source: str, size_multiple: int, problems: Problems) -> DatasetConfig:
    """sd-scripts' bucket-parameter rules, as errors and warnings instead of asserts; returns adjusted min/max."""
    kw = lambda key: _key_where(ds.where, key, source)  # noqa: E731
    if not ds.enable_bucket:
        for w, h in ds.resolutions:
            if w % size_multiple or h % size_multiple:
                fix = f"{round(w / size_multiple) * size_multiple or size_multiple}x"
                fix += f"{round(h / size_multiple) * size_multiple or size_multiple}"
                problems.error(
                    kw("resolution"), f"{w}x{h} is not a multiple of {size_multiple} (the model needs it); try {fix}"
                )
        return ds
    steps = ds.bucket_reso_steps
    if steps % size_multiple:
        problems.error(kw("bucket_reso_steps"), f"{steps} is not a multiple of {size_multiple} (the model needs it)")
        return ds
    if ds.bucket_no_upscale:
        return ds
    lo, hi = ds.min_bucket_reso, ds.max_bucket_reso
    why = f"bucket sides are multiples of bucket_reso_steps {steps}, as in sd-scripts"
    if lo % steps and lo > steps:
        problems.warn(kw("min_bucket_reso"), f"{lo} rounded down to {lo - lo % steps} ({why})")
    elif lo % steps:
        problems.error(kw("min_bucket_reso"), f"{lo} becomes 0 when rounded down to a multiple of {steps} ({why}); "
                       f"use {steps} or more, or a smaller bucket_reso_steps")  # fmt: skip
    lo_reported = 0 < lo < steps
    lo -= lo % steps
    if hi % steps:
        problems.warn(kw("max_bucket_reso"), f"{hi} rounded up to {hi + steps - hi % steps} ({why})")
        hi += steps - hi % steps
    for res in ds.resolutions:
        if not lo_reported and (lo > min(res) or lo < 1):
            problems.error(kw("min_bucket_reso"), f"{lo} must be between 1 and the smaller side of {format_size(res)}")
        if hi < max(res):
            problems.error(kw("max_bucket_reso"), f"{hi} is below the larger side of {format_size(res)}; raise it")
    return DatasetConfig(**{**ds.__dict__, "min_bucket_reso": lo, "max_bucket_reso": hi})


def _resolve_dataset(dataset: dict, where: str, source: str, general: dict, cli: dict, problems: Problems):
    tables = [dataset, general]
    raw_res = _pick("resolution", tables, cli)
    resolutions = parse_resolutions(raw_res) if raw_res is not None else ()
    if not resolutions:
        problems.error(_key_where(where, "resolution", source), "not set; add resolution = 512 or pass --resolution")
    skip = _pick("skip_image_resolution", tables, cli)
    if _pick("validation_split", tables, {}, 0) > 0:
        problems.error(f"{where}.validation_split", "validation splits are not supported yet; remove the key")
    if _pick("network_multiplier", tables, {}, 1.0) != 1.0:
        problems.error(f"{where}.network_multiplier", "has no effect (sd-scripts ignores it too); remove the key")
    ds = DatasetConfig(
        where=where,
        subsets=tuple(_resolve_subsets(dataset, where, general, cli, problems)),
        batch_size=_pick("batch_size", tables, cli, 1),
        resolutions=resolutions,
        enable_bucket=_pick("enable_bucket", tables, cli, False),
        min_bucket_reso=_pick("min_bucket_reso", tables, cli, 256),
        max_bucket_reso=_pick("max_bucket_reso", tables, cli, 1024),
        bucket_reso_steps=_pick("bucket_reso_steps", tables, cli, 64),
        bucket_no_upscale=_pick("bucket_no_upscale", tables, cli, False),
        skip_image_resolution=parse_resolutions(skip)[0] if skip is not None else None,
    )
    return ds


def resolve_document(doc: dict, source: str, args: DataArgs, problems: Problems, size_multiple: int = 64):
    """Resolve a validated document into ``DatasetConfig`` objects (errors and warnings go to ``problems``)."""
    cli = args.cli_fallbacks()
    general = doc.get("general", {})
    out = []
    for i, dataset in enumerate(doc.get("datasets", [])):
        where = CLI if source == CLI else f"{source}: datasets[{i}]"
        ds = _resolve_dataset(dataset, where, source, general, cli, problems)
        if ds.resolutions:
            ds = _check_buckets(ds, source, size_multiple, problems)
        out.append(ds)
    return out


def load_dataset_configs(args: DataArgs, *, size_multiple: int = 64) -> tuple[list[DatasetConfig], list[str]]:
    """Build every ``DatasetConfig`` from the flags (and the dataset file, when given).

    ``size_multiple``: what the model needs image sides to be a multiple of (SD1/SD2: 64, SDXL: 32; ask the family).
    Returns (datasets, warnings). Raises one ``ConfigError`` listing every problem found.
    """
    problems = Problems("dataset configuration")
    if args.conditioning_images and args.masked_loss:
        problems.error("--masked_loss", "this trainer reads conditioning_data_dir as its conditioning images and has "
                       "no masked loss (as sd-scripts' ControlNet trainers); drop --masked_loss")  # fmt: skip
    if args.dataset_config:
        names = ("train_data_dir", "reg_data_dir", "in_json", "conditioning_data_dir")
        ignored = [f"--{n}" for n in names if getattr(args, n)]
        if ignored:
            problems.warn(CLI, f"{', '.join(ignored)} ignored because --dataset_config is given (as in sd-scripts)")
        source = args.dataset_config
        doc = read_dataset_file(source)
        if musubi_dataset.is_musubi(doc):  # kohya-ss/musubi-tuner's layout: rewritten as sd-scripts' document
            read = bool(args.cache_dir) and musubi_dataset.cache_directory(source) == args.cache_dir
            doc = musubi_dataset.to_sdscripts(doc, source, problems, size_multiple, read_cache_directory=read,
                                             control_images=args.control_images)  # fmt: skip
            problems.raise_if_any()
        validate_document(doc, source, problems)
        problems.raise_if_any()
    else:
        source = CLI
        doc = command_line_document(args, problems)
        problems.raise_if_any()  # no dataset / a missing folder: the document's own checks would only repeat it
        validate_document({**doc, "datasets": [_strip(d) for d in doc["datasets"]]}, source, problems)
    datasets = resolve_document(doc, source, args, problems, size_multiple)
    problems.raise_if_any()
    return datasets, problems.warnings


def _strip(dataset: dict) -> dict:
    """A command-line dataset without our private ``_where`` keys (they are not user keys)."""
    return {**dataset, "subsets": [{k: v for k, v in s.items() if k != "_where"} for s in dataset["subsets"]]}
