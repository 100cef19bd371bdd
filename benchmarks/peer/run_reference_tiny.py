#!/usr/bin/env python3
"""Run an unmodified reference trainer (sd-scripts, musubi-tuner) on the tiny files of benchmarks/peer/tiny_families.py.

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

  chroma ``chroma_models.chroma_params`` (widths, depths, approximator sizes), the FLUX AE as for Lumina 2 and
         ``flux_utils``' T5 config.

  hunyuan_image  ``HYImageDiffusionTransformer`` / ``HunyuanVAE2D`` / ``load_byt5`` literals (the tiny module's
         ``SDSCRIPTS_*CONSTANTS``), the byT5 zeros' literal width, ``load_qwen2_5_vl``'s config and strict load (the
         file holds the language model only), the hub tokenizers (Qwen2.5-VL, byT5), and the in-memory text cache's
         NumPy-scalar ocr_mask, which sd-scripts' own collate cannot convert.

  stable_cascade  sd-scripts' ``stable-cascade`` branch: ``StageC``'s, the CLIP text model's and the EfficientNet
         encoder's released sizes (reference_cascade.py).

  wuerstchen  sd-scripts' ``wuerstchen`` branch: its hub downloads (the EfficientNet checkpoint and backbone; the
         decoder pipeline its save goes through) and ``--effnet_checkpoint_path``, which it lacks (reference_cascade.py).

musubi-tuner (``--dit`` / ``--vae`` / ``--text_encoder`` name the folder; run from ``src`` with it on PYTHONPATH):

  qwen_image, zimage, flux2  the transformer / AE sizes its loaders hard-code, the Qwen2.5-VL / Qwen3 configs and
         hub tokenizers (the shipped vocabularies beside the files), a stand-in for PyAV (video only).

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
    tiny_flux_ae(flux_models, cfg["ae"])


def tiny_flux_ae(flux_models, ae: dict) -> None:
    """sd-scripts' FLUX AE (``flux_models.configs[*].ae_params``, Lumina 2's and Chroma's too) at the widths of
    ``ae`` and its literal GroupNorm(32) at ``ae["groups"]`` groups."""
    import dataclasses

    import torch

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


def patch_chroma(cfg: dict) -> None:
    """Chroma (``flux_train_network.py --model_type chroma``): ``chroma_models.chroma_params`` (the released
    widths, depths and approximator sizes, which the loader passes unread from the file), the FLUX AE and T5's
    config; Chroma has no CLIP-L (sd-scripts builds a dummy)."""
    import dataclasses

    from transformers import T5Config

    from library import chroma_models, flux_models, flux_utils

    assert "chroma_models.Chroma(chroma_models.chroma_params)" in inspect.getsource(flux_utils.load_flow_model)
    chroma_models.chroma_params = dataclasses.replace(chroma_models.chroma_params, **cfg["chroma_params"])
    assert "T5Config(**config)" in inspect.getsource(flux_utils.load_t5xxl)
    flux_utils.T5Config = lambda **kw: T5Config(**dict(kw, **cfg["t5xxl"]))
    tiny_flux_ae(flux_models, cfg["ae"])


def _replaced(func, replacements: dict, namespace: dict, where: str):
    """``func`` (a function or method) re-compiled from its source with each literal of ``replacements`` (each must
    occur exactly once) replaced, in ``namespace`` (its module's globals)."""
    import textwrap

    src = textwrap.dedent(inspect.getsource(func))
    for old, new in replacements.items():
        assert src.count(old) == 1, f"{where}: {old!r} is not in the reference's code"
        src = src.replace(old, new)
    src = src.replace("super().__init__()", "torch.nn.Module.__init__(self)")  # no __class__ cell outside a class
    ns: dict = {}
    exec(compile(src, f"{inspect.getsourcefile(func)} ({where}, tiny sizes)", "exec"), namespace, ns)
    return ns[func.__name__]


def tiny_qwen25vl(module, cfg: dict):
    """``module.load_qwen2_5_vl`` (sd-scripts' HunyuanImage and musubi-tuner's Qwen-Image loaders, the same code) on
    the tiny file: the Qwen2.5-VL text model at the tiny widths of ``cfg["qwen_text"]``, a one-block vision tower
    (never run: no images); the file holds the language model only, so the vision tower and the LM head (unused: the
    prompt is a hidden state) load as zeros. Returns the tokenizer class to put in place of ``Qwen2Tokenizer``: the
    shipped vocabulary file beside the model files (its tokenizer_config.json is transformers 5's)."""
    import torch
    import transformers

    text = dict(cfg["qwen_text"], layer_types=["full_attention"] * cfg["qwen_text"]["num_hidden_layers"])
    vision = cfg.get("vision") or dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                                       out_hidden_size=text["hidden_size"], fullatt_block_indexes=[0])  # fmt: skip

    def tiny_config(**kw):
        assert kw["hidden_size"] == 3584, "not the released Qwen2.5-VL-7B config"
        kw["vision_config"] = dict(kw["vision_config"], **vision)
        if "text_config" in kw:
            kw["text_config"] = dict(kw["text_config"], **text)
        return transformers.Qwen2_5_VLConfig(**dict(kw, **text))

    def load_language_model(model, sd, strict, assign):
        for key, value in model.state_dict().items():
            if key not in sd:
                assert key.startswith(("model.visual.", "lm_head.")), f"{key} is not in the tiny Qwen2.5-VL file"
                sd[key] = torch.zeros(value.shape, dtype=torch.bfloat16)
        return model.load_state_dict(sd, strict=strict, assign=assign)

    module.Qwen2_5_VLConfig = tiny_config
    module.load_language_model = load_language_model
    module.load_qwen2_5_vl = _replaced(module.load_qwen2_5_vl, {
        "qwen2_5_vl.load_state_dict(sd, strict=True, assign=True)":
        "load_language_model(qwen2_5_vl, sd, strict=True, assign=True)"}, module.__dict__, "Qwen2.5-VL")  # fmt: skip
    vocabulary = os.path.join(cfg["folder"], "qwen_tokenizer", "tokenizer.json")

    class QwenTokenizer:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            tok = transformers.Qwen2TokenizerFast(tokenizer_file=vocabulary)
            tok.pad_token, tok.padding_side = "<|endoftext|>", "right"
            return tok

    return QwenTokenizer


