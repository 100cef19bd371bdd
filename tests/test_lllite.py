"""ControlNet-LLLite (networks/lllite.py): a fresh network leaves the UNet exactly as it was, the modules and file
keys are sd-scripts', and each module's forward equals sd-scripts' own ``LLLiteModule`` on the same weights (run in
sd-scripts' venv when the peer kit is set up, ~/sdtrain-peer; skipped otherwise)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.families.registry import FAMILIES
from networks.lllite import LLLiteNetwork, LLLiteWeights, depth_of, find_targets, unet_root

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(os.environ.get("PEER_WORK", "~/sdtrain-peer")).expanduser()
SDS_PYTHON = PEER / "sdsvenv" / "bin" / "python"
SDS_SRC = PEER / "sd-scripts"


@pytest.fixture
def tiny(tiny_parts):
    return copy.deepcopy(tiny_parts["sdxl"])


def _unet_call(parts, image_px: int = 64):
    g = torch.Generator().manual_seed(1)
    unet = parts.denoiser
    lat = torch.randn(2, 4, image_px // 8, image_px // 8, generator=g)
    ctx = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    text = torch.randn(
        2, unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim, generator=g
    )
    ids = torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)
    with torch.no_grad():
        return unet(lat, torch.tensor([10, 500]), ctx, added_cond_kwargs={"text_embeds": text, "time_ids": ids}).sample


def test_fresh_network_leaves_the_unet_output_unchanged_and_ejects_cleanly(tiny):
    family = FAMILIES["sdxl"]
    before = _unet_call(tiny)
    net = LLLiteNetwork(unet_root(family.adapter_roots(tiny)), cond_emb_dim=8, mlp_dim=4)
    image = torch.rand(2, 3, 64, 64) * 2 - 1
    net.set_cond_image(image)
    assert torch.equal(_unet_call(tiny), before)  # zero-initialised up: exact
    with torch.no_grad():
        for w in net.weights.values():
            w.up[0].weight.normal_(0, 0.5)
        net.set_cond_image(image)
    changed = _unet_call(tiny)
    assert not torch.allclose(changed, before, atol=1e-4)
    net.set_multiplier(0.0)
    assert torch.equal(_unet_call(tiny), before)  # multiplier 0 is no LLLite
    net.set_multiplier(1.0)
    net.after_step()  # a training step's images end with it: a sample without --cn after a step is the plain UNet
    assert torch.equal(_unet_call(tiny), before)  # no image: off
    net.eject()
    assert not any("lllite" in n for n, _ in tiny.denoiser.named_modules())
    # sd-scripts' selection on the tiny UNet: attn1 q/k/v + attn2 q of input blocks 4, 5, 7, 8 and the middle block
    names = {t.name for t in find_targets(unet_root(family.adapter_roots(tiny)))}
    assert "lllite_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k" in names
    assert "lllite_unet_middle_block_1_transformer_blocks_1_attn2_to_q" in names
    assert not any("output_blocks" in n or "attn2_to_k" in n or "to_out" in n for n in names)
    assert {depth_of("input_blocks.2.1.x"), depth_of("input_blocks.5.1.x"), depth_of("middle_block.1.x")} == {1, 2, 3}


def _cases() -> list[dict]:
    return [
        {"name": f"d{d}", "depth": d, "in_dim": 12, "out_dim": 10, "cond_emb_dim": 8, "mlp_dim": 6, "multiplier": m}
        for d, m in ((1, 1.0), (2, 0.7), (3, 1.0))
    ]


@pytest.mark.skipif(not (SDS_PYTHON.exists() and SDS_SRC.is_dir()), reason="sd-scripts' peer venv not set up")
def test_modules_keys_and_forward_equal_sd_scripts(tmp_path):
    """sd-scripts builds its LLLite on its full-size SDXL UNet (meta device): the same module names, keys and shapes
    as ours on the released SDXL layout; its LLLiteModule loads our tensors strictly and computes our output."""
    from networks.lllite import LLLiteLayer

    cases, tensors, ours = _cases(), {}, {}
    for c in cases:
        torch.manual_seed(c["depth"])
        base = torch.nn.Linear(c["in_dim"], c["out_dim"])
        w = LLLiteWeights(c["in_dim"], c["depth"], c["cond_emb_dim"], c["mlp_dim"])
        with torch.no_grad():
            for p in w.parameters():
                p.normal_(0, 0.3)  # up too: a zero up would hide the whole branch
        layer = LLLiteLayer(base, w)
        layer.multiplier = c["multiplier"]
        side = 8 * 2 ** (c["depth"] - 1)  # tokens: 8 x 8 for every depth
        image, x = torch.rand(2, 3, 8 * side, 8 * side) * 2 - 1, torch.randn(2, 64, c["in_dim"])
        with torch.no_grad():
            layer.set_cond_image(image)
            ours[c["name"]] = layer(x)
        n = c["name"]
        tensors |= {f"{n}.{k}": t for k, t in w.state_dict().items()}
        tensors |= {f"{n}.base.weight": base.weight.detach(), f"{n}.base.bias": base.bias.detach()}
        tensors |= {f"{n}.x": x, f"{n}.image": image}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "weights.safetensors"))
    (tmp_path / "request.json").write_text(json.dumps({"cond_emb_dim": 32, "mlp_dim": 64, "cases": cases}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SDS_SRC}:{ROOT / 'benchmarks/peer/sds_shims'}"}
    script = ROOT / "benchmarks" / "peer" / "lllite_sdscripts_side.py"
    run = subprocess.run([str(SDS_PYTHON), str(script), str(tmp_path)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(str(tmp_path / "outputs.safetensors"))
    for name, out in ours.items():
        torch.testing.assert_close(out, theirs[name], rtol=1e-5, atol=1e-6)
    layout = json.loads((tmp_path / "sdscripts.json").read_text())["layout"]
    with torch.device("meta"):
        ref = FAMILIES["sdxl"].reference_parts()
        net = LLLiteNetwork(unet_root(FAMILIES["sdxl"].adapter_roots(ref)), cond_emb_dim=32, mlp_dim=64)
    mine = {name: {k: list(t.shape) for k, t in w.state_dict().items()} for name, w in net.weights.items()}
    assert len(mine) == len(layout) == 136 and mine == layout
