"""networks/lora_interrogator.py on the tiny models.

Oracles: (1) a base model and a LoRA built so that the LoRA changes the text-encoder path of exactly one token: that
token ranks first and every other token scores exactly 0; (2) for other algorithms (LoHa, LoKr), each token's score
equals mean |E − E_base| with the file's ΔW (independent formulas) added to the base weights, i.e. merged forward ==
the interrogator's unmerged forward."""

from __future__ import annotations

import copy

import pytest
import torch
from _tools_helpers import base_weights, file_deltas, write_adapter
from safetensors.torch import save_file

from library.cli.parse import ConfigError
from library.families import get_family
from library.families.convert import hf_state_dict
from library.files.weights import load_state_dict
from networks import lora_interrogator
from networks.files import module_index

TOKEN = 1125  # an ordinary vocabulary entry, neither BOS nor EOS


def run(*argv):
    return lora_interrogator.run([str(a) for a in argv] + ["--batch_size", "4096", "--device", "cpu"])


def one_token_model(parts):
    """A copy of the tiny SD1 model whose first text-encoder layer cannot tell coordinates 0 and 1 apart for any
    token but TOKEN: token and position embeddings are equal in both coordinates (TOKEN's differ), and so are the
    layer norm's weight and bias. Then d·LN(x) = 0 exactly for d = e0 − e1, at every position of every other prompt."""
    parts = copy.deepcopy(parts)
    te = parts.text_encoders[0]
    state = hf_state_dict(te)
    with torch.no_grad():
        emb = state["text_model.embeddings.token_embedding.weight"]
        emb[:, 1] = emb[:, 0]
        emb[TOKEN, 1] = emb[TOKEN, 0] + 3.0
        pos = state["text_model.embeddings.position_embedding.weight"]
        pos[:, 1] = pos[:, 0]
        for k in ("weight", "bias"):
            ln = state[f"text_model.encoder.layers.0.layer_norm1.{k}"]
            ln[1] = ln[0]
    return parts


def test_the_one_token_an_adapter_changes_ranks_first(tiny_parts, tmp_path, capsys):
    parts = one_token_model(tiny_parts["sd1"])
    model = get_family("sd1").save(parts, tmp_path / "base.safetensors")
    width = parts.text_encoders[0].config.hidden_size
    down = torch.zeros(1, width)
    down[0, 0], down[0, 1] = 1.0, -1.0
    name = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    lora = {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": torch.randn(width, 1),
            f"{name}.alpha": torch.tensor(1.0)}  # fmt: skip
    save_file(lora, str(tmp_path / "one.safetensors"))
    ranked = run("--sd_model", model, "--model", tmp_path / "one.safetensors", "--top_k", 3)
    assert ranked[0][0] == TOKEN and ranked[0][1] > 1e-3
    assert len(ranked) == 49408 and all(score == 0.0 for _, score in ranked[1:])
    printed = capsys.readouterr().out.splitlines()
    start = printed.index("top 3:")
    assert printed[start + 1].startswith(f"[  0]:  {TOKEN} ") and len(printed) == start + 4


def _scores_by_merging(parts, path, tokens):
    """mean |E_merged − E_base| per token, the adapter's ΔW (oracle formulas) added to a copy's weights."""
    family = get_family(parts.family)
    merged = copy.deepcopy(parts)
    index = module_index(family.adapter_roots(merged))
    with torch.no_grad():
        for name, delta in file_deltas(path, base_weights(parts)).items():
            if not index[name].is_unet:
                index[name].module.weight += delta.reshape(index[name].module.weight.shape)
        ids = lora_interrogator.prompts(parts, tokens)
        base = lora_interrogator.embedding(family, parts, ids, None)
        adapted = lora_interrogator.embedding(family, merged, ids, None)
    return (adapted - base).abs().mean(dim=1)


@pytest.mark.parametrize("family,args", [("sd1", ("algo=loha",)), ("sdxl", ("algo=lokr", "factor=4"))])
def test_scores_equal_the_merged_models_for_any_algorithm(tiny_dir, tiny_parts, tmp_path, family, args):
    parts = tiny_parts[family]
    path = write_adapter(parts, tmp_path / "a.safetensors", *args, module="lycoris.kohya", dim=4, alpha=2.0, seed=3)
    ranked = run("--sd_model", tiny_dir / family, "--model", path, "--top_k", 1)
    tokens = [t for t, _ in ranked[:4]] + [0, 1000, 49406, 49407]
    want = _scores_by_merging(parts, path, tokens)
    got = dict(ranked)
    torch.testing.assert_close(torch.tensor([got[t] for t in tokens]), want, atol=1e-6, rtol=1e-5)
    assert want[0] > want[-1] > 0


def test_unet_only_and_foreign_adapters_get_clear_messages(tiny_dir, tiny_parts, tmp_path):
    path = write_adapter(tiny_parts["sd1"], tmp_path / "a.safetensors", dim=2)
    state, meta = load_state_dict(path)
    save_file({k: v for k, v in state.items() if k.startswith("lora_unet_")}, str(tmp_path / "u.safetensors"), meta)
    with pytest.raises(ValueError, match="no text-encoder modules .* cannot be interrogated"):
        run("--sd_model", tiny_dir / "sd1", "--model", tmp_path / "u.safetensors")
    xl = write_adapter(tiny_parts["sdxl"], tmp_path / "xl.safetensors", dim=2)
    with pytest.raises(ValueError, match="lora_te1"):
        run("--sd_model", tiny_dir / "sd1", "--model", xl)
    with pytest.raises(ConfigError, match="--sd_model .* is an sd1 model but --v2 says sd2"):
        run("--sd_model", tiny_dir / "sd1", "--model", path, "--v2")
    with pytest.raises(ConfigError) as e:
        run("--sd_model", tmp_path / "nope", "--model", tmp_path / "nope.safetensors", "--clip_skip", 0)
    assert str(e.value).count("no such file") == 2 and "--clip_skip 0" in str(e.value)