def patch_hunyuan_image(cfg: dict) -> None:
    from transformers import ByT5Tokenizer

    from library import hunyuan_image_models as hm
    from library import hunyuan_image_text_encoder as te
    from library import hunyuan_image_vae as hv
    from library import strategy_hunyuan_image as st

    hm.HYImageDiffusionTransformer.__init__ = _replaced(hm.HYImageDiffusionTransformer.__init__, cfg["dit"],
                                                        hm.__dict__, "DiT")  # fmt: skip
    hv.HunyuanVAE2D.__init__ = _replaced(hv.HunyuanVAE2D.__init__, cfg["vae"], hv.__dict__, "VAE")
    te.load_byt5 = _replaced(te.load_byt5, cfg["byt5"], te.__dict__, "byT5")
    te.get_byt5_prompt_embeds_from_tokens = _replaced(  # the zeros of a caption without quoted text
        te.get_byt5_prompt_embeds_from_tokens, {"byt5_max_length, 1472)": f"byt5_max_length, {cfg['byt5_width']})"},
        te.__dict__, "byT5 zeros")  # fmt: skip
    QwenTokenizer = tiny_qwen25vl(te, cfg)

    class Byt5Tokenizer:  # google/byt5-small is a hub id; transformers' ByT5Tokenizer needs no files
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return ByT5Tokenizer()

    assert te.QWEN_2_5_VL_IMAGE_ID == "Qwen/Qwen2.5-VL-7B-Instruct" and te.BYT5_TOKENIZER_PATH == "google/byt5-small"
    te.Qwen2Tokenizer = st.Qwen2Tokenizer = QwenTokenizer
    te.AutoTokenizer = st.AutoTokenizer = Byt5Tokenizer
    # sd-scripts' in-memory text-encoder cache keeps ocr_mask as a NumPy scalar, which its collate cannot convert
    # ("new(): data must be a sequence (got numpy.bool)"); keep it as the 0-d array its disk cache reads back
    import numpy as np

    caching = st.HunyuanImageTextEncoderOutputsCachingStrategy
    cache_batch = caching.cache_batch_outputs

    def cache_batch_outputs(self, tokenize_strategy, models, text_encoding_strategy, infos):
        cache_batch(self, tokenize_strategy, models, text_encoding_strategy, infos)
        for info in infos:
            if info.text_encoder_outputs is not None:
                info.text_encoder_outputs = tuple(np.asarray(x) for x in info.text_encoder_outputs)

    caching.cache_batch_outputs = cache_batch_outputs


