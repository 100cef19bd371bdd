"""The host memory check before loading (library/run/load_memory.py), per family: its bound against what the load
really holds, and its cost.

For every registered family with a tiny model: the tiny model written as the family's diffusers folder (and, where
the family has them, as its single files + part flags), the bound of the files the load reads at bf16, then the
family's real load in bf16 and the bytes of every parameter and buffer of the parts it returns (each storage once).
The bound should equal the held bytes or stay below them (buffers made at load time, e.g. position ids, are not in
the files). Then the check's cost at real size: a FLUX.1-dev-sized transformer file written as its header only.

    PYTHONPATH=. python benchmarks/bench_load_memory.py
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from library.families.registry import FAMILIES, get_family  # noqa: E402
from library.run import load_memory  # noqa: E402


def held(parts) -> int:
    seen, total = set(), 0
    modules = [parts.denoiser, parts.vae, *parts.text_encoders]
    for module in modules:
        if module is None:
            continue
        for t in [*module.parameters(), *module.buffers()]:
            key = t.untyped_storage().data_ptr()
            if t.device.type == "meta" or key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _written(family, folder: Path, layout: str):
    """The tiny model as a diffusers folder (``layout`` "folder"; None when the family has no folder layout) or as
    its single files (``write_files``: the denoiser file, ``--vae`` and the part flags set on the options)."""
    parts = family.tiny.build(0)
    if layout == "folder":
        try:
            return family.tiny.write_folder(parts, folder), None, family.options()
        except ValueError:
            return None
    files = {k: str(v) for k, v in family.tiny.write_files(parts, folder, "tiny").items()}
    path = files.pop("dit", None) or files.pop("model", None) or str(family.save(parts, folder / "model.safetensors"))
    names = {f.name for f in dataclasses.fields(family.options)}
    return path, files.get("vae"), family.options(**{k: v for k, v in files.items() if k in names})


def per_family(root: Path) -> None:
    print(f"{'family':16} {'layout':7} {'files':>5} {'bound MiB':>10} {'held MiB':>10}  bound/held")
    for name in list(FAMILIES):
        family = get_family(name)
        if family.tiny is None:
            continue
        for layout in ("folder", "files"):
            try:
                written = _written(family, root / name / layout, layout)
                if written is None:
                    continue
                path, vae, options = written
                files = load_memory.files_read(family, path, vae, options)
                bound = sum(f.bytes for f in load_memory.load_bound(files, [torch.bfloat16]))
                parts = family.load(path, dtype=torch.bfloat16, vae=vae, options=options)
            except Exception as e:  # report and go on: the table is the point
                print(f"{name:16} {layout:7} error: {type(e).__name__}: {str(e)[:100]}")
                continue
            real = held(parts)
            print(
                f"{name:16} {layout:7} {len(files):5d} {bound / 2**20:10.2f} {real / 2**20:10.2f}  {bound / real:.3f}"
            )


def header_file(root: Path) -> Path:
    import json

    parts = get_family("flux-dev").reference_parts()
    header, offset = {}, 0
    for key, p in parts.denoiser.state_dict().items():
        n = p.numel() * 2
        header[key] = {"dtype": "BF16", "shape": list(p.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    path = root / "flux1-dev-header-only.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    return path


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        per_family(Path(tmp))
        path = header_file(Path(tmp))
        start = time.perf_counter()
        found = load_memory.load_bound([path], [torch.bfloat16])
        took = time.perf_counter() - start
        print(f"FLUX.1-dev transformer (header only, {path.stat().st_size / 2**20:.2f} MiB on disk): bound "
              f"{found[0].bytes / 2**30:.2f} GiB in {took * 1000:.1f} ms")  # fmt: skip
