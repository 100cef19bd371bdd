"""Inputs for a tiny diffusers FluxTransformer2DModel (width 32, 4x4 packed latents, 5 text tokens) and one
forward on them: the shared probe of the FLUX adapter tests."""

from __future__ import annotations

import torch


def flux_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(2, 16, 64, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g),
        timestep=torch.tensor([0.3, 0.7]),
        img_ids=torch.randint(0, 4, (16, 3), generator=g).float(),
        txt_ids=torch.zeros(5, 3),
        guidance=torch.tensor([3.5, 3.5]),
    )


def run_flux(model) -> torch.Tensor:
    """The transformer's output on :func:`flux_inputs`, without autograd."""
    with torch.no_grad():
        return model(**flux_inputs(), return_dict=False)[0]
