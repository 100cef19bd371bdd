"""run_reference_tiny.py's patches for sd-scripts' never-merged ``stable-cascade`` branch (Feb 2024), on the tiny files
of tiny_families.py's ``stable_cascade`` builder (the sizes in the tiny_config.json beside them).

The branch builds everything at the released sizes:

  ``sc.StageC()``  its constructor defaults (the 3.6B prior) -> ``cfg["stage_c"]``, the same keyword arguments;
  ``load_clip_text_model``  a literal ``CLIPTextConfig`` (CLIP-bigG) -> ``cfg["text_model"]``'s widths;
  ``sc.EfficientNetEncoder``  ``torchvision.models.efficientnet_v2_s(weights="DEFAULT").features`` (a download) and
      a literal 1280-wide mapper: torchvision is the peer kit's stand-in, which has no ``models``; the backbone is
      this checkout's plain-torch copy of torchvision's layout (``library/families/stable_cascade/effnet.py``, loaded
      from its file: sd-scripts' own ``library`` package shadows ours) at ``cfg["effnet"]``'s stages and head width.
      It only makes the cached latents (both sides cache them before the first step).

Every patch asserts that the code it replaces is still there; data, caching, LoRA, loop and saving are the branch's.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _effnet_module():
    """This checkout's ``effnet.py`` (only torch imports), under a name of its own."""
    path = ROOT / "library" / "families" / "stable_cascade" / "effnet.py"
    spec = importlib.util.spec_from_file_location("sdtrain_effnet", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def tiny_torchvision_effnet(stages: list, head: int) -> None:
    """``torchvision.models.efficientnet_v2_s`` on the peer kit's torchvision stand-in: the ``features`` of the given
    tiny stages (``effnet.Stage`` fields) and head width; ``weights`` is ignored (the file's weights are loaded)."""
    import torchvision  # the peer kit's stand-in

    effnet = _effnet_module()
    tiny = [effnet.Stage(*s) for s in stages]

    def efficientnet_v2_s(weights=None, **kwargs):
        return types.SimpleNamespace(features=effnet.backbone(tiny, head))

    models = types.ModuleType("torchvision.models")
    models.efficientnet_v2_s = efficientnet_v2_s
    torchvision.models = sys.modules["torchvision.models"] = models


def patch_stable_cascade(cfg: dict) -> None:
    from run_reference_tiny import _replaced
    from transformers import CLIPTextConfig

    from library import stable_cascade as sc
    from library import stable_cascade_utils as su

    assert "sc.StageC()" in inspect.getsource(su.load_stage_c_model)
    assert inspect.signature(sc.StageC.__init__).parameters["c_hidden"].default == [2048, 2048]
    init = sc.StageC.__init__

    def tiny_init(self, *args, **kwargs):
        init(self, *args, **dict(kwargs, **cfg["stage_c"]))

    sc.StageC.__init__ = tiny_init
    assert "CLIPTextConfig(" in inspect.getsource(su.load_clip_text_model)
    su.CLIPTextConfig = lambda **kw: CLIPTextConfig(**dict(kw, **cfg["text_model"]))
    head = cfg["effnet"]["head"]
    tiny_torchvision_effnet(cfg["effnet"]["stages"], head)
    sc.EfficientNetEncoder.__init__ = _replaced(sc.EfficientNetEncoder.__init__, {
        "nn.Conv2d(1280, c_latent": f"nn.Conv2d({head}, c_latent"}, sc.__dict__, "EfficientNet")  # fmt: skip


def patch_wuerstchen(cfg: dict) -> None:
    """sd-scripts' ``wuerstchen`` branch (``wuerstchen/wuerstchen_train.py``, full fine-tuning): it reads the prior,
    CLIP and tokenizer from the prior folder at their own sizes, and downloads the rest: ``hf_hub_download(
    "dome272/wuerstchen", "model_v2_stage_b.pt")`` -> the tiny file (its ``effnet_state_dict``), the EfficientNet
    backbone (``torchvision.models.efficientnet_v2_s``, :func:`tiny_torchvision_effnet`; its ``EfficientNetEncoder``
    keeps the 1280-wide head, which the tiny file has)."""
    import os

    import huggingface_hub

    tiny_torchvision_effnet(cfg["effnet"]["stages"], cfg["effnet"]["head"])
    import torchvision

    torchvision.models.efficientnet_v2_l = torchvision.models.efficientnet_v2_s  # imported beside it, unused
    download = os.path.join(cfg["folder"], cfg["effnet"]["file"])

    def hf_hub_download(repo_id, filename, **kwargs):
        assert (repo_id, filename) == ("dome272/wuerstchen", "model_v2_stage_b.pt"), (repo_id, filename)
        return download

    huggingface_hub.hf_hub_download = hf_hub_download


def wuerstchen_argv(cfg: dict, argv: list[str]) -> list[str]:
    """The branch has no ``--effnet_checkpoint_path`` (it downloads the encoder: :func:`patch_wuerstchen`) and no
    ``--save_model_as`` (it writes the diffusers prior folder in safetensors), so those flags of ours are dropped after
    checking that they name the downloaded file and that format; its final save goes through the decoder pipeline
    ``--pretrained_decoder_model_name_or_path`` names (a hub id by default): the tiny combined folder unless given."""
    import os

    argv = list(argv)
    if "--effnet_checkpoint_path" in argv:
        i = argv.index("--effnet_checkpoint_path")
        given = os.path.abspath(argv[i + 1])
        assert given == os.path.join(cfg["folder"], cfg["effnet"]["file"]), f"{given}: not the tiny EfficientNet file"
        del argv[i : i + 2]
    if "--save_model_as" in argv:  # the branch always writes the prior pipeline folder in safetensors
        i = argv.index("--save_model_as")
        assert argv[i + 1] == "diffusers_safetensors", f"--save_model_as {argv[i + 1]}: the branch writes a folder"
        del argv[i : i + 2]
    if "--pretrained_decoder_model_name_or_path" not in argv:
        argv += ["--pretrained_decoder_model_name_or_path", os.path.join(cfg["folder"], cfg["decoder"])]
    return argv
