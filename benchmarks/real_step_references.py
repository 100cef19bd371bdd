"""The reference trainers' side of benchmarks/real_step.py (``ref_<family>``; see real_step_sides.py): run in the
reference's venv, sd-scripts with cwd = its checkout (or a branch's tree), musubi-tuner with its ``src`` on PYTHONPATH,
OneTrainer with cwd = its checkout; each builds the reference's own model class with the reference's own network
module."""

from __future__ import annotations

import dataclasses
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
    _no_empty_weights,  # fmt: skip
    _randn,
    _whole,
)


def _sds_network(module_name: str, model, encoders: int = 1) -> tuple[list, list[str]]:
    """sd-scripts' ``create_network`` + ``apply_to`` as train_network.py calls them (the denoiser only: the text
    encoders are empty modules)."""
    import importlib

    import torch

    sys.path.insert(0, ".")
    network_module = importlib.import_module(module_name)
    encoders = [torch.nn.Module() for _ in range(encoders)]
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
    ids, ones = torch.randint(0, 32128, (1, text), generator=_gen()), torch.ones(1, text, dtype=torch.long)
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


def _ref_flux2(version: str, released_sizes: tuple[int, int, int], blocks, res: int, text: int, text_width: int):
    """musubi-tuner's ``Flux2`` of ``version`` (checked to be the released width, double and single depths) with
    ``blocks`` kept, ``--sdpa``, its ``lora_flux_2`` and its training call (guidance 1.0, flux_2_train_network.py's
    value) on ``text`` tokens of ``text_width``."""
    import torch

    _musubi_imports()
    from musubi_tuner.flux_2 import flux2_models as fm
    from musubi_tuner.flux_2 import flux2_utils as fu

    released = fu.FLUX2_MODEL_INFO[version].params
    assert (released.hidden_size, released.depth, released.depth_single_blocks) == released_sizes
    cut = dataclasses.replace(released, depth=blocks[0], depth_single_blocks=blocks[1])
    model = _frozen(fm.Flux2(cut, attn_mode="torch"))  # --sdpa
    params, n = _musubi_network("lora_flux_2", model)
    lat = res // 16
    x, ids = fu.prc_img(_randn(1, 128, lat, lat))
    ctx, ctx_ids = fu.prc_txt(_randn(1, text, text_width))

    def forward():
        return model(x=x, x_ids=ids, timesteps=torch.tensor([0.5]), ctx=ctx, ctx_ids=ctx_ids,
                     guidance=torch.ones(1))  # fmt: skip

    return forward, params, n


def ref_flux2(blocks, res):
    return _ref_flux2("klein-base-4b", (3072, 5, 20), blocks, res, TEXT["flux2"], 7680)


def ref_flux2_dev(blocks, res):
    return _ref_flux2("dev", (6144, 8, 48), blocks, res, TEXT["flux2_dev"], 15360)


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


