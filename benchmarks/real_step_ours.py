"""Our side of benchmarks/real_step.py (``ours_<family>``; see real_step_sides.py): run in this checkout's venv,
each builds the model our family builds (``model.py``) with our network module (``networks.lora_<family>`` through
``networks.prepare_network``) and calls ``family.predict`` as our training step does."""

from __future__ import annotations

import sys

from real_step_sides import (
    BYT5_REAL,
    BYT5_ROWS,
    CHROMA_CAPTION,
    PIXART,
    PIXART_CAPTION,
    ROOT,
    TEXT,
    WUERSTCHEN_PRIOR,
    _frozen,
    _gen,
    _randn,
    _whole,
)


def _ours(name: str, script: str, denoiser, cond, x, network_module: str, t: float = 500.0, **predict_kwargs):
    """Our family's predict on ``denoiser`` at ``t`` (with ``predict_kwargs``) with our network module on the
    family's adapter roots (the text encoders stay on the meta device: no adapters on them)."""
    import importlib

    import torch

    sys.path.insert(0, str(ROOT))
    from library.families import get_family
    from networks import NetworkConfig, prepare_network

    family = get_family(name)
    parts = family.reference_parts()
    parts.denoiser = _frozen(denoiser)
    args = importlib.import_module(script).build_parser().parse_args(
        ["--network_module", network_module, "--network_dim", "4", "--network_alpha", "2",
         "--network_train_unet_only"])  # fmt: skip
    network = prepare_network(NetworkConfig.from_args(args), family.adapter_roots(parts), family.target_classes)
    t = torch.tensor([t])

    def forward():
        return family.predict(parts.denoiser, x, t, cond, **predict_kwargs)

    return forward, [p for p in network.parameters() if p.requires_grad], list(network.adapters.keys())


def ours_anima(blocks, res):
    import torch

    from library.families.anima import text
    from library.families.anima.model import build, released_config
    from library.families.base import Cond

    lat, n = res // 8, TEXT["anima"]
    ids, ones = torch.randint(0, 32128, (1, n), generator=_gen()), torch.ones(1, n, dtype=torch.long)
    cond = Cond(_randn(1, n, 1024), None, text.pack(ones, ids, ones))
    model = build(dict(released_config(), num_layers=blocks[0]))
    return _ours("anima", "anima_train_network", model, cond, _randn(1, 16, lat, lat), "networks.lora_anima")


def ours_lumina(blocks, res):
    import torch

    from library.families.base import Cond
    from library.families.lumina.model import released, transformer_factory

    lat, n = res // 8, TEXT["lumina"]
    model = transformer_factory(dict(released()["transformer"], num_layers=blocks[0]))()
    cond = Cond(_randn(1, n, 2304), None, torch.ones(1, n, dtype=torch.long))
    return _ours("lumina2", "lumina_train_network", model, cond, _randn(1, 16, lat, lat), "networks.lora_lumina")


def ours_hunyuan_image(blocks, res):
    import torch

    from library.families.base import Cond
    from library.families.hunyuan_image import model as M

    lat, n = res // 32, TEXT["hunyuan_image"]
    model = M.transformer_factory(dict(M.TRANSFORMER, num_layers=blocks[0], num_single_layers=blocks[1]))()
    byt5_mask = (torch.arange(BYT5_ROWS) < BYT5_REAL).long()[None]
    hidden, mask = M.pack(_randn(1, n, 3584), torch.ones(1, n, dtype=torch.long), _randn(1, BYT5_ROWS, 1472), byt5_mask)
    return _ours("hunyuan_image", "hunyuan_image_train_network", model, Cond(hidden, None, mask),
                 _randn(1, 64, lat, lat), "networks.lora_hunyuan_image")  # fmt: skip


