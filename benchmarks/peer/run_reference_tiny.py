#!/usr/bin/env python3
"""Run an unmodified reference trainer (sd-scripts) on the tiny files of benchmarks/peer/tiny_families.py.

    cd <sd-scripts> && PYTHONPATH=<peer kit>/helpers/sds_shims <venv>/bin/python run_reference_tiny.py \\
        anima_train_network.py --pretrained_model_name_or_path OUT/tiny-anima/tiny_dit.safetensors ...

The reference builds these models from hard-coded released configs; the tiny_config.json beside the model file holds
the tiny widths in the reference's own constructor arguments, and this wrapper puts them in place, asserting that the
code it replaces is still there:

  anima  ``anima_models.Anima.__init__``'s released widths (its loader passes a fixed ``dit_config``) and the
         literal ``LLMAdapter(source_dim=1024, ...)`` it builds, ``transformers.Qwen3Config.from_pretrained`` (the
         loader reads ``configs/qwen3_06b`` for a single file) and the Qwen-Image VAE's literal config
         (``qwen_image_autoencoder_kl``'s ``json.loads``); the nearest resize its forward calls is added to the peer
         kit's torchvision stand-in.

  lumina ``LuminaParams.get_2b_config`` (the tiny transformer), ``lumina_util``'s Gemma2 config and the FLUX AE's
         widths and literal GroupNorm(32) group count.

Everything else (data, caching, LoRA, loop, saving) is the reference's own code, run as ``__main__``.
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
import sys
import types


def patch_anima(cfg: dict) -> None:
    import torch.nn.functional as F
    import torchvision.transforms as T  # the peer kit's stand-in
    import transformers

    from library import anima_models, anima_utils
    from library import qwen_image_autoencoder_kl as qvae

    class _Mode:
        NEAREST = "nearest"

    T.InterpolationMode = _Mode
    T.functional.resize = lambda x, size, interpolation=None: F.interpolate(x, size=list(size), mode="nearest")

    assert '"model_channels": 2048' in inspect.getsource(anima_utils.load_anima_model)
    init = anima_models.Anima.__init__

    def tiny_init(self, *args, **kwargs):
        init(self, *args, **dict(kwargs, **cfg["dit"]))

    anima_models.Anima.__init__ = tiny_init
    assert "LLMAdapter(" in inspect.getsource(init)
    adapter = anima_models.LLMAdapter

    class TinyAdapter(adapter):
        def __init__(self, *args, **kwargs):
            kwargs.update(cfg["adapter"])
            super().__init__(**kwargs)

    anima_models.LLMAdapter = TinyAdapter
    tiny_qwen3 = transformers.Qwen3Config(**cfg["qwen3"])
    transformers.Qwen3Config.from_pretrained = classmethod(lambda cls, *a, **k: tiny_qwen3)
    assert "json.loads" in inspect.getsource(qvae.load_vae)
    qvae.json = types.SimpleNamespace(loads=lambda s: dict(cfg["vae"]))


def patch_lumina(cfg: dict) -> None:
    import dataclasses

    import torch
    from transformers import Gemma2Config

    from library import flux_models, lumina_models, lumina_util

    t = cfg["transformer"]
    assert t["multiple_of"] == 256 and t["num_refiner_layers"] == 2  # what get_2b_config does not pass on
    tiny = lumina_models.LuminaParams(patch_size=t["patch_size"], in_channels=t["in_channels"], dim=t["hidden_size"],
                                      n_layers=t["num_layers"], n_heads=t["num_attention_heads"],
                                      n_kv_heads=t["num_kv_heads"], axes_dims=t["axes_dim_rope"],
                                      axes_lens=t["axes_lens"], qk_norm=True, cap_feat_dim=t["cap_feat_dim"])  # fmt: skip
    lumina_models.LuminaParams.get_2b_config = classmethod(lambda cls: tiny)
    assert "Gemma2Config(**GEMMA2_CONFIG)" in inspect.getsource(lumina_util.load_gemma2)
    lumina_util.Gemma2Config = lambda **kw: Gemma2Config(**dict(kw, **cfg["text_encoder"]))
    ae = cfg["ae"]
    for spec in flux_models.configs.values():
        spec.ae_params = dataclasses.replace(spec.ae_params, ch=ae["ch"], ch_mult=ae["ch_mult"],
                                             num_res_blocks=ae["num_res_blocks"], z_channels=ae["z_channels"])  # fmt: skip

    class GroupNorm(torch.nn.GroupNorm):  # the AE's literal num_groups=32
        def __init__(self, num_groups, num_channels, *a, **kw):
            super().__init__(ae["groups"], num_channels, *a, **kw)

    assert "nn.GroupNorm(num_groups=32" in inspect.getsource(flux_models.Encoder)
    nn = types.ModuleType("torch.nn")
    nn.__dict__.update(torch.nn.__dict__)
    nn.GroupNorm = GroupNorm
    flux_models.nn = nn


PATCHES = {"anima": patch_anima, "lumina": patch_lumina}


def main() -> None:
    script, argv = sys.argv[1], sys.argv[2:]
    model = argv[argv.index("--pretrained_model_name_or_path") + 1]
    sys.path.insert(0, os.getcwd())
    with open(os.path.join(os.path.dirname(model), "tiny_config.json")) as f:
        cfg = json.load(f)
    PATCHES[cfg["family"]](cfg)
    print(f"[run_reference_tiny] {cfg['family']}: the reference's released configs -> tiny_config.json", flush=True)
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
