"""``--fp8_vl`` (the shared ``encoders/qwen25vl.store_fp8_as_sd_scripts``: sd-scripts' cast) and ``--text_encoder_cpu`` for
HunyuanImage 2.1: what is stored in float8 and what is kept, outputs against the bf16 path on a tiny Qwen2.5-VL, and
the docs' training line with both flags on the simulated device (the text encoders never on it); and the DiT's
``--fp8_scaled`` rule."""

from __future__ import annotations

import copy

import pytest
import torch
from _train_helpers import write_dataset_toml
from test_hunyuan_image import doc_command

import hunyuan_image_train_network
from library.families.base import stays_on_host
from library.families.encoders import qwen25vl
from library.families.hunyuan_image import HUNYUAN_IMAGE as FAMILY
from library.families.hunyuan_image import model as M
from library.families.hunyuan_image.options import HunyuanOptions
from library.measure.simulated_device import simulated_device

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return FAMILY.tiny.write_files(FAMILY.tiny.build(seed=0, blocks=4), tmp_path_factory.mktemp("hy_te"), "tiny")


@pytest.fixture(scope="module")
def dataset_toml(dataset, tmp_path_factory):
    return write_dataset_toml(dataset, tmp_path_factory.mktemp("toml") / "my_hunyuan_dataset_config.toml")


def deep_qwen() -> torch.nn.Module:
    """A 4-layer tiny Qwen2.5-VL (hidden_states[-3] passes through two layers) with weights large enough for float8
    rounding to matter, in bf16."""
    torch.manual_seed(0)
    model = qwen25vl.factory(dict(qwen25vl.TINY_TEXT, num_hidden_layers=4, max_window_layers=4))().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.to(torch.bfloat16)


def encode(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        states, _ = M.encode_qwen(model, ids, mask)
    return states[mask[:, M.DROP :].bool()].float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_vl_stores_what_sd_scripts_stores_and_stays_close_to_bf16():
    """Linear weights and biases and the RMS norm weights in float8, the embedding kept in bf16 (sd-scripts'
    load_qwen2_5_vl with dtype float8_e4m3fn); hidden_states[-3] equal, up to the norms' float32 products, to the
    bf16 model whose weights were rounded through float8, and within float8's precision of the bf16 outputs."""
    bf16 = deep_qwen()
    fp8 = copy.deepcopy(bf16)
    assert (
        qwen25vl.store_fp8_as_sd_scripts(fp8, torch.bfloat16) == 4 * 9 + 1
    )  # 7 Linears + 2 norms per layer, the final norm
    dtypes = {k: v.dtype for k, v in fp8.state_dict().items()}
    assert dtypes.pop("embed_tokens.weight") == torch.bfloat16
    assert set(dtypes.values()) == {FP8} and any(k.endswith("q_proj.bias") for k in dtypes)
    assert any(k.endswith("input_layernorm.weight") for k in dtypes) and "norm.weight" in dtypes
    rounded = copy.deepcopy(bf16)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if "embed" not in name:
                p.copy_(p.to(FP8).to(torch.bfloat16))
    ids, mask = M.tokenize_qwen(qwen25vl.load_tokenizer(), ["a red fox", 'a sign "open" on a door'], 16)
    out = encode(fp8, ids, mask)
    assert rel(out, encode(rounded, ids, mask)) < 0.02
    assert 0 < rel(out, encode(bf16, ids, mask)) < 0.2


def test_load_with_fp8_vl_and_text_encoder_cpu(files):
    options = HunyuanOptions(text_encoder=str(files["text_encoder"]), byt5=str(files["byt5"]), fp8_vl=True,
                             text_encoder_cpu=True)  # fmt: skip
    parts = FAMILY.load(files["dit"], vae=files["vae"], dtype=torch.bfloat16, options=options)
    qwen, byt5 = parts.text_encoders
    assert qwen.layers[0].mlp.down_proj.weight.dtype == FP8 and qwen.embed_tokens.weight.dtype == torch.bfloat16
    assert byt5.encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.bfloat16  # byT5 stays as it is
    assert stays_on_host(qwen) and stays_on_host(byt5) and not stays_on_host(parts.denoiser)


def test_text_encoder_cpu_keeps_the_encoders_off_the_device(files, dataset_toml, tmp_path):
    """The docs' line with --text_encoder_cpu --fp8_vl on the simulated device: nothing is on the device while the
    captions are encoded (the encoders would be: tests/test_simulated_device.py counts every part the run puts there),
    and the run trains and writes its LoRA. The simulated device runs non-strict here: encoding on the host during a
    device phase is the point."""
    with simulated_device(strict=False) as sim:
        result = hunyuan_image_train_network.run(
            [*doc_command(files, dataset_toml, tmp_path), "--text_encoder_cpu", "--fp8_vl"]
        )
    assert result.failed is None and result.steps == 2 and result.output.is_file()
    table = sim.phase_table()
    assert table["text caching"] == 0 < table["step"]


def test_fp8_scaled_stores_the_dit_blocks_as_sd_scripts():
    """The DiT's float8 rule (``fp8_skip``) is sd-scripts' FP8_OPTIMIZATION_TARGET_KEYS: every Linear of the double
    and single blocks (the modulations and the single blocks' proj_out, Tencent's linear2, included), nothing
    outside them (the top-level proj_out is skipped by its whole path, "proj_out$")."""
    from library.device.fp8 import store_in_fp8

    denoiser = FAMILY.tiny.build(seed=0, blocks=1).denoiser.to(torch.bfloat16)
    store_in_fp8(denoiser, torch.bfloat16, skip=FAMILY.fp8_skip, scaled=True)
    linears = {n: m.weight.dtype for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)}
    inside = {n: d for n, d in linears.items() if n.startswith(("transformer_blocks.", "single_transformer_blocks."))}
    assert set(inside.values()) == {FP8} and "single_transformer_blocks.0.proj_out" in inside
    assert "transformer_blocks.0.norm1.linear" in inside and "single_transformer_blocks.0.norm.linear" in inside
    assert {d for n, d in linears.items() if n not in inside} == {torch.bfloat16} and "proj_out" in linears


def test_fp8_base_beside_fp8_scaled_stores_the_dit_only_as_sd_scripts():
    """sd-scripts' HunyuanImage trainer ignores --fp8_base beside --fp8_scaled (it sets the flag False): the run
    layer's --fp8_base stores the DiT by --fp8_scaled's rule and leaves both text encoders in bf16 (Qwen2.5-VL's
    float8 is --fp8_vl's)."""
    from types import SimpleNamespace

    from library.run.setup import store_frozen_in_fp8

    parts = FAMILY.tiny.build(seed=0, blocks=1)
    parts.denoiser.to(torch.bfloat16)
    for te in parts.text_encoders:
        te.to(torch.bfloat16)
    run = SimpleNamespace(fp8_base=True, fp8_base_unet=False, fp8_scaled=True, train_dtype=torch.float32,
                          weight_dtype=torch.bfloat16)  # fmt: skip
    cfg = SimpleNamespace(run=run, trained_parts=set(), family=FAMILY)
    assert store_frozen_in_fp8(cfg, parts) == [FAMILY.denoiser_name]
    assert FP8 in {p.dtype for p in parts.denoiser.parameters()}
    assert {p.dtype for te in parts.text_encoders for p in te.parameters()} == {torch.bfloat16}