def ours_qwen_image(blocks, res):
    from library.families.base import Cond
    from library.families.qwen_image import model as M

    lat = res // 8
    model = M.build(dict(M.RELEASED, num_layers=blocks[0]))
    cond = Cond(_randn(1, TEXT["qwen_image"], 3584), None, None)
    return _ours("qwen_image", "qwen_image_train_network", model, cond, _randn(1, 16, lat, lat),
                 "networks.lora_qwen_image")  # fmt: skip


def ours_zimage(blocks, res):
    from library.families.base import Cond
    from library.families.zimage import model as M

    lat = res // 8
    model = M.build(dict(M.RELEASED, n_layers=blocks[0]))
    cond = Cond(_randn(1, TEXT["zimage"], 2560), None, None)
    return _ours("zimage", "zimage_train_network", model, cond, _randn(1, 16, lat, lat), "networks.lora_zimage")


def ours_flux(blocks, res):
    from library.families.base import Cond
    from library.families.flux.configs import released, transformer_factory

    lat = res // 8
    config = dict(released("flux-dev")["transformer"], num_layers=blocks[0], num_single_layers=blocks[1])
    cond = Cond(_randn(1, TEXT["flux"], 4096), _randn(1, 768), None)
    return _ours("flux-dev", "flux_train_network", transformer_factory(config)(), cond, _randn(1, 16, lat, lat),
                 "networks.lora_flux")  # fmt: skip


def _ours_flux2(variant: str, blocks, res: int, text: int, text_width: int):
    from library.families.base import Cond
    from library.families.flux2 import model as M

    lat = res // 16
    model = M.build(dict(M.RELEASED[variant], num_layers=blocks[0], num_single_layers=blocks[1]))
    cond = Cond(_randn(1, text, text_width), None, None)
    return _ours("flux2", "flux_2_train_network", model, cond, _randn(1, 128, lat, lat), "networks.lora_flux_2")


def ours_flux2(blocks, res):
    return _ours_flux2("klein-4b", blocks, res, TEXT["flux2"], 7680)


def ours_flux2_dev(blocks, res):
    return _ours_flux2("dev", blocks, res, TEXT["flux2_dev"], 15360)


def ours_stable_cascade(blocks, res):
    """diffusers' ``StableCascadeUNet`` at the 3.6B config with the same blocks, in evaluation mode (our network
    trainer leaves the denoiser's mode alone), ``networks.lora`` and ``family.predict`` at ratio 0.5."""
    from library.families.base import Cond
    from library.families.stable_cascade.model import PRIOR, prior_factory

    lat = res // 32
    config = dict(PRIOR, down_num_layers_per_block=list(blocks), up_num_layers_per_block=list(blocks[::-1]))
    model = prior_factory(config)().eval()
    cond = Cond(_randn(1, TEXT["stable_cascade"], 1280), _randn(1, 1280), None)
    return _ours("stable_cascade", "stable_cascade_train_c_network", model, cond, _randn(1, 16, lat, lat),
                 "networks.lora", t=0.5)  # fmt: skip


def ours_wuerstchen(blocks, res):
    """Our family's prior (``wuerstchen.prior_class``, the released config: ``PRIOR``) trained whole, as
    wuerstchen_train.py, through ``family.predict`` at ratio 0.5."""
    import torch

    sys.path.insert(0, str(ROOT))
    from library.families.base import Cond
    from library.families.stable_cascade.wuerstchen import PRIOR, WUERSTCHEN, prior_class

    assert PRIOR == WUERSTCHEN_PRIOR
    model = prior_class()(**dict(PRIOR, depth=blocks[0]))
    params, names = _whole(model)
    lat = res // 32
    x, cond, t = _randn(1, 16, lat, lat), Cond(_randn(1, TEXT["wuerstchen"], 1280)), torch.tensor([0.5])
    return (lambda: WUERSTCHEN.predict(model, x, t, cond)), params, names


