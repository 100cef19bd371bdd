"""Parsing ``--resolution`` / the ``resolution`` key, including lists of resolutions for multi-resolution training.

Accepted forms (sizes are width x height in pixels):

* ``512`` -> one square resolution; ``"768,512"`` or ``[768, 512]`` -> one resolution, width 768, height 512
  (sd-scripts' ``W,H`` form keeps its meaning);
* three or more numbers, ``"896,960,1024,1088,1152"`` or ``[896, 960, 1024]`` -> that many square resolutions
  (OneTrainer's multi-resolution list; each sample draws one per epoch);
* the explicit list form, for two squares or non-square members: items separated by ``;``, each ``N``, ``WxH`` or
  ``W,H`` -> ``"512;768"`` (two squares), ``"1024;832x1216"``; in TOML also ``[[512, 512], [768, 768]]`` or
  ``["512", "832x1216"]``.

Two numbers always mean one ``W,H`` resolution: write ``"512;768"`` for two square resolutions.
"""

from __future__ import annotations

Size = tuple[int, int]

FORMS = '512, "768,512" (width,height), "896,960,1024" (several squares) or "512;832x1216" (explicit list)'


def _positive(n: object) -> int:
    if isinstance(n, bool):
        raise ValueError
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if isinstance(n, str):
        n = int(n.strip())
    if not isinstance(n, int) or n <= 0:
        raise ValueError
    return n


def _one_size(item: object) -> Size:
    """One resolution: ``N``, ``"WxH"``, ``"W,H"``, ``[W, H]``."""
    if isinstance(item, (list, tuple)):
        if len(item) != 2:
            raise ValueError
        return _positive(item[0]), _positive(item[1])
    if isinstance(item, str):
        text = item.strip().lower()
        for sep in ("x", ","):
            if sep in text:
                w, h = text.split(sep)
                return _positive(w), _positive(h)
        side = _positive(text)
        return side, side
    side = _positive(item)
    return side, side


def _parse(value: object) -> tuple[Size, ...]:
    if isinstance(value, str):
        text = value.strip()
        if ";" in text:
            return tuple(_one_size(p) for p in text.split(";") if p.strip())
        if "x" in text.lower():
            return (_one_size(text),)
        parts = [p for p in text.split(",") if p.strip()]
        if len(parts) >= 3:
            return tuple(_one_size(p) for p in parts)
        return (_one_size(text),)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple, str)) for v in value):
            return tuple(_one_size(v) for v in value)
        if len(value) == 2:
            return (_one_size(value),)
        if len(value) >= 3:
            return tuple(_one_size(v) for v in value)
        raise ValueError
    return (_one_size(value),)


def parse_resolutions(value: object) -> tuple[Size, ...]:
    """Parse a resolution value into a tuple of ``(width, height)``; raises ValueError naming the accepted forms."""
    try:
        sizes = _parse(value)
    except (ValueError, TypeError):
        sizes = ()
    if not sizes:
        shown = f'"{value}"' if isinstance(value, str) else repr(value)
        raise ValueError(f"expected a resolution like {FORMS}, got {shown}")
    return tuple(dict.fromkeys(sizes))


def format_size(size: Size) -> str:
    return f"{size[0]}x{size[1]}"