def patch_qwen_image(cfg: dict) -> None:
    """musubi-tuner's Qwen-Image: ``create_model``'s literal transformer sizes, ``load_vae``'s literal base width, the
    Qwen2.5-VL loader (:func:`tiny_qwen25vl`); its video decoder (PyAV) is not installed and not used for images."""
    import transformers  # noqa: F401  (before the stand-in: transformers looks PyAV up by its module spec)

    sys.modules.setdefault("av", types.ModuleType("av"))
    from musubi_tuner.qwen_image import qwen_image_model as qm
    from musubi_tuner.qwen_image import qwen_image_utils as qu

    init = qm.QwenImageTransformer2DModel.__init__

    def tiny_init(self, *args, **kwargs):
        assert kwargs["attention_head_dim"] == 128 and kwargs["joint_attention_dim"] == 3584, "not the released sizes"
        init(self, *args, **dict(kwargs, **cfg["dit"]))

    qm.QwenImageTransformer2DModel.__init__ = tiny_init
    qu.load_vae = _replaced(qu.load_vae, {'"base_dim": 96': f'"base_dim": {cfg["vae_base_dim"]}'}, qu.__dict__, "VAE")
    assert qu.QWEN_IMAGE_ID == "Qwen/Qwen-Image"
    qu.Qwen2Tokenizer = tiny_qwen25vl(qu, cfg)
    if "processor" in cfg:  # an edit model (its file has the vision tower): the VL processor of Qwen-Image-Edit
        qu.load_vl_processor = lambda: tiny_vl_processor(cfg)


def tiny_vl_processor(cfg: dict):
    """Qwen/Qwen-Image-Edit's ``processor/`` (a hub id) -> transformers' ``Qwen2VLProcessor`` with Qwen2.5-VL's image
    settings (``cfg["processor"]``) and the shipped vocabulary; built around its image half (its video processor
    needs torchvision)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    tok = transformers.Qwen2TokenizerFast(tokenizer_file=os.path.join(cfg["folder"], "qwen_tokenizer", "tokenizer.json"),
                                          eos_token="<|im_end|>", pad_token="<|endoftext|>")  # fmt: skip
    proc = object.__new__(transformers.Qwen2VLProcessor)
    proc.image_processor, proc.tokenizer, proc.chat_template = Qwen2VLImageProcessor(**cfg["processor"]), tok, None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id, proc.video_token_id = tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"])
    return proc


def tiny_qwen3(zu, cfg: dict) -> None:
    """musubi-tuner's ``zimage_utils.load_qwen3`` (Z-Image's and FLUX.2 klein's text encoder): the Qwen3-4B config ->
    ``cfg["qwen3"]``'s sizes, its tokenizer (a hub id) -> the shipped Qwen3 vocabulary with Qwen3's chat template,
    as ours reads them."""
    import transformers

    def qwen3_config(**kw):
        assert kw["hidden_size"] == 2560, "not the released Qwen3-4B config"
        return transformers.Qwen3Config(**dict(kw, **cfg["qwen3"]))

    zu.Qwen3Config = qwen3_config
    folder = os.path.join(cfg["folder"], "qwen3_tokenizer")

    class Qwen3Tokenizer:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            tok = transformers.Qwen2TokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
            with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
                tok.chat_template = f.read()
            tok.pad_token = "<|endoftext|>"
            return tok

    zu.Qwen2Tokenizer = Qwen3Tokenizer


def _tiny_init(cls, sizes: dict, released: dict) -> None:
    """``cls(**kwargs)`` built with ``sizes`` in place of the released keyword arguments (asserted)."""
    init = cls.__init__

    def tiny_init(self, *args, **kwargs):
        assert all(kwargs.get(k) == v for k, v in released.items()), f"not the released {cls.__name__} sizes"
        init(self, *args, **dict(kwargs, **sizes))

    cls.__init__ = tiny_init


def patch_zimage(cfg: dict) -> None:
    """musubi-tuner's Z-Image: ``create_model``'s transformer sizes (zimage_config constants), the AE's literal
    widths and group count, ``load_qwen3``'s Qwen3-4B config and its tokenizer (a hub id): the shipped Qwen3
    vocabulary with Qwen3's chat template, as ours reads them."""
    import transformers  # noqa: F401  (before the PyAV stand-in: see patch_qwen_image)

    sys.modules.setdefault("av", types.ModuleType("av"))
    from musubi_tuner.zimage import zimage_autoencoder as za
    from musubi_tuner.zimage import zimage_model as zm
    from musubi_tuner.zimage import zimage_utils as zu

    _tiny_init(zm.ZImageTransformer2DModel, cfg["dit"], {"dim": 3840})
    _tiny_init(za.AutoencoderKL, cfg["ae"], {"block_out_channels": (128, 256, 512, 512)})
    assert zu.ZIMAGE_ID == "Tongyi-MAI/Z-Image"
    tiny_qwen3(zu, cfg)


