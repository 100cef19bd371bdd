"""The two sides of benchmarks/real_step.py: each family's denoiser at its released width with fewer blocks, random
weights, a LoRA of dim 4 / alpha 2 on the side's default targets, and the call its trainer makes on cached text.

``reference(family, blocks, res)`` runs in the reference's venv (sd-scripts: cwd = the checkout; musubi-tuner: its
``src`` on PYTHONPATH) and builds the reference's own model class with the reference's own network module;
``ours(family, blocks, res)`` runs in this checkout's venv and builds the model our family builds (``model.py``)
with our network module (``networks.lora_<family>`` through ``networks.prepare_network``), calling
``family.predict`` as our training step does. Both return ``(forward, params, names)``: ``forward()`` the prediction
on fixed random inputs of the shapes below, ``params`` the adapter parameters to train, ``names`` the adapted modules' kohya
names (``lora_unet_...``). Only ``blocks`` changes the released architecture (:data:`DEPTHS`); everything is float32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the blocks kept of the released model (the rest of it as released): double / single, main / refiner, ...
DEPTHS = {
    "anima": "4 of 28 blocks (width 2048, 16 heads, MLP 4x); LLM adapter 6 layers as released",
    "lumina": "2 of 26 main layers (width 2304, 24 heads / 8 KV heads); 2 + 2 refiner layers as released",
    "hunyuan_image": "1 of 20 double + 1 of 40 single blocks (width 3584, 28 heads, MLP 4x); 2 refiner layers",
    "qwen_image": "2 of 60 dual-stream blocks (width 3072, 24 heads, MLP 4x)",
    "zimage": "2 of 30 main layers (width 3840, 30 heads); 2 + 2 refiner layers as released",
    "flux": "FLUX.1-dev: 1 of 19 double + 2 of 38 single blocks (width 3072, 24 heads, MLP 4x)",
    "flux2": "FLUX.2 klein 4B: 1 of 5 double + 2 of 20 single blocks (width 3072, 24 heads, MLP 3x)",
    "stable_cascade": "stage C 3.6B: 1 of 8 + 2 of 24 down, 2 of 24 + 1 of 8 up CTA blocks (width 2048, 32 heads)",
    "wuerstchen": "Würstchen 2 prior, full fine-tune: 2 of 32 blocks (width 1536, 24 heads, CLIP-bigG 1280)",
}
DEFAULT_BLOCKS = {"anima": (4,), "lumina": (2,), "hunyuan_image": (1, 1), "qwen_image": (2,), "zimage": (2,), "flux": (1, 2),
                  "flux2": (1, 2), "stable_cascade": (1, 2), "wuerstchen": (2,)}  # fmt: skip
# text tokens (all real, batch 1): the trainers' padded lengths where they pad (Anima: Qwen3 and T5 512; Lumina 2:
# Gemma 256; FLUX.1-dev: T5 512; FLUX.2: 512), a 77-token caption where they cut the text to the caption (HunyuanImage 2.1: Qwen plus
# 16 of byT5's 128 rows, Qwen-Image, Z-Image); Stable Cascade: CLIP-bigG's 77 (+ the pooled and image tokens)
TEXT = {"anima": 512, "lumina": 256, "hunyuan_image": 77, "qwen_image": 77, "zimage": 77, "flux": 512, "flux2": 512,
        "stable_cascade": 77, "wuerstchen": 77}  # fmt: skip
# warp-ai/wuerstchen-prior's prior/config.json (the wuerstchen branch reads it from the folder; no literal of its own)
WUERSTCHEN_PRIOR = dict(c_in=16, c=1536, c_cond=1280, c_r=64, depth=32, nhead=24, dropout=0.1)
BYT5_ROWS, BYT5_REAL = 128, 16


def _randn(*shape: int):
    import torch

    return torch.randn(*shape, generator=_GEN)


_GEN = None


def _seed() -> None:
    global _GEN
    import torch

    _GEN = torch.Generator().manual_seed(0)


def _no_empty_weights(module) -> None:
    """Build on the CPU where the reference's constructor builds under ``init_empty_weights`` (no file loads here)."""
    module.init_empty_weights = contextlib.nullcontext


_MODELS: list = []


def _frozen(model):
    model.requires_grad_(False)
    _MODELS.append(model)
    return model


def last_model_params() -> list:
    """The parameters of the denoiser built last (before its adapters; all of them in a full fine-tune)."""
    return [p for p in _MODELS[-1].parameters() if not p.requires_grad] or list(_MODELS[-1].parameters())


