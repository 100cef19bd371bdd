"""Cache entries: their content keys and the store that keeps them (memory, --cache_dir or next to images).

Latent and text-encoder-output caches that are never stale.

An entry's key is a SHA-256 over the image bytes (and mask bytes) plus every setting that changes the result:
encoder identity, bucket, resize size, crop box, flip, interpolation. A changed image, VAE or bucket gives a new
key, so an old entry is never used; an unchanged input gives the same key, so entries are reused across runs.
Entries are safetensors files written atomically (temp file + ``os.replace``), in memory, in ``--cache_dir``, or
next to the images (only with the ``*_to_disk`` flags and no ``--cache_dir``; then under our own file names,
never touching an existing file). sd-scripts' caches key on the file name only (``library/strategy_sd.py:
SdSdxlLatentsCachingStrategy.get_latents_npz_path``; its validity check compares shapes, not contents).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

Tensors = dict[str, torch.Tensor]
_FORMAT = 1  # bump when the meaning of an entry changes


_DIGESTS: dict[str, tuple[float, int, str]] = {}  # path -> (mtime, size, sha256): each file is hashed once


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes (memoised per process; recomputed when the file's mtime or size changes)."""
    st = os.stat(path)
    hit = _DIGESTS.get(path)
    if hit and hit[:2] == (st.st_mtime, st.st_size):
        return hit[2]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    _DIGESTS[path] = (st.st_mtime, st.st_size, h.hexdigest())
    return h.hexdigest()


def cache_key(kind: str, **inputs: object) -> str:
    """Key of one cache entry: SHA-256 of the canonical JSON of ``kind`` and all ``inputs`` (format-versioned)."""
    blob = json.dumps({"format": _FORMAT, "kind": kind, **inputs}, sort_keys=True, default=list)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def latent_key(
    *,
    image_digest: str,
    encoder_id: str,
    bucket: tuple[int, int],
    resized: tuple[int, int],
    crop: tuple[int, int],
    flip: bool,
    interpolation: str | None,
    mask_digest: str | None = None,
    alpha_mask: bool = False,
) -> str:
    """Key of a cached latent: everything that changes the encoded pixels (and the stored mask)."""
    return cache_key(
        "latent",
        image=image_digest,
        encoder=encoder_id,
        bucket=list(bucket),
        resized=list(resized),
        crop=list(crop),
        flip=flip,
        interpolation=interpolation,
        mask=mask_digest,
        alpha_mask=alpha_mask,
    )


def text_key(*, caption: str, encoder_id: str, controls: list[tuple[str, tuple[int, int]]] | None = None) -> str:
    """Key of cached text-encoder outputs for one caption string (``controls``: (digest, (width, height) trained
    at) of each control image an edit model's prompt encoder sees with it)."""
    if controls:
        return cache_key("text", caption=caption, encoder=encoder_id, controls=list(controls))
    return cache_key("text", caption=caption, encoder=encoder_id)


class CacheStore:
    """Where entries live. ``folder``: ``<folder>/<key[:2]>/<key>.safetensors``; ``next_to_images``:
    ``<image stem>.sdtrain-<kind>-<key[:16]>.safetensors``; neither: in memory only."""

    def __init__(self, kind: str, *, folder: str | None = None, next_to_images: bool = False) -> None:
        self.kind, self.folder, self.next_to_images = kind, folder, next_to_images
        self.memory: dict[str, Tensors] = {}

    @property
    def on_disk(self) -> bool:
        return self.folder is not None or self.next_to_images

    def path(self, key: str, anchor: str) -> str:
        if self.folder is not None:
            return os.path.join(self.folder, key[:2], key + ".safetensors")
        return os.path.splitext(anchor)[0] + f".sdtrain-{self.kind}-{key[:16]}.safetensors"

    def has(self, key: str, anchor: str, check: Callable[[dict[str, tuple[int, ...]]], bool] | None = None) -> bool:
        """Whether a valid entry exists; ``check`` gets the stored shapes (skipped when None)."""
        if key in self.memory:
            return True
        if not self.on_disk or not os.path.isfile(self.path(key, anchor)):
            return False
        if check is None:
            return True
        try:
            with safe_open(self.path(key, anchor), framework="pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception:  # noqa: BLE001 - an unreadable cache file is simply rebuilt
            return False
        return check(shapes)

    def load(self, key: str, anchor: str) -> Tensors:
        if key in self.memory:
            return self.memory[key]
        path = self.path(key, anchor)
        if not self.on_disk or not os.path.isfile(path):
            raise KeyError(f"no cached {self.kind} entry {key[:16]} for {anchor}; run the caching step first")
        return load_file(path)

    def save(self, key: str, anchor: str, tensors: Tensors) -> None:
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
        if not self.on_disk:
            self.memory[key] = tensors
            return
        path = self.path(key, anchor)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".sdtrain-", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"sdtrain_cache": self.kind, "key": key})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
