"""Seeded random streams: every random choice in the data pipeline is a pure function of (seed, epoch, what, who).

Nothing here touches the global RNGs, so DataLoader workers give the same batches as the main process, and
resuming at (epoch, step k) gives exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import random


def derive_seed(*key: object) -> int:
    """A 64-bit seed from a tuple of ints/strings (blake2b of its repr; stable across processes and platforms)."""
    digest = hashlib.blake2b(repr(key).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rng_for(*key: object) -> random.Random:
    """An independent ``random.Random`` for ``key``, e.g. ``rng_for(seed, epoch, "sample", image_index, repeat)``."""
    return random.Random(derive_seed(*key))
