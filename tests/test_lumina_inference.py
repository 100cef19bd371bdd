"""lumina_minimal_inference.py on tiny Lumina 2 files: sd-scripts' docs line (its stray quote removed, tiny sizes and
steps added) writes an image; a LoRA applied and the same LoRA merged give the same image, which differs from the
image without it; the interactive options reach the sampler. (The sampler equals sd-scripts'
``lumina_train_util.denoise`` with CFG truncation / renormalisation: benchmarks/lumina_vs_sdscripts.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _lumina_helpers import write_layouts
from _networks_helpers import make_config
from PIL import Image

import lumina_minimal_inference
from library.families.lumina import LUMINA2
from library.families.lumina.tiny import build_tiny_lumina
from networks.inject import prepare_network


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lumina_inf")
    parts = build_tiny_lumina(seed=0)
    files = write_layouts(parts, root)
    network = prepare_network(make_config(module="networks.lora_lumina", dim=4, alpha=4.0),
                              LUMINA2.adapter_roots(parts), LUMINA2.target_classes)  # fmt: skip
    torch.manual_seed(5)
    state = {k: torch.randn_like(v) * 0.3 if "lora_up" in k else v for k, v in network.state_dict_for_file().items()}
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, root / "lora.safetensors")
    files["lora"] = str(root / "lora.safetensors")
    return files


def doc_line(files, out, *extra) -> list[str]:
    return ["--pretrained_model_name_or_path", files["model"], "--gemma2_path", files["gemma2"], "--ae_path",
            files["ae"], "--output_dir", str(out), "--offload", "--seed", "1234", "--prompt", "Positive prompt",
            "--system_prompt", "You are an assistant designed to generate high-quality images based on user prompts.",
            "--negative_prompt", "negative prompt", "--image_width", "64", "--image_height", "64", "--steps", "4",
            "--dtype", "float", "--gemma2_dtype", "float", "--ae_dtype", "float", *extra]  # fmt: skip


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path), dtype=np.int16)


def test_docs_line_writes_an_image_and_a_merged_lora_equals_the_applied_one(files, tmp_path):
    (plain,) = lumina_minimal_inference.run(doc_line(files, tmp_path / "plain"))
    assert Image.open(plain).size == (64, 64)
    (applied,) = lumina_minimal_inference.run(doc_line(files, tmp_path / "a", "--lora_weights", f"{files['lora']};0.8"))
    (merged,) = lumina_minimal_inference.run(doc_line(files, tmp_path / "m", "--lora_weights", f"{files['lora']};0.8",
                                                      "--merge_lora_weights"))  # fmt: skip
    assert np.abs(pixels(applied) - pixels(merged)).max() <= 1
    assert np.abs(pixels(applied) - pixels(plain)).max() > 8


def test_interactive_options_reach_the_sampler(files, tmp_path, monkeypatch):
    seen = []
    real = lumina_minimal_inference.lumina_latents

    def spy(family, parts, cond, uncond, request, shift, generator):
        seen.append(request)
        return real(family, parts, cond, uncond, request, shift, generator)

    monkeypatch.setattr(lumina_minimal_inference, "lumina_latents", spy)
    lines = iter(["a cube --w 32 --h 48 --s 2 --d 7 --g 2.5 --ctr 0.5 --rcfg 0 --n -", "", "exit"])
    monkeypatch.setattr("builtins.input", lambda: next(lines))
    written = lumina_minimal_inference.run(doc_line(files, tmp_path, "--interactive"))
    (request,) = seen
    assert len(written) == 1 and Image.open(written[0]).size == (32, 48)
    assert (request.prompt, request.steps, request.seed, request.scale) == ("a cube", 2, 7, 2.5)
    assert (request.cfg_trunc_ratio, request.renorm_cfg, request.negative_prompt) == (0.5, 0.0, "")


def test_sample_prompts_read_ctr_and_rcfg_and_negatives_skip_the_system_prompt():
    """A sample prompt's ``--ctr`` / ``--rcfg`` reach the spec; Lumina's samples encode the negative prompt without
    the system prompt (sd-scripts' ``tokenize(negative, is_negative=True)``), the prompt with it, in the doubled
    batch [negative; prompt]; cached conditionings are keyed the same way."""
    import copy

    from library.families.lumina.options import LuminaOptions
    from library.sampling.flow_generate import encode_flow_prompts, encode_prompt_texts, flow_texts
    from library.sampling.generate import resolve
    from library.sampling.prompts import parse_prompt_line

    spec = parse_prompt_line("a cube --n bad --l 3.5 --ctr 0.5 --rcfg 0")
    assert (spec.cfg_trunc_ratio, spec.renorm_cfg) == (0.5, 0.0)
    parts = copy.copy(build_tiny_lumina(seed=0))
    parts.options = LuminaOptions(system_prompt="Sys", gemma2_max_token_length=32)
    spec = resolve(spec, LUMINA2, parts)
    cond = encode_flow_prompts(LUMINA2, parts, [spec])
    negative = LUMINA2.encode_prompt(parts, ["bad"], negative=True)
    positive = LUMINA2.encode_prompt(parts, ["a cube"])
    assert torch.equal(cond.hidden_states, torch.cat([negative.hidden_states, positive.hidden_states]))
    assert not torch.equal(negative.hidden_states, LUMINA2.encode_prompt(parts, ["bad"]).hidden_states)
    cached = encode_prompt_texts(LUMINA2, parts, flow_texts(LUMINA2, parts, [spec]))
    again = encode_flow_prompts(LUMINA2, parts, [spec], cached)
    assert torch.equal(again.hidden_states, cond.hidden_states) and torch.equal(again.mask, cond.mask)


def test_truncated_cfg_runs_the_negative_only_below_the_ratio_and_caps_the_norm():
    from library.sampling.flow import with_cfg, with_truncated_cfg

    pos, neg = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)

    def both(x, sigma):
        return torch.cat([neg, pos]) * (1 + sigma.view(-1, 1, 1, 1))

    def alone(x, sigma):
        return pos * (1 + sigma.view(-1, 1, 1, 1))

    x = torch.zeros(1, 4, 2, 2)
    early, late = torch.tensor([0.9]), torch.tensor([0.5])  # model time 0.1 (guided), 0.5 (not below 0.25)
    plain = with_cfg(both, 3.0)
    assert torch.equal(with_truncated_cfg(both, alone, 3.0, None, 0.0)(x, early), plain(x, early))
    assert torch.equal(with_truncated_cfg(both, alone, 3.0, 0.25, 0.0)(x, late), alone(x, late))
    capped = with_truncated_cfg(both, alone, 3.0, 0.25, 1.0)(x, early)
    guided = plain(x, early)
    cap = alone(x, early).norm()
    expected = guided * (cap / guided.norm()) if guided.norm() >= cap else guided
    assert torch.allclose(capped, expected)
