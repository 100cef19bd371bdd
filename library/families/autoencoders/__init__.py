"""Autoencoders several families share: ``kl`` (pixels <-> scaled latents with any diffusers ``AutoencoderKL``, the
float16 upcast) and ``flux_ae`` (the 16-channel AE of FLUX.1, which SD3 / SD3.5 use too with their own scale and
shift: loading its single files, ``(z - shift) · scale`` latents)."""
