"""The CLIP BPE tokenizer, built offline from the vocabulary file that ships with the package.

Every SD family uses the same CLIP byte-level BPE vocabulary (49,408 tokens). What differs is the padding token:
SD1 and SDXL's first encoder pad with ``<|endoftext|>`` (openai/clip-vit-large-patch14), SD2 and SDXL's second
encoder (OpenCLIP) pad with ``!`` (id 0). The merges file is OpenAI CLIP's ``bpe_simple_vocab_16e6.txt.gz``
(MIT licence, as distributed with open_clip); the vocabulary is derived from it exactly as CLIP does.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

BPE_FILE = Path(__file__).parent / "data" / "bpe_simple_vocab_16e6.txt.gz"
NUM_MERGES = 49152 - 256 - 2
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
PAD_CLIP_L, PAD_OPEN_CLIP = EOS, "!"

log = logging.getLogger(__name__)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


@lru_cache(maxsize=1)
def _vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    lines = gzip.open(BPE_FILE).read().decode("utf-8").split("\n")
    merges = lines[1 : NUM_MERGES + 1]
    symbols = list(_bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges] + [BOS, EOS]
    return {tok: i for i, tok in enumerate(vocab)}, merges


def write_vocab_files(dest: str | os.PathLike) -> Path:
    """Write CLIP's ``vocab.json`` and ``merges.txt`` into ``dest`` (what the slow ``CLIPTokenizer`` of
    transformers 4 needs; transformers 5 saves only ``tokenizer.json``)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    vocab, merges = _vocab_and_merges()
    (dest / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (dest / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return dest


def write_clip_tokenizer(dest: str | os.PathLike, pad_token: str = PAD_CLIP_L) -> Path:
    """Write a CLIP tokenizer folder (vocab.json, merges.txt, configs) loadable by ``CLIPTokenizer.from_pretrained``."""
    dest = write_vocab_files(dest)
    special = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": pad_token}
    (dest / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": 77,
        "do_lower_case": True,
        "errors": "replace",
        "add_prefix_space": False,
        **special,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return dest


def _cache_root() -> Path:
    root = os.environ.get("SDTRAIN_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "sdtrain")
    return Path(root).expanduser()


def load_clip_tokenizer(pad_token: str = PAD_CLIP_L):
    """A CLIPTokenizer with the real CLIP vocabulary, built without network access (cached on disk)."""
    from transformers import CLIPTokenizer

    name = "clip_tokenizer_pad_bang" if pad_token == PAD_OPEN_CLIP else "clip_tokenizer_pad_eos"
    folder = _cache_root() / name
    if not (folder / "tokenizer_config.json").exists():
        tmp = folder.with_name(f"{name}.tmp{os.getpid()}")
        write_clip_tokenizer(tmp, pad_token)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return CLIPTokenizer.from_pretrained(str(folder))


def load_tokenizers(specs: Sequence[Any], folder: Path | None = None, cache_dir: str | None = None) -> list:
    """One CLIP tokenizer per text encoder spec (``base.TextEncoderSpec``): the diffusers folder's own
    (``tokenizer/``, ``tokenizer_2/``), else one in ``cache_dir`` in sd-scripts' ``--tokenizer_cache_dir`` layout
    (``<dir>/<hub id with / replaced by _>``), else the bundled offline tokenizer. The pad token is set to the
    spec's, as sd-scripts forces "!" (id 0) for SDXL's second tokenizer."""
    from transformers import CLIPTokenizer

    tokenizers = []
    for i, spec in enumerate(specs):
        candidates = [folder / ("tokenizer" if i == 0 else f"tokenizer_{i + 1}")] if folder is not None else []
        if cache_dir:
            candidates.append(Path(cache_dir) / spec.tokenizer_id.replace("/", "_"))
        found = next((c for c in candidates if (c / "tokenizer_config.json").is_file()), None)
        tokenizer = CLIPTokenizer.from_pretrained(str(found)) if found else load_clip_tokenizer(spec.pad_token)
        if tokenizer.pad_token != spec.pad_token:
            tokenizer.pad_token = spec.pad_token
        log.debug("tokenizer %d: %s", i, found or "bundled CLIP vocabulary")
        tokenizers.append(tokenizer)
    return tokenizers


class DeferredTokenizer:
    """A tokenizer built at its first use: ``load(*args)`` runs when a name is looked up on it, it is called, or its
    length is asked. A run whose text-encoder outputs are all cached never tokenizes, and a large BPE vocabulary
    (Qwen's 151k tokens: about 130 MB of the process's memory) then never loads. Everything else is the real
    tokenizer's: attributes are read and set on it, pickling (a data loader worker) sends the real one."""

    __slots__ = ("_load", "_args", "_tokenizer")

    def __init__(self, load: Any, *args: Any) -> None:
        object.__setattr__(self, "_load", load)
        object.__setattr__(self, "_args", args)
        object.__setattr__(self, "_tokenizer", None)

    @property
    def loaded(self) -> bool:
        return self._tokenizer is not None

    def resolve(self) -> Any:
        """The real tokenizer (built now if it was not yet)."""
        if self._tokenizer is None:
            object.__setattr__(self, "_tokenizer", self._load(*self._args))
        return self._tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.resolve(), name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.resolve())

    def __bool__(self) -> bool:  # a tokenizer is there (``tokenizer or default`` does not build it)
        return True

    def __reduce__(self) -> tuple:
        return (_same, (self.resolve(),))

    def __repr__(self) -> str:
        return repr(self._tokenizer) if self.loaded else f"DeferredTokenizer({getattr(self._load, '__name__', '?')})"


def _same(obj: Any) -> Any:
    return obj