# ----------------------------------------------------------------------------------------------- the references
def _sds_network(module_name: str, model) -> tuple[list, list[str]]:
    """sd-scripts' ``create_network`` + ``apply_to`` as train_network.py calls them (DiT only, no text encoders)."""
    import importlib

    import torch

    sys.path.insert(0, ".")
    network_module = importlib.import_module(module_name)
    encoders = [torch.nn.Module()]
    network = network_module.create_network(1.0, 4, 2, None, encoders, model)
    network.apply_to(encoders, model, apply_text_encoder=False, apply_unet=True)
    return [p for p in network.parameters() if p.requires_grad], [lora.lora_name for lora in network.unet_loras]


def _musubi_network(module_name: str, model) -> tuple[list, list[str]]:
    """musubi-tuner's ``create_arch_network`` + ``apply_to`` as its trainer_base calls them."""
    import importlib

    network_module = importlib.import_module(f"musubi_tuner.networks.{module_name}")
    network = network_module.create_arch_network(1.0, 4, 2, None, None, model, neuron_dropout=None)
    network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    return [p for p in network.parameters() if p.requires_grad], [lora.lora_name for lora in network.unet_loras]


def _musubi_imports() -> None:
    import types

    import transformers  # noqa: F401  (before the PyAV stand-in, as benchmarks/peer/run_reference_tiny.py)

    sys.modules.setdefault("av", types.ModuleType("av"))


def ref_anima(blocks, res):
    import torch
    import torch.nn.functional as F
    import torchvision.transforms as T  # the peer kit's stand-in: add the nearest resize Anima's forward calls

    sys.path.insert(0, ".")
    from library import anima_models, anima_utils

    T.InterpolationMode = type("InterpolationMode", (), {"NEAREST": "nearest"})
    T.functional.resize = lambda x, size, interpolation=None: F.interpolate(x, size=list(size), mode="nearest")

    captured = {}

    class Capture(Exception):
        pass

    def capture(**kwargs):
        captured.update(kwargs)
        raise Capture

    original = anima_models.Anima
    anima_models.Anima = capture
    try:
        anima_utils.load_anima_model("cpu", "unused", "torch", False, "cpu", None)
    except Capture:
        pass
    finally:
        anima_models.Anima = original
    assert captured["model_channels"] == 2048 and captured["num_blocks"] == 28, "not the released Anima"
    model = _frozen(original(**dict(captured, num_blocks=blocks[0])))
    params, n = _sds_network("networks.lora_anima", model)
    lat, text = res // 8, TEXT["anima"]
    x, qwen = _randn(1, 16, 1, lat, lat), _randn(1, text, 1024)
    ids, ones = torch.randint(0, 32128, (1, text), generator=_GEN), torch.ones(1, text, dtype=torch.long)
    pad = torch.zeros(1, 1, lat, lat)

    def forward():
        return model(x, torch.tensor([0.5]), qwen, padding_mask=pad, target_input_ids=ids,
                     target_attention_mask=ones, source_attention_mask=ones).squeeze(2)  # fmt: skip

    return forward, params, n


def ref_lumina(blocks, res):
    import torch

    sys.path.insert(0, ".")
    from library import lumina_models

    params = dataclasses.replace(lumina_models.LuminaParams.get_2b_config(), n_layers=blocks[0])
    model = _frozen(lumina_models.NextDiT_2B_GQA_patch2_Adaln_Refiner(params))
    train, n = _sds_network("networks.lora_lumina", model)
    lat, text = res // 8, TEXT["lumina"]
    x, cap, mask = _randn(1, 16, lat, lat), _randn(1, text, 2304), torch.ones(1, text, dtype=torch.int32)

    def forward():
        return model(x=x, t=1 - torch.tensor([500.0]) / 1000, cap_feats=cap, cap_mask=mask)

    return forward, train, n


def ref_hunyuan_image(blocks, res):
    import torch

    sys.path.insert(0, ".")
    sys.path.insert(0, str(ROOT / "benchmarks" / "peer"))
    from run_reference_tiny import _replaced

    from library import hunyuan_image_models as hm

    depths = {"mm_double_blocks_depth = 20": f"mm_double_blocks_depth = {blocks[0]}",
              "mm_single_blocks_depth = 40": f"mm_single_blocks_depth = {blocks[1]}"}  # fmt: skip
    hm.HYImageDiffusionTransformer.__init__ = _replaced(hm.HYImageDiffusionTransformer.__init__, depths, hm.__dict__,
                                                        "DiT depth")  # fmt: skip
    model = _frozen(hm.HYImageDiffusionTransformer(attn_mode="torch"))
    params, n = _sds_network("networks.lora_hunyuan_image", model)
    lat, text = res // 32, TEXT["hunyuan_image"]
    x, qwen, byt5 = _randn(1, 64, lat, lat), _randn(1, text, 3584), _randn(1, BYT5_ROWS, 1472)
    qwen_mask = torch.ones(1, text, dtype=torch.long)
    byt5_mask = (torch.arange(BYT5_ROWS) < BYT5_REAL).long()[None]

    def forward():
        return model(x, torch.tensor([500]), qwen, qwen_mask, byt5, byt5_mask)

    return forward, params, n


