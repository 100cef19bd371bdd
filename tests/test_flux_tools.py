"""The FLUX adapter tools on tiny FLUX.1 files: flux_merge_lora.py, flux_extract_lora.py, convert_flux_lora.py and
the generic resize / SVD-merge / check tools on fused modules.

Oracles: ComfyUI's rule applied by hand (W[BFL key] += ratio·(α/r)·up@down), the merged model's output against our
model with the adapter injected, diffusers' ``FluxPipeline.load_lora_weights`` on a PEFT file we wrote,
the SVD's exactness at full rank (extract / resize / SVD-merge reproduce ΔW)."""

from __future__ import annotations

import copy

import pytest
import torch
from _flux_helpers import run_flux
from _networks_helpers import make_config, perturb, single_thread  # noqa: F401

from library.families import get_family
from library.families.flux import keys as K
from library.families.flux import lora_formats as ff
from library.families.flux.options import FluxOptions
from library.families.flux.tiny import build_tiny_flux, write_tiny_files
from library.files.weights import load_state_dict
from networks import convert_flux_lora, flux_extract_lora, flux_merge_lora, inject
from networks.files import group_by_module

FAMILY = get_family("flux-dev")


@pytest.fixture(scope="module")
def parts():
    """A tiny FLUX.1 dev whose every weight is non-zero (diffusers zero-inits some projections)."""
    p = build_tiny_flux("flux-dev", seed=0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for w in p.denoiser.parameters():
            w.add_(torch.randn(w.shape, generator=g) * 0.05)
    return p


def adapter(parts, path, *args, module="networks.lora", seed=0, dim=4, alpha=2.0, spec=False):
    """(path, the model copy with the adapter injected): random adapter tensors saved as a kohya file (``spec``:
    with FLUX ModelSpec metadata, as a FLUX training run writes it: no prediction type)."""
    ours = copy.deepcopy(parts)
    network = inject(make_config(*args, module=module, dim=dim, alpha=alpha), FAMILY.adapter_roots(ours),
                     FAMILY.target_classes)  # fmt: skip
    perturb(network, seed=seed)
    meta = {"ss_base_model_version": "flux1"}
    if spec:
        from library.families.flux.saving import flux_modelspec

        meta.update(flux_modelspec("flux-1-dev/lora", FAMILY.modelspec_implementation("lora"), "b"))
    network.save(path, metadata=meta)
    return path, ours


run = run_flux  # the tiny transformer's output on the shared inputs (tests/_flux_helpers.py)


def lora_delta(tensors: dict) -> torch.Tensor:
    """ComfyUI's rule, re-typed: (alpha / r) · up @ down."""
    down, up = tensors["lora_down.weight"].float(), tensors["lora_up.weight"].float()
    return float(tensors.get("alpha", down.shape[0])) / down.shape[0] * up @ down


# ------------------------------------------------------------------------------------------------ convert
def test_kohya_to_peft_loads_in_flux_pipeline_with_our_output_and_converts_back(parts, tmp_path):
    src, ours = adapter(parts, tmp_path / "k.safetensors", "preset=full")
    state, _ = load_state_dict(src)
    unet = tmp_path / "unet.safetensors"  # diffusers' FluxPipeline loads no T5 LoRA; CLIP-L converts too
    from safetensors.torch import save_file

    save_file({k: v for k, v in state.items() if not k.startswith("lora_te3")}, unet)
    assert convert_flux_lora.main(["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", str(unet),
                                   "--dst_path", str(tmp_path / "p.safetensors")]) == 0  # fmt: skip
    peft, _ = load_state_dict(tmp_path / "p.safetensors")
    assert "transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in peft and not any("alpha" in k for k in peft)
    assert "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight" in peft
    pipe = FAMILY.pipeline(copy.deepcopy(parts), None)  # diffusers' FluxPipeline over copies of the same weights
    pipe.load_lora_weights(peft)
    ours_out, base_out = run(ours.denoiser), run(parts.denoiser)
    assert (ours_out - base_out).abs().max() > 0.1  # the adapter changes the output
    torch.testing.assert_close(run(pipe.transformer), ours_out, atol=1e-5, rtol=1e-5)
    ids = torch.tensor([[49406, 320, 1125, 49407]])
    with torch.no_grad():
        clip_ours, clip_base = ours.text_encoders[0](ids)[0], parts.text_encoders[0](ids)[0]
        assert (clip_ours - clip_base).abs().max() > 0.1
        torch.testing.assert_close(pipe.text_encoder(ids)[0], clip_ours, atol=1e-5, rtol=1e-5)
    # back to kohya: the same ΔW per module (alpha = rank now: the scale is in the factors), fused names again
    assert convert_flux_lora.main(["--src_path", str(tmp_path / "p.safetensors"),
                                   "--dst_path", str(tmp_path / "k2.safetensors")]) == 0  # fmt: skip
    before = group_by_module({k: v for k, v in state.items() if not k.startswith("lora_te3")})
    after = group_by_module(load_state_dict(tmp_path / "k2.safetensors")[0])
    assert set(after) == set(before)
    for name, t in before.items():
        assert after[name]["lora_down.weight"].shape == t["lora_down.weight"].shape  # compact: the same rank
        torch.testing.assert_close(lora_delta(after[name]), lora_delta(t), atol=1e-6, rtol=1e-5)


def test_peft_leaves_with_their_own_down_matrices_stack_block_diagonally():
    g = torch.Generator().manual_seed(0)
    r, d = 2, 8
    leaves = {"to_q": 0, "to_k": 1, "to_v": 2}
    peft = {}
    for leaf in ("to_q", "to_v"):  # to_k absent: its rows get no ΔW
        peft[f"transformer.transformer_blocks.0.attn.{leaf}.lora_A.weight"] = torch.randn(r, d, generator=g)
        peft[f"transformer.transformer_blocks.0.attn.{leaf}.lora_B.weight"] = torch.randn(d, r, generator=g)
    peft["transformer.transformer_blocks.0.attn.to_v.alpha"] = torch.tensor(1.0)  # scale 1/2 on to_v
    peft["transformer.norm_out.linear.lora_A.weight"] = torch.randn(r, d, generator=g)
    peft["transformer.norm_out.linear.lora_B.weight"] = torch.randn(2 * d, r, generator=g)
    out = group_by_module(ff.peft_to_kohya(peft))
    qkv = out["lora_unet_double_blocks_0_img_attn_qkv"]
    assert qkv["lora_down.weight"].shape == (2 * r, d) and float(qkv["alpha"]) == 2 * r
    delta = lora_delta(qkv)
    for leaf, j in leaves.items():
        rows = delta[j * d : (j + 1) * d]
        if leaf == "to_k":
            assert rows.abs().max() == 0
            continue
        a = peft[f"transformer.transformer_blocks.0.attn.{leaf}.lora_A.weight"]
        b = peft[f"transformer.transformer_blocks.0.attn.{leaf}.lora_B.weight"] * (0.5 if leaf == "to_v" else 1.0)
        torch.testing.assert_close(rows, b @ a)
    final = lora_delta(out["lora_unet_final_layer_adaLN_modulation_1"])  # BFL (shift, scale) = diffusers swapped
    dense = peft["transformer.norm_out.linear.lora_B.weight"] @ peft["transformer.norm_out.linear.lora_A.weight"]
    torch.testing.assert_close(final, torch.cat([dense[d:], dense[:d]]))


def test_convert_refuses_what_peft_cannot_hold(parts, tmp_path, capsys):
    src, _ = adapter(parts, tmp_path / "loha.safetensors", "algo=loha", "preset=attn-mlp", module="lycoris.kohya")
    code = convert_flux_lora.main(["--src", "sd-scripts", "--dst", "ai-toolkit", "--src_path", str(src),
                                   "--dst_path", str(tmp_path / "o.safetensors")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "not a plain LoRA module" in err and "svd_merge_lora.py" in err
    code = convert_flux_lora.main(["--src", "ai-toolkit", "--dst", "sd-scripts", "--src_path", str(src),
                                   "--dst_path", str(tmp_path / "o.safetensors")])  # fmt: skip
    assert code == 2 and "swap --src and --dst" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


# ------------------------------------------------------------------------------------------------ merge
@pytest.fixture(scope="module")
def model_files(parts, tmp_path_factory):
    return write_tiny_files(parts, tmp_path_factory.mktemp("flux"))


def test_merge_into_bfl_file_is_comfyui_rule_and_keeps_keys(parts, model_files, tmp_path):
    a, _ = adapter(parts, tmp_path / "a.safetensors", seed=1)
    b, _ = adapter(parts, tmp_path / "b.safetensors", "preset=full", seed=2, dim=2, alpha=1.0)
    out = tmp_path / "merged.safetensors"
    clip_out = tmp_path / "clip_m.safetensors"
    assert flux_merge_lora.main(["--flux_model", str(model_files["model"]), "--clip_l", str(model_files["clip_l"]),
                                 "--clip_l_save_to", str(clip_out), "--models", str(a), str(b), "--ratios", "0.7",
                                 "-1.2", "--save_to", str(out)]) == 0  # fmt: skip
    original, _ = load_state_dict(model_files["model"])
    merged, meta = load_state_dict(out)
    assert list(merged) == list(original) and all(merged[k].shape == original[k].shape for k in original)
    expected = {k: v.clone() for k, v in original.items()}
    clip, clip_merged = load_state_dict(model_files["clip_l"])[0], load_state_dict(clip_out)[0]
    clip_expected = {k: v.clone() for k, v in clip.items()}
    for path, ratio in ((a, 0.7), (b, -1.2)):
        for name, t in group_by_module(load_state_dict(path)[0]).items():
            if name.startswith("lora_unet_"):  # ComfyUI: lora_unet_ + BFL key with dots as underscores
                key = next(k for k in original if "lora_unet_" + k.removesuffix(".weight").replace(".", "_") == name)
                expected[key] = expected[key] + ratio * lora_delta(t)
            elif name.startswith("lora_te1_"):
                key = next(k for k in clip if "lora_te1_" + k.removesuffix(".weight").replace(".", "_") == name)
                clip_expected[key] = clip_expected[key] + ratio * lora_delta(t)
    changed = [k for k in original if not torch.equal(expected[k], original[k])]
    assert "double_blocks.0.img_attn.qkv.weight" in changed and "single_blocks.1.linear1.weight" in changed
    for k in original:
        torch.testing.assert_close(merged[k], expected[k], atol=1e-6, rtol=1e-6)
    assert any(not torch.equal(clip_expected[k], clip[k]) for k in clip)
    for k in clip:
        torch.testing.assert_close(clip_merged[k], clip_expected[k], atol=1e-6, rtol=1e-6)
    assert meta["modelspec.merged_from"].startswith("model")


@pytest.mark.parametrize("case", ["lokr-dora", "full"])
def test_merged_model_equals_the_injected_adapter(parts, model_files, tmp_path, case):
    args = {"lokr-dora": ("algo=lokr", "dora_wd=True", "factor=4"), "loha": ("algo=loha",), "full": ("algo=full",)}[
        case
    ]
    a, ours = adapter(parts, tmp_path / "a.safetensors", *args, "preset=full", module="lycoris.kohya")
    if case == "full":  # the bias change is merged too
        assert any(t["diff_b"].abs().max() > 0 for t in group_by_module(load_state_dict(a)[0]).values())
    out = tmp_path / "merged.safetensors"
    assert flux_merge_lora.main(["--flux_model", str(model_files["model"]), "--models", str(a), "--save_to",
                                 str(out)]) == 0  # fmt: skip
    merged = FAMILY.load(
        out, options=FluxOptions(clip_l=model_files["clip_l"], t5xxl=model_files["t5xxl"], ae=model_files["ae"])
    )
    expected, base = run(ours.denoiser), run(parts.denoiser)
    assert (expected - base).abs().max() > 0.05
    torch.testing.assert_close(run(merged.denoiser), expected, atol=2e-5, rtol=1e-4)


def test_merge_fp8_prefixed_and_diffusers_named_files_and_peft_inputs(parts, tmp_path):
    files = write_tiny_files(parts, tmp_path / "fp8", prefix=K.BFL_PREFIX, fp8=True)
    a, _ = adapter(parts, tmp_path / "a.safetensors", seed=3)
    out = tmp_path / "m8.safetensors"
    assert flux_merge_lora.main(["--flux_model", str(files["model"]), "--models", str(a), "--save_to", str(out),
                                 "--save_precision", "fp8"]) == 0  # fmt: skip
    original, merged = load_state_dict(files["model"])[0], load_state_dict(out)[0]
    assert list(merged) == list(original) and {v.dtype for v in merged.values()} == {torch.float8_e4m3fn}
    key = K.BFL_PREFIX + "double_blocks.1.img_attn.qkv.weight"
    t = group_by_module(load_state_dict(a)[0])["lora_unet_double_blocks_1_img_attn_qkv"]
    want = (original[key].float() + lora_delta(t)).to(torch.float8_e4m3fn)
    assert torch.equal(merged[key].view(torch.uint8), want.view(torch.uint8))
    # a diffusers-named transformer file, and the LoRA as a PEFT file: the same merge under the input's names
    from safetensors.torch import save_file

    diffusers_file = tmp_path / "diffusers.safetensors"
    save_file({k: v.contiguous() for k, v in parts.denoiser.state_dict().items()}, diffusers_file)
    state = load_state_dict(a)[0]
    peft = tmp_path / "peft.safetensors"
    save_file(ff.kohya_to_peft({k: v for k, v in state.items() if k.startswith("lora_unet")}), peft)
    bfl_file = tmp_path / "bfl.safetensors"
    save_file(K.diffusers_to_bfl(parts.denoiser.state_dict()), bfl_file)
    for model, lora, dst in ((diffusers_file, peft, "d.safetensors"), (bfl_file, a, "b.safetensors")):
        flag = ["--diffusers"] if model == diffusers_file else []
        assert flux_merge_lora.main(["--flux_model", str(model), "--models", str(lora), *flag, "--save_to",
                                     str(tmp_path / dst)]) == 0  # fmt: skip
    from_diffusers, from_bfl = (
        load_state_dict(tmp_path / "d.safetensors")[0],
        load_state_dict(tmp_path / "b.safetensors")[0],
    )
    assert set(from_diffusers) == set(parts.denoiser.state_dict())
    for k, v in K.bfl_to_diffusers(from_bfl).items():
        torch.testing.assert_close(from_diffusers[k], v, atol=1e-6, rtol=1e-6)


def test_lora_merges_concat_exact_svd_best_and_shuffle_keeps_delta(parts, tmp_path):
    a, _ = adapter(parts, tmp_path / "a.safetensors", seed=1)
    b, _ = adapter(parts, tmp_path / "b.safetensors", seed=2, dim=2, alpha=1.0, spec=True)
    deltas = [{n: lora_delta(t) for n, t in group_by_module(load_state_dict(p)[0]).items()} for p in (a, b)]
    for flags, name in ((["--concat", "--shuffle"], "c.safetensors"), ([], "s.safetensors")):
        assert flux_merge_lora.main(["--models", str(a), str(b), "--ratios", "0.5", "2", "--save_to",
                                     str(tmp_path / name), *flags]) == 0  # fmt: skip
    concat, meta = load_state_dict(tmp_path / "c.safetensors")
    concat = group_by_module(concat)
    assert meta["modelspec.architecture"] == "flux-1-dev/lora" and "modelspec.prediction_type" not in meta
    svd = group_by_module(load_state_dict(tmp_path / "s.safetensors")[0])
    for n in deltas[0]:
        total = 0.5 * deltas[0][n] + 2 * deltas[1][n]
        torch.testing.assert_close(lora_delta(concat[n]), total, atol=1e-5, rtol=1e-5)
        assert concat[n]["lora_down.weight"].shape[0] == 6 and svd[n]["lora_down.weight"].shape[0] == 4
        s = torch.linalg.svdvals(total.double())
        err = torch.linalg.matrix_norm((lora_delta(svd[n]) - total).double())
        torch.testing.assert_close(err, s[4:].square().sum().sqrt(), atol=1e-5, rtol=1e-4)  # Eckart-Young


def test_merge_problems_are_named_before_anything_is_written(parts, model_files, tmp_path, capsys):
    a, _ = adapter(parts, tmp_path / "a.safetensors")
    code = flux_merge_lora.main(["--flux_model", str(model_files["model"]), "--clip_l", str(model_files["clip_l"]),
                                 "--models", str(a), "--ratios", "1", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--clip_l needs --clip_l_save_to" in err and "--flux_model needs --save_to" in err
    assert "--ratios has 2 value(s) for 1 --models" in err
    state = dict(load_state_dict(model_files["model"])[0])  # one weight of another width: the file does not fit
    state["double_blocks.0.img_attn.qkv.weight"] = torch.zeros(96, 16)
    from safetensors.torch import save_file

    save_file(state, tmp_path / "narrow.safetensors")
    code = flux_merge_lora.main(["--flux_model", str(tmp_path / "narrow.safetensors"), "--models", str(a),
                                 "--save_to", str(tmp_path / "o.safetensors")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "lora_unet_double_blocks_0_img_attn_qkv" in err and not (tmp_path / "o.safetensors").exists()


def test_merge_t5_modules_into_the_t5xxl_file(model_files, tmp_path):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(4)
    name, key = "lora_te3_encoder_block_1_layer_0_SelfAttention_q", "encoder.block.1.layer.0.SelfAttention.q.weight"
    t5 = load_state_dict(model_files["t5xxl"])[0]
    rows, cols = t5[key].shape
    lora = {f"{name}.lora_down.weight": torch.randn(2, cols, generator=g),
            f"{name}.lora_up.weight": torch.randn(rows, 2, generator=g), f"{name}.alpha": torch.tensor(1.0)}  # fmt: skip
    save_file(lora, tmp_path / "t5lora.safetensors")
    out = tmp_path / "t5m.safetensors"
    assert flux_merge_lora.main(["--t5xxl", str(model_files["t5xxl"]), "--t5xxl_save_to", str(out), "--models",
                                 str(tmp_path / "t5lora.safetensors"), "--ratios", "0.25"]) == 0  # fmt: skip
    merged = load_state_dict(out)[0]
    want = t5[key] + 0.25 * lora_delta(group_by_module(lora)[name])
    torch.testing.assert_close(merged[key], want, atol=1e-6, rtol=1e-6)
    assert all(torch.equal(merged[k], v) for k, v in t5.items() if k != key)


# ------------------------------------------------------------------------------------------------ extract
def test_extract_at_full_rank_reproduces_the_difference(parts, tmp_path):
    tuned = copy.deepcopy(parts.denoiser)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, w in tuned.named_parameters():
            if name.startswith("transformer_blocks.1.") or name == "single_transformer_blocks.0.proj_mlp.weight":
                w.add_(torch.randn(w.shape, generator=g) * 0.1)
    from safetensors.torch import save_file

    org_file, tuned_file = tmp_path / "org.safetensors", tmp_path / "tuned.safetensors"
    org_bfl, tuned_bfl = K.diffusers_to_bfl(parts.denoiser.state_dict()), K.diffusers_to_bfl(tuned.state_dict())
    save_file(org_bfl, org_file)
    save_file({K.BFL_PREFIX + k: v.to(torch.bfloat16).float() for k, v in tuned_bfl.items()}, tuned_file)
    tuned_bfl = {k: v.to(torch.bfloat16).float() for k, v in tuned_bfl.items()}
    out = tmp_path / "x.safetensors"
    assert flux_extract_lora.main(["--model_org", str(org_file), "--model_tuned", str(tuned_file), "--save_to",
                                   str(out), "--dim", "1000", "--clamp_quantile", "1", "--mem_eff_safe_open"]) == 0  # fmt: skip
    state, meta = load_state_dict(out)
    modules = group_by_module(state)
    assert meta["ss_base_model_version"] == "flux1" and meta["modelspec.architecture"] == "flux-1-dev/lora"
    assert meta["ss_network_dim"] == "32" and "modelspec.prediction_type" not in meta  # the rank written
    assert "lora_unet_single_blocks_0_linear1" in modules and "lora_unet_img_in" not in modules  # blocks only
    for name, t in modules.items():
        key = next(k for k in org_bfl if "lora_unet_" + k.removesuffix(".weight").replace(".", "_") == name)
        torch.testing.assert_close(lora_delta(t), tuned_bfl[key] - org_bfl[key], atol=2e-5, rtol=1e-4)
    # --min_diff leaves out the modules that did not change; the rest are the same
    assert flux_extract_lora.main(["--model_org", str(org_file), "--model_tuned", str(tuned_file), "--save_to",
                                   str(out), "--dim", "2", "--min_diff", "1e-3"]) == 0  # fmt: skip
    kept = group_by_module(load_state_dict(out)[0])
    assert "lora_unet_single_blocks_0_linear1" in kept and "lora_unet_double_blocks_1_img_attn_qkv" in kept
    assert "lora_unet_double_blocks_0_img_attn_qkv" not in kept and "lora_unet_single_blocks_1_linear1" not in kept


# ------------------------------------------------------------------------------------------------ generic tools
def test_check_resize_and_svd_merge_treat_fused_modules_as_one_matrix(parts, tmp_path, capsys):
    from _tools_helpers import base_weights, file_deltas

    from networks import check_lora_weights, resize_lora, svd_merge_lora

    a, _ = adapter(parts, tmp_path / "a.safetensors", seed=1)
    b, _ = adapter(parts, tmp_path / "b.safetensors", seed=2, dim=2, alpha=1.0)
    assert check_lora_weights.main([str(a)]) == 0
    assert "lora_unet_single_blocks_0_linear1.lora_up.weight,(224-4)" in capsys.readouterr().out
    weights = base_weights(parts)
    da, db = file_deltas(a, weights), file_deltas(b, weights)
    args = ["--model", str(a), "--save_to"]
    assert resize_lora.main([*args, str(tmp_path / "r4.safetensors"), "--new_rank", "4"]) == 0
    assert resize_lora.main([*args, str(tmp_path / "r2.safetensors"), "--new_rank", "2"]) == 0
    assert svd_merge_lora.main(["--models", str(a), str(b), "--ratios", "1", "-0.5", "--new_rank", "6",
                                "--save_to", str(tmp_path / "s.safetensors")]) == 0  # fmt: skip
    r4, r2 = file_deltas(tmp_path / "r4.safetensors", weights), file_deltas(tmp_path / "r2.safetensors", weights)
    merged = file_deltas(tmp_path / "s.safetensors", weights)
    assert "lora_unet_double_blocks_0_img_attn_qkv" in merged and set(r4) == set(da)
    for name in da:
        torch.testing.assert_close(r4[name], da[name], atol=1e-5, rtol=1e-4)  # full rank: lossless
        torch.testing.assert_close(merged[name], da[name] - 0.5 * db[name], atol=1e-5, rtol=1e-4)
        s = torch.linalg.svdvals(da[name].double())  # rank 2: the best approximation (Eckart-Young)
        err = torch.linalg.matrix_norm((r2[name] - da[name]).double())
        torch.testing.assert_close(err, s[2:].square().sum().sqrt(), atol=1e-5, rtol=1e-4)


def test_loha_on_flux_resizes_losslessly_with_the_base_model(parts, tmp_path):
    from _tools_helpers import base_weights, file_deltas

    from networks import resize_lora

    src, _ = adapter(parts, tmp_path / "loha.safetensors", "algo=loha", "preset=full", module="lycoris.kohya")
    out = tmp_path / "r.safetensors"  # LoHa files do not say a module's shape: the base model does
    folder = FAMILY.save(parts, tmp_path / "base")
    assert resize_lora.main(["--model", str(src), "--save_to", str(out), "--new_rank", "32", "--base_model",
                             str(folder)]) == 0  # fmt: skip
    weights = base_weights(parts)
    want, got = file_deltas(src, weights), file_deltas(out, weights)
    assert "lora_unet_single_blocks_1_linear1" in got
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)


def test_lora_interrogator_refuses_a_t5_model(parts, model_files, tmp_path, capsys):
    from networks import lora_interrogator

    a, _ = adapter(parts, tmp_path / "a.safetensors")
    assert lora_interrogator.main(["--sd_model", str(model_files["model"]), "--model", str(a)]) == 2
    assert "FLUX.1" in capsys.readouterr().err


def test_module_map_pairs_chroma_and_flux_names_as_the_loader_does():
    kohya = ["lora_unet_distilled_guidance_layer_layers_1_in_layer", "lora_unet_single_blocks_3_linear1"]
    fmap = ff.ModuleMap.for_names(kohya, diffusers=False)
    assert fmap.by_kohya[kohya[0]].diffusers == ("distilled_guidance_layer.layers.1.linear_1",)
    assert fmap.by_kohya[kohya[1]].diffusers[3] == "single_transformer_blocks.3.proj_mlp"
    back = ff.ModuleMap.for_names(["single_transformer_blocks.3.proj_mlp", "transformer_blocks.2.attn.to_k"], True)
    assert back.by_diffusers["transformer_blocks.2.attn.to_k"][0].bfl == "double_blocks.2.img_attn.qkv"
    assert back.by_diffusers["single_transformer_blocks.3.proj_mlp"][1] == 3
    assert "transformer_blocks.0.attn.norm_q" not in back.by_diffusers  # norms are never adapted


def test_kohya_to_peft_equals_diffusers_converter_at_real_width():
    """diffusers' own kohya FLUX converter (which hard-codes the released width 3072) on a real-width file of a few
    modules, rank 2: every leaf's ΔW (probed with random vectors) equals ours. diffusers leaves the final layer's
    alpha unapplied ("TODO: alphas") and its keys without ``transformer.``, so those modules get alpha = rank here."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    g = torch.Generator().manual_seed(0)
    d, r = 3072, 2
    shapes = {"double_blocks_0_img_attn_qkv": (3 * d, d), "double_blocks_0_txt_attn_qkv": (3 * d, d),
              "double_blocks_0_img_mlp_2": (d, 4 * d), "double_blocks_0_txt_mod_lin": (6 * d, d),
              "single_blocks_0_linear1": (7 * d, d), "single_blocks_0_linear2": (d, 5 * d),
              "single_blocks_0_modulation_lin": (3 * d, d), "final_layer_adaLN_modulation_1": (2 * d, d),
              "final_layer_linear": (64, d)}  # fmt: skip
    state = {}
    for name, (rows, cols) in shapes.items():
        state[f"lora_unet_{name}.lora_down.weight"] = torch.randn(r, cols, generator=g)
        state[f"lora_unet_{name}.lora_up.weight"] = torch.randn(rows, r, generator=g)
        state[f"lora_unet_{name}.alpha"] = torch.tensor(float(r) if name.startswith("final") else 0.5)
    theirs = _convert_kohya_flux_lora_to_diffusers(dict(state))
    theirs = {k if k.startswith("transformer.") else f"transformer.{k}": v for k, v in theirs.items()}
    ours = ff.kohya_to_peft(state)
    assert set(ours) == set(theirs) and len(ours) == 2 * 16
    for key in [k for k in ours if k.endswith(".lora_A.weight")]:
        up = key.replace("lora_A", "lora_B")
        x = torch.randn(ours[key].shape[1], 3, generator=g)
        torch.testing.assert_close(ours[up] @ (ours[key] @ x), theirs[up] @ (theirs[key] @ x), atol=1e-4, rtol=1e-5)


def test_generic_tools_point_peft_flux_files_to_the_converter(tmp_path, capsys):
    from safetensors.torch import save_file

    from networks import resize_lora

    peft = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 8),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 2)}  # fmt: skip
    save_file(peft, tmp_path / "p.safetensors")
    assert (
        resize_lora.main(["--model", str(tmp_path / "p.safetensors"), "--save_to", str(tmp_path / "o.safetensors")])
        == 2
    )
    assert "convert_flux_lora.py --src ai-toolkit --dst sd-scripts" in capsys.readouterr().err