def patch_flux2(cfg: dict) -> None:
    """musubi-tuner's FLUX.2 klein 4B: ``FLUX2_MODEL_INFO``'s ``Klein4BParams`` -> the tiny ``Flux2Params``, the AE's
    ``AutoEncoderParams()`` widths and literal GroupNorm(32) group count, ``load_qwen3`` (:func:`tiny_qwen3`)."""
    import dataclasses

    import torch
    import transformers  # noqa: F401  (before the PyAV stand-in: see patch_qwen_image)

    sys.modules.setdefault("av", types.ModuleType("av"))
    from musubi_tuner.flux_2 import flux2_models as fm
    from musubi_tuner.flux_2 import flux2_utils as fu
    from musubi_tuner.zimage import zimage_utils as zu

    for version in ("dev",) if "mistral3" in cfg else ("klein-4b", "klein-base-4b"):
        info = fu.FLUX2_MODEL_INFO[version]
        fu.FLUX2_MODEL_INFO[version] = dataclasses.replace(info, params=fm.Flux2Params(**cfg["dit"]))
    init = fm.AutoEncoder.__init__

    def tiny_ae(self, params):
        assert params.ch == 128, "not the released AE"
        init(self, dataclasses.replace(params, **cfg["ae"]))

    fm.AutoEncoder.__init__ = tiny_ae
    groups = cfg["groups"]

    class GroupNorm(torch.nn.GroupNorm):  # the AE's literal num_groups=32
        def __init__(self, num_groups, num_channels, *a, **kw):
            super().__init__(groups, num_channels, *a, **kw)

    assert "nn.GroupNorm(num_groups=32" in inspect.getsource(fm.ResnetBlock)
    nn = types.ModuleType("torch.nn")
    nn.__dict__.update(torch.nn.__dict__)
    nn.GroupNorm = GroupNorm
    fm.nn = nn
    assert fu.load_qwen3 is zu.load_qwen3
    tiny_qwen3(zu, cfg)
    if "mistral3" in cfg:
        tiny_mistral3(fu, cfg)


def tiny_mistral3(fu, cfg: dict) -> None:
    """FLUX.2 dev's ``Mistral3Embedder``: the released Mistral-Small-3.1 config -> ``cfg["mistral3"]``'s text and
    vision sizes, its processor (a hub id) -> the tokenizer folder beside the text encoder's folder."""
    import transformers

    def mistral3_config(**kw):
        assert kw["text_config"]["hidden_size"] == 5120, "not the released Mistral 3 config"
        kw["text_config"] = dict(kw["text_config"], **cfg["mistral3"]["text"])
        kw["vision_config"] = dict(kw["vision_config"], **cfg["mistral3"]["vision"])
        return transformers.Mistral3Config(**kw)

    folder = os.path.join(cfg["folder"], "tokenizer")

    class Mistral3Processor:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"),
                                                       unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                                       eos_token="</s>")  # fmt: skip
            with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
                tok.chat_template = f.read()
            return tok

    assert fu.M3_TOKENIZER_ID == "mistralai/Mistral-Small-3.1-24B-Instruct-2503"
    fu.Mistral3Config = mistral3_config
    fu.AutoProcessor = Mistral3Processor


def patch_stable_cascade(cfg: dict) -> None:
    from reference_cascade import patch_stable_cascade as patch  # this folder (beside this file)

    patch(cfg)


def patch_wuerstchen(cfg: dict) -> None:
    from reference_cascade import patch_wuerstchen as patch

    patch(cfg)


def wuerstchen_argv(cfg: dict, argv: list[str]) -> list[str]:
    from reference_cascade import wuerstchen_argv as fix

    return fix(cfg, argv)


PATCHES = {"anima": patch_anima, "lumina": patch_lumina, "chroma": patch_chroma, "hunyuan_image": patch_hunyuan_image,
           "qwen_image": patch_qwen_image, "zimage": patch_zimage, "flux2": patch_flux2,
           "stable_cascade": patch_stable_cascade, "wuerstchen": patch_wuerstchen}  # fmt: skip
ARGV = {"wuerstchen": wuerstchen_argv}  # a reference without a flag ours takes: its command line, changed
MODEL_FLAGS = (
    "--pretrained_model_name_or_path",
    "--dit",
    "--vae",
    "--text_encoder",
    "--stage_c_checkpoint_path",
    "--pretrained_prior_model_name_or_path",
)  # the first given names the folder


def main() -> None:
    script, argv = sys.argv[1], sys.argv[2:]
    model = argv[argv.index(next(f for f in MODEL_FLAGS if f in argv)) + 1]
    sys.path.insert(0, os.getcwd())
    folder = os.path.dirname(os.path.abspath(model))
    if not os.path.exists(os.path.join(folder, "tiny_config.json")):  # a split file's own folder (FLUX.2 dev's TE)
        folder = os.path.dirname(folder)
    with open(os.path.join(folder, "tiny_config.json")) as f:
        cfg = json.load(f)
    cfg["folder"] = folder
    PATCHES[cfg["family"]](cfg)
    argv = ARGV.get(cfg["family"], lambda cfg, argv: argv)(cfg, argv)
    print(f"[run_reference_tiny] {cfg['family']}: the reference's released configs -> tiny_config.json", flush=True)
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