def ref_flux(blocks, res):
    import torch

    sys.path.insert(0, ".")
    from library import flux_models, flux_utils

    released = flux_models.configs["dev"].params
    assert released.hidden_size == 3072 and released.depth == 19 and released.depth_single_blocks == 38
    model = _frozen(flux_models.Flux(dataclasses.replace(released, depth=blocks[0], depth_single_blocks=blocks[1])))
    params, n = _sds_network("networks.lora_flux", model)
    lat, text = res // 8, TEXT["flux"]
    x = flux_utils.pack_latents(_randn(1, 16, lat, lat))
    ids, txt_ids = flux_utils.prepare_img_ids(1, lat // 2, lat // 2), torch.zeros(1, text, 3)
    t5, pooled = _randn(1, text, 4096), _randn(1, 768)

    def forward():
        out = model(img=x, img_ids=ids, txt=t5, txt_ids=txt_ids, y=pooled, timesteps=torch.tensor([0.5]),
                    guidance=torch.full((1,), 3.5), txt_attention_mask=None, mod_vectors=None)  # fmt: skip
        return flux_utils.unpack_latents(out, lat // 2, lat // 2)

    return forward, params, n


def ref_qwen_image(blocks, res):
    import torch

    _musubi_imports()
    from musubi_tuner.qwen_image import qwen_image_model as qm
    from musubi_tuner.qwen_image import qwen_image_utils as qu

    _no_empty_weights(qm)
    model = _frozen(qm.create_model("torch", False, False, False, False, None, num_layers=blocks[0]))
    params, n = _musubi_network("lora_qwen_image", model)
    lat, text = res // 8, TEXT["qwen_image"]
    x, states = qu.pack_latents(_randn(1, 16, 1, lat, lat)), _randn(1, text, 3584)

    def forward():
        out = model(hidden_states=x, timestep=torch.tensor([0.5]), guidance=None, encoder_hidden_states_mask=None,
                    encoder_hidden_states=states, img_shapes=[[(1, lat // 2, lat // 2)]], txt_seq_lens=[text],
                    additional_t_cond=None)  # fmt: skip
        return out

    return forward, params, n


def ref_zimage(blocks, res):
    import torch

    _musubi_imports()
    from musubi_tuner.zimage import zimage_model as zm

    _no_empty_weights(zm)
    init = zm.ZImageTransformer2DModel.__init__

    def cut(self, *args, **kwargs):
        assert kwargs["dim"] == 3840 and kwargs["n_layers"] == 30, "not the released Z-Image"
        init(self, *args, **dict(kwargs, n_layers=blocks[0]))

    zm.ZImageTransformer2DModel.__init__ = cut
    # fp32 attention (musubi-tuner's --use_32bit_attention; its default casts q, k, v to 16 bits for SDPA)
    model = _frozen(zm.create_model("torch", False, None, use_16bit_for_attention=False))
    params, n = _musubi_network("lora_zimage", model)
    lat, text = res // 8, TEXT["zimage"]
    x, states = _randn(1, 16, 1, lat, lat), _randn(1, text, 2560)

    def forward():
        return model(x=x, t=torch.tensor([0.5]), cap_feats=states, cap_mask=None)

    return forward, params, n


def ref_flux2(blocks, res):
    import torch

    _musubi_imports()
    from musubi_tuner.flux_2 import flux2_models as fm
    from musubi_tuner.flux_2 import flux2_utils as fu

    released = fu.FLUX2_MODEL_INFO["klein-base-4b"].params
    assert released.hidden_size == 3072 and released.depth == 5 and released.depth_single_blocks == 20
    cut = dataclasses.replace(released, depth=blocks[0], depth_single_blocks=blocks[1])
    model = _frozen(fm.Flux2(cut, attn_mode="torch"))  # --sdpa
    params, n = _musubi_network("lora_flux_2", model)
    lat, text = res // 16, TEXT["flux2"]
    x, ids = fu.prc_img(_randn(1, 128, lat, lat))
    ctx, ctx_ids = fu.prc_txt(_randn(1, text, 7680))

    def forward():
        return model(x=x, x_ids=ids, timesteps=torch.tensor([0.5]), ctx=ctx, ctx_ids=ctx_ids,
                     guidance=torch.ones(1))  # fmt: skip

    return forward, params, n


def ref_stable_cascade(blocks, res):
    """sd-scripts' stable-cascade branch (``--sdscripts`` that tree): its ``StageC`` (the 3.6B defaults, blocks cut),
    ``--sdpa``, evaluation mode (its trainer's ``stage_c.eval()`` without gradient checkpointing), its
    ``networks.lora`` (every Linear and 1x1 conv of a StageC) and the trainer's call: the noise condition ratio, the
    text states, the pooled output as one token, a zero 768-wide image embedding."""
    import inspect

    import torch

    sys.path.insert(0, ".")
    from library import stable_cascade as sc

    defaults = inspect.signature(sc.StageC.__init__).parameters
    assert defaults["c_hidden"].default == [2048, 2048] and defaults["blocks"].default == [[8, 24], [24, 8]]
    model = _frozen(sc.StageC(blocks=[list(blocks), list(blocks[::-1])]))
    model.set_use_xformers_or_sdpa(False, True)
    model.eval()
    params, n = _sds_network("networks.lora", model)
    lat, text = res // 32, TEXT["stable_cascade"]
    x, states, pooled, image = _randn(1, 16, lat, lat), _randn(1, text, 1280), _randn(1, 1, 1280), torch.zeros(1, 768)

    def forward():
        return model(x, torch.tensor([0.5]), clip_text=states, clip_text_pooled=pooled, clip_img=image)

    return forward, params, n


def _whole(model):
    """A full fine-tune's denoiser: in train mode (both trainers), every parameter trained, named by its state-dict
    key (``names``)."""
    _MODELS.append(model.train().requires_grad_(True))
    return list(model.parameters()), sorted(name for name, _ in model.named_parameters())


def ref_wuerstchen(blocks, res):
    """sd-scripts' wuerstchen branch (``wuerstchen/wuerstchen_train.py``): diffusers' ``WuerstchenPrior`` (the
    reference venv's diffusers) at the released config with ``blocks`` blocks, trained whole, its call
    ``prior(noisy_latents, timesteps, prompt_embeds)``."""
    import torch
    from diffusers.pipelines.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior

    model = WuerstchenPrior(**dict(WUERSTCHEN_PRIOR, depth=blocks[0]))
    params, names = _whole(model)
    lat = res // 32
    x, states = _randn(1, 16, lat, lat), _randn(1, TEXT["wuerstchen"], 1280)
    return (lambda: model(x, torch.tensor([0.5]), states)), params, names


# ----------------------------------------------------------------------------------------------- ours
def _ours(name: str, script: str, denoiser, cond, x, network_module: str, t: float = 500.0):
    """Our family's predict on ``denoiser`` with our network module on the family's adapter roots (the text
    encoders stay on the meta device: no adapters on them)."""
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
        return family.predict(parts.denoiser, x, t, cond)

    return forward, [p for p in network.parameters() if p.requires_grad], list(network.adapters.keys())


def ours_anima(blocks, res):
    import torch

    from library.families.anima import text
    from library.families.anima.model import build, released_config
    from library.families.base import Cond

    lat, n = res // 8, TEXT["anima"]
    ids, ones = torch.randint(0, 32128, (1, n), generator=_GEN), torch.ones(1, n, dtype=torch.long)
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


def ours_flux2(blocks, res):
    from library.families.base import Cond
    from library.families.flux2 import model as M

    lat = res // 16
    model = M.build(dict(M.RELEASED["klein-4b"], num_layers=blocks[0], num_single_layers=blocks[1]))
    cond = Cond(_randn(1, TEXT["flux2"], 7680), None, None)
    return _ours("flux2", "flux_2_train_network", model, cond, _randn(1, 128, lat, lat), "networks.lora_flux_2")


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


SIDES: dict[str, dict[str, Callable]] = {
    name: {"reference": globals()[f"ref_{name}"], "ours": globals()[f"ours_{name}"]} for name in DEPTHS
}


def build(family: str, side: str, blocks: tuple[int, ...], res: int):
    """``(forward, params, names)`` of ``side`` ("reference" / "ours") for ``family``."""
    _seed()
    return SIDES[family][side](blocks, res)
