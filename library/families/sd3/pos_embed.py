"""sd-scripts' positional-embedding options of the SD3 MMDiT (``library/sd3_models.py``), on diffusers' ``PatchEmbed``.

The released models hold ``pos_embed`` (1, M², D), a sin-cos table on an M × M patch grid (M = pos_embed_max_size:
192, SD3.5-medium 384); an h × w patch image reads the centred h × w crop (diffusers' ``cropped_pos_embed``, sd-scripts'
``cropped_pos_embed``). sd-scripts adds:

* ``--pos_emb_random_crop_rate r``: with probability r per forward (``torch.rand(1) < r``), the crop's top and left are
  drawn uniformly (``torch.randint(0, M - h + 1)``, then the same for the left) instead of centred. Here it acts in
  training steps only (grad enabled); sd-scripts' model also crops at random while sampling, which only adds noise to
  the samples.
* ``--enable_scaled_pos_embed`` (SD3.5, multi-resolution): per training resolution R (latent size s = round(√(w·h))
  / 8, patched size n = s / patch), a table on a G = ⌊1.5 n⌋ grid whose coordinates are ``i / G · scale − shift``
  with scale = 16 G / n and shift = scale (G − n) / (2 G) (KohakuBlueleaf's ``get_scaled_2d_sincos_pos_embed``: the
  central n × n region matches the released table's spacing). An image of h × w patches uses the table of the
  smallest n whose area bound holds (h·w ≤ (n_prev² + n²) / 2 between consecutive sizes, ⌊1.5 n_last⌋² for the
  last; larger images take the last table), and a new table of n = max(h, w) when h or w exceeds its grid; then the
  crop as above. These tables replace ``pos_embed`` (which is still saved unchanged).

:func:`install` switches a transformer's ``pos_embed`` module to :class:`CroppingPatchEmbed` (the same module and
weights; its class is swapped, so state-dict keys do not change).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

MAX_RATIO = 1.5  # sd-scripts' MMDiT.POS_EMBED_MAX_RATIO
BASE_SIZE = 16


def sincos_1d(dim: int, positions: Tensor) -> Tensor:
    """(M, dim): sin(p ω_k) ‖ cos(p ω_k), ω_k = 10000^(−k / (dim/2)), k < dim/2, in float64."""
    omega = torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    out = positions.reshape(-1).to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([out.sin(), out.cos()], dim=1)


def scaled_sincos_2d(dim: int, grid_size: int, sample_size: int, base_size: int = BASE_SIZE) -> Tensor:
    """(1, G², dim) float32 scaled table (module docstring): the first half of the features encodes the column
    coordinate, the second the row (sd-scripts' meshgrid(w, h) order); coordinates computed in float32 as numpy."""
    g = grid_size
    coords = torch.arange(g, dtype=torch.float32) / g
    scale = base_size * g / sample_size
    shift = scale * (g - sample_size) / (2 * g)
    coords = coords * scale - shift
    cols = coords[None, :].expand(g, g)  # varies along w
    rows = coords[:, None].expand(g, g)  # varies along h
    emb = torch.cat([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], dim=1)
    return emb.float().unsqueeze(0)


def latent_sizes(resolutions: Iterable[tuple[int, int] | int]) -> list[int]:
    """sd-scripts' latent sizes of the training resolutions: round(√(w·h)) // 8, deduplicated, ascending."""
    sizes = set()
    for r in resolutions:
        w, h = (r, r) if isinstance(r, int) else r
        sizes.add(round(math.sqrt(w * h)) // 8)
    return sorted(sizes)


def _crop(table: Tensor, size: int, h: int, w: int, random_crop: bool) -> Tensor:
    if random_crop:
        top = int(torch.randint(0, size - h + 1, (1,)).item())
        left = int(torch.randint(0, size - w + 1, (1,)).item())
    else:
        top, left = (size - h) // 2, (size - w) // 2
    grid = table.reshape(1, size, size, table.shape[-1])[:, top : top + h, left : left + w, :]
    return grid.reshape(1, -1, table.shape[-1])


class CroppingPatchEmbed(nn.Module):
    """Mixed into diffusers' ``PatchEmbed`` by :func:`install` (class swap): ``cropped_pos_embed`` with sd-scripts'
    random crop and scaled tables. Attributes: ``random_crop_rate`` (float), ``scaled`` (patched size n -> table),
    ``area_bounds`` ([(max area, n)], ascending)."""

    random_crop_rate: float
    scaled: dict[int, Tensor] | None
    area_bounds: list[tuple[int, int]]

    def cropped_pos_embed(self, height: int, width: int) -> Tensor:  # diffusers' signature: latent pixels
        h, w = height // self.patch_size, width // self.patch_size
        random_crop = (self.random_crop_rate > 0 and torch.is_grad_enabled()
                       and torch.rand(1).item() < self.random_crop_rate)  # fmt: skip
        if not self.scaled:
            size = self.pos_embed_max_size
            if h > size or w > size:
                raise ValueError(f"an image of {h}×{w} patches exceeds the transformer's positional embedding "
                                 f"({size}×{size} patches); use a smaller resolution")  # fmt: skip
            return _crop(self.pos_embed, size, h, w, random_crop)
        table, size = self._scaled_table(h, w)
        if table.device != self.pos_embed.device:  # moved once (sd-scripts keeps the moved table too)
            table = table.to(self.pos_embed.device)
            self.scaled[next(n for n, t in self.scaled.items() if t.shape == table.shape)] = table
        return _crop(table, size, h, w, random_crop)

    def _scaled_table(self, h: int, w: int) -> tuple[Tensor, int]:
        area = h * w
        n = next((n for bound, n in self.area_bounds if area <= bound), self.area_bounds[-1][1])
        table = self.scaled[n]
        size = math.isqrt(table.shape[1])
        if h > size or w > size:
            n = max(h, w)
            grid = int(n * MAX_RATIO)
            log.warning("scaled positional embedding: adding a table for %d×%d patches (the image is taller or wider "
                        "than the training resolutions' tables)", h, w)  # fmt: skip
            table = scaled_sincos_2d(self.pos_embed.shape[-1], grid, n)
            self.scaled[n] = table
            self.area_bounds = sorted([*self.area_bounds, (grid * grid, n)])
            size = grid
        return table, size


def _patch_class(base: type) -> type:
    """``SD3PatchEmbed``: :class:`CroppingPatchEmbed` over diffusers' ``PatchEmbed`` (made once, on first use, so that
    importing this module does not import diffusers; a module attribute, so pickling finds it by name)."""
    cls = globals().get("SD3PatchEmbed")
    if cls is None or cls.__mro__[2] is not base:
        cls = type("SD3PatchEmbed", (CroppingPatchEmbed, base), {"__module__": __name__})
        globals()["SD3PatchEmbed"] = cls
    return cls


def install(transformer: nn.Module, random_crop_rate: float = 0.0, resolutions: Iterable | None = None) -> None:
    """Give ``transformer.pos_embed`` sd-scripts' options (module docstring): ``random_crop_rate`` in [0, 1];
    ``resolutions`` (training resolutions, (w, h) or int): build the scaled tables, None: the released table."""
    if not 0.0 <= random_crop_rate <= 1.0:
        raise ValueError(f"--pos_emb_random_crop_rate {random_crop_rate}: must be in [0, 1]")
    embed = transformer.pos_embed
    if getattr(embed, "pos_embed_max_size", None) is None:
        raise ValueError("this SD3 transformer has no pos_embed_max_size: its positional embedding cannot be cropped")
    if not isinstance(embed, CroppingPatchEmbed):
        embed.__class__ = _patch_class(type(embed))
    embed.random_crop_rate = float(random_crop_rate)
    embed.scaled, embed.area_bounds = None, []
    if resolutions is None:
        return
    patched = [s // embed.patch_size for s in latent_sizes(resolutions)]
    if not patched:
        raise ValueError("--enable_scaled_pos_embed needs the training resolutions; none were given")
    bounds = [((a * a + b * b) // 2, a) for a, b in zip(patched, patched[1:])]
    bounds.append((int((patched[-1] * MAX_RATIO) ** 2), patched[-1]))
    dim = embed.pos_embed.shape[-1]
    embed.scaled = {n: scaled_sincos_2d(dim, int(n * MAX_RATIO), n) for n in patched}
    embed.area_bounds = bounds