def ours_chroma(blocks, res):
    import torch

    from library.families.base import Cond
    from library.families.flux.configs import released, transformer_factory

    lat, n = res // 8, TEXT["chroma"]
    config = dict(released("chroma")["transformer"], num_layers=blocks[0], num_single_layers=blocks[1])
    cond = Cond(_randn(1, n, 4096), None, (torch.arange(n) < CHROMA_CAPTION).long()[None])
    return _ours("chroma", "flux_train_network", transformer_factory(config)(), cond, _randn(1, 16, lat, lat),
                 "networks.lora_flux")  # fmt: skip


def ours_qwen_image_edit(blocks, res):
    from library.families.base import Cond
    from library.families.qwen_image import model as M

    lat = res // 8
    model = M.build(dict(M.RELEASED, num_layers=blocks[0]))
    x, control = _randn(1, 16, lat, lat), _randn(1, 16, lat, lat)
    cond = Cond(_randn(1, TEXT["qwen_image_edit"], 3584), None, None)
    return _ours("qwen_image", "qwen_image_train_network", model, cond, x, "networks.lora_qwen_image",
                 references=[control])  # fmt: skip


def ours_sdxl(blocks, res):
    from diffusers import UNet2DConditionModel

    from library.families import get_family
    from library.families.base import Cond

    family = get_family("sdxl")
    model = UNet2DConditionModel.from_config(dict(family.reference_parts().denoiser.config))
    lat = res // 8
    cond = Cond(_randn(1, TEXT["sdxl"], 2048), _randn(1, 1280), None)
    time_ids = family.size_conditioning([[res, res]], [[0, 0]], [[res, res]])
    return _ours("sdxl", "train_network", model, cond, _randn(1, 4, lat, lat), "networks.lora",
                 time_ids=time_ids)  # fmt: skip


def _ours_sd(name: str, res: int):
    from diffusers import UNet2DConditionModel

    from library.families import get_family
    from library.families.base import Cond

    model = UNet2DConditionModel.from_config(dict(get_family(name).reference_parts().denoiser.config))
    cond = Cond(_randn(1, TEXT[name], 1024 if name == "sd2" else 768), None, None)
    lat = res // 8
    return _ours(name, "train_network", model, cond, _randn(1, 4, lat, lat), "networks.lora")


def ours_sd1(blocks, res):
    return _ours_sd("sd1", res)


def ours_sd2(blocks, res):
    return _ours_sd("sd2", res)


def _ours_pixart(variant: str, blocks, res: int):
    """Our family's transformer (``transformer_factory``) at its released 1024 config of ``variant`` (checked against
    the hub's, :data:`PIXART`), the same blocks, in evaluation mode (our network trainer leaves the denoiser's mode
    alone), ``networks.lora`` (every Linear of the blocks, ``attn.qkv`` / ``cross_attn.kv_linear`` fused) and
    ``family.predict`` with the variance half (the hybrid loss reads all 8 channels; α: the micro-conditions of the
    latents' size), the T5 states' mask of a 77-token caption in 120 rows."""
    import torch

    from library.families.base import Cond
    from library.families.pixart.model import released, transformer_factory

    lat, n = res // 8, TEXT[variant]
    config = dict(released(variant)["transformer"], num_layers=blocks[0])
    model = transformer_factory(config)().eval()
    same = {k: v for k, v in PIXART[variant].items() if k not in ("num_layers", "interpolation_scale")}
    assert {k: config[k] for k in same} == same and model.pos_embed.interpolation_scale == 2, "not the released config"
    states = _randn(1, n, 4096)
    mask = torch.zeros(1, n, dtype=torch.long)
    mask[:, :PIXART_CAPTION] = 1
    return _ours(variant, "pixart_train_network", model, Cond(states, None, mask), _randn(1, 4, lat, lat),
                 "networks.lora", with_variance=True)  # fmt: skip


def ours_pixart_sigma(blocks, res):
    return _ours_pixart("pixart_sigma", blocks, res)


def ours_pixart_alpha(blocks, res):
    return _ours_pixart("pixart_alpha", blocks, res)