def ref_chroma(blocks, res):
    import torch

    sys.path.insert(0, ".")
    from library import chroma_models, flux_utils

    released = chroma_models.chroma_params
    assert released.hidden_size == 3072 and released.depth == 19 and released.depth_single_blocks == 38
    cut = dataclasses.replace(released, depth=blocks[0], depth_single_blocks=blocks[1])
    model = _frozen(chroma_models.Chroma(cut))
    params, n = _sds_network("networks.lora_flux", model)
    lat, text = res // 8, TEXT["chroma"]
    x = flux_utils.pack_latents(_randn(1, 16, lat, lat))
    ids, txt_ids = flux_utils.prepare_img_ids(1, lat // 2, lat // 2), torch.zeros(1, text, 3)
    t5, pooled = _randn(1, text, 4096), torch.zeros(1, 768)  # sd-scripts' dummy CLIP-L output for Chroma
    mask = (torch.arange(text) < CHROMA_CAPTION).long()[None]
    t, guidance = torch.tensor([0.5]), torch.zeros(1)  # --guidance_scale 0 (sd-scripts' Chroma docs)

    def forward():
        with torch.no_grad():  # flux_train_network.py: the modulation vectors outside the graph
            mod = model.get_mod_vectors(timesteps=t, guidance=guidance, batch_size=1)
        out = model(img=x, img_ids=ids, txt=t5, txt_ids=txt_ids, y=pooled, timesteps=t, guidance=guidance,
                    txt_attention_mask=mask, mod_vectors=mod)  # fmt: skip
        return flux_utils.unpack_latents(out, lat // 2, lat // 2)

    return forward, params, n


def ref_qwen_image_edit(blocks, res):
    import torch

    _musubi_imports()
    from musubi_tuner.qwen_image import qwen_image_model as qm
    from musubi_tuner.qwen_image import qwen_image_utils as qu

    _no_empty_weights(qm)
    model = _frozen(qm.create_model("torch", False, False, False, False, None, num_layers=blocks[0]))
    params, n = _musubi_network("lora_qwen_image", model)
    lat, text = res // 8, TEXT["qwen_image_edit"]
    target, control = qu.pack_latents(_randn(1, 16, 1, lat, lat)), qu.pack_latents(_randn(1, 16, 1, lat, lat))
    # call_dit: the control image's tokens after the target's
    x, states = torch.cat([target, control], dim=1), _randn(1, text, 3584)
    shapes = [[(1, lat // 2, lat // 2), (1, lat // 2, lat // 2)]]

    def forward():
        out = model(hidden_states=x, timestep=torch.tensor([0.5]), guidance=None, encoder_hidden_states_mask=None,
                    encoder_hidden_states=states, img_shapes=shapes, txt_seq_lens=[text], additional_t_cond=None)  # fmt: skip
        return out[:, : target.shape[1]]

    return forward, params, n


def _ref_sd(v2: bool, res: int):
    """sd-scripts' own SD1 / SD2 UNet (library/original_unet.py) at the config its checkpoint loader makes
    (``model_util.create_unet_diffusers_config``; SD2 with linear projections, as train_network.py loads it),
    ``--sdpa``, ``networks.lora`` and train_network.py's ``call_unet``."""
    import torch

    sys.path.insert(0, ".")
    from library import model_util, original_unet

    model = _frozen(original_unet.UNet2DConditionModel(**model_util.create_unet_diffusers_config(v2, True)))
    model.set_use_sdpa(True)  # --sdpa
    params, n = _sds_network("networks.lora", model)
    lat, states = res // 8, _randn(1, TEXT["sd2" if v2 else "sd1"], 1024 if v2 else 768)
    x = _randn(1, 4, lat, lat)

    def forward():
        return model(x, torch.tensor([500]), states).sample

    return forward, params, n


def ref_sd1(blocks, res):
    return _ref_sd(False, res)


def ref_sd2(blocks, res):
    return _ref_sd(True, res)


def ref_sdxl(blocks, res):
    import torch

    sys.path.insert(0, ".")
    from library import sdxl_original_unet, sdxl_train_util

    model = _frozen(sdxl_original_unet.SdxlUNet2DConditionModel())
    model.set_use_sdpa(True)  # --sdpa
    params, n = _sds_network("networks.lora", model, encoders=2)
    lat, text = res // 8, TEXT["sdxl"]
    x, states, pool2 = _randn(1, 4, lat, lat), _randn(1, text, 2048), _randn(1, 1280)
    size = torch.tensor([[res, res]])

    def forward():  # sdxl_train_network.py call_unet: the size embeddings every step
        embs = sdxl_train_util.get_size_embeddings(size, torch.zeros(1, 2, dtype=torch.long), size, "cpu")
        return model(x, torch.tensor([500]), states, torch.cat([pool2, embs], dim=1))

    return forward, params, n


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


def _ref_pixart(variant: str, blocks, res: int):
    """OneTrainer (cwd = its checkout): diffusers' ``PixArtTransformer2DModel`` at the released 1024 config of
    ``variant`` (what its loader reads from the pipeline folder), the attention backend its setup sets (``SDP``: "native"), in train
    mode (its LoRA setup's ``transformer.train()``), its ``LoRAModuleWrapper`` as ``PixArtAlphaLoRASetup`` builds it
    for the ``KOHYA_LORA`` output (the ``transformer_block`` filter, ``attn.qkv`` / ``cross_attn.kv_linear`` fused)
    and the call of ``BasePixArtAlphaSetup.predict``: the float mask, the timestep, the micro-conditions (which Σ's
    transformer ignores).
    ``names``: the kohya names its KOHYA_LORA saver writes."""
    import torch

    sys.path.insert(0, ".")
    from diffusers import PixArtTransformer2DModel
    from modules.model.PixArtAlphaModel import PixArtAlphaModel
    from modules.modelSaver.pixartAlpha.PixArtAlphaLoRASaver import PixArtAlphaLoRASaver
    from modules.modelSetup.BaseModelSetup import BaseModelSetup
    from modules.module.LoRAModule import LoRAModuleWrapper
    from modules.util.config.TrainConfig import TrainConfig
    from modules.util.enum.ModelType import ModelType

    config = TrainConfig.default_values()
    config.from_dict({"training_method": "LORA", "model_type": variant.upper(), "lora_rank": 4, "lora_alpha": 2.0,
                      "layer_filter_preset": "blocks", "layer_filter": "transformer_block",
                      "output_model_format": "KOHYA_LORA", "train_dtype": "FLOAT_32"}, migrate=False)  # fmt: skip
    model = PixArtAlphaModel(ModelType[variant.upper()])
    model.transformer = _frozen(PixArtTransformer2DModel(**dict(PIXART[variant], num_layers=blocks[0])))
    BaseModelSetup._set_attention_backend(model.transformer, config.attention_mechanism, mask=True)
    model.transformer_lora = LoRAModuleWrapper(
        model.transformer, "transformer", config, config.layer_filter.split(","), fusion_spec=model.fusion_groups(),
        fuse=config.output_model_format.needs_qkv_fusion())  # fmt: skip
    model.transformer_lora.to(dtype=torch.float32)
    model.transformer_lora.hook_to_module()
    model.transformer_lora.requires_grad_(True)
    model.transformer.train()
    saver = PixArtAlphaLoRASaver()
    keys = saver._convert_kohya(model, saver._get_state_dict(model))
    names = sorted({k.split(".")[0] for k in keys})
    params = [p for p in model.transformer_lora.parameters() if p.requires_grad]
    lat, n = res // 8, TEXT[variant]
    x, states = _randn(1, 4, lat, lat), _randn(1, n, 4096)
    mask = torch.zeros(1, n)
    mask[:, :PIXART_CAPTION] = 1
    resolution, aspect = torch.tensor([[float(res), float(res)]]), torch.tensor([[1.0]])

    def forward():
        return model.transformer(x, encoder_hidden_states=states, encoder_attention_mask=mask,
                                 timestep=torch.tensor([500]),
                                 added_cond_kwargs={"resolution": resolution, "aspect_ratio": aspect}).sample  # fmt: skip

    return forward, params, names


def ref_pixart_sigma(blocks, res):
    return _ref_pixart("pixart_sigma", blocks, res)


def ref_pixart_alpha(blocks, res):
    return _ref_pixart("pixart_alpha", blocks, res)
