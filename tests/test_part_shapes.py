"""Single-file parts of non-standard sizes (pruned, distilled, resized variants): the config is read from the
weights' shapes, not matched against the released and tiny configs only. The files are written by transformers'
own models; the loaded part must give the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from library.families.encoders import t5
from library.families.flux.loading import load_clip_l
from library.files.weights import load_state_dict


def _file(model: torch.nn.Module, path: Path) -> Path:
    save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def test_a_clip_l_of_other_depth_and_mlp_width_loads_by_its_shapes(tmp_path):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=49408, hidden_size=64, intermediate_size=37, num_hidden_layers=3,
                            num_attention_heads=1, max_position_embeddings=77, hidden_act="quick_gelu")  # fmt: skip
    model = CLIPTextModel(config).eval()  # heads of 64, as every released CLIP
    path = _file(model, tmp_path / "clip_l_pruned.safetensors")
    state, _ = load_state_dict(path)
    loaded = load_clip_l(path, state, torch.float32, "cpu")
    assert (loaded.config.intermediate_size, loaded.config.num_hidden_layers) == (37, 3)
    ids = torch.randint(0, 49408, (2, 77))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).last_hidden_state, model(ids).last_hidden_state)


def test_a_t5_of_other_buckets_heads_and_mlp_width_loads_by_its_shapes(tmp_path):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=32128, d_model=32, d_kv=8, num_heads=4, d_ff=37, num_layers=2,
                      relative_attention_num_buckets=16, feed_forward_proj="gated-gelu")  # fmt: skip
    model = T5EncoderModel(config).eval()
    path = _file(model, tmp_path / "t5_small.safetensors")
    state, _ = load_state_dict(path)
    loaded = t5.load(path, state, [(t5.released_config(), "the released config")], torch.float32, "cpu",
                     where="--t5xxl", what="T5 (--t5xxl)")  # fmt: skip
    got = loaded.config
    assert (got.d_ff, got.num_heads, got.relative_attention_num_buckets, got.num_layers) == (37, 4, 16, 2)
    ids = torch.randint(0, 32128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).last_hidden_state, model(ids).last_hidden_state)


def test_what_the_shapes_cannot_tell_is_still_an_error_naming_the_part(tmp_path):
    """A CLIP width that no head width divides (64, the candidates'): the error names the file and the part."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(vocab_size=49408, hidden_size=36, intermediate_size=40, num_hidden_layers=1,
                            num_attention_heads=4, max_position_embeddings=77)  # fmt: skip
    path = _file(CLIPTextModel(config), tmp_path / "odd.safetensors")
    state, _ = load_state_dict(path)
    with pytest.raises(ValueError, match=r"odd.safetensors: the CLIP-L \(--clip_l\) weights fit no known architecture"):
        load_clip_l(path, state, torch.float32, "cpu")


def test_a_flux_transformer_of_another_text_width_loads_by_its_shapes(tmp_path):
    """A BFL file whose text and pooled widths (and latent channels) differ from FLUX.1's: read from the shapes."""
    from diffusers import FluxTransformer2DModel

    from library.families.flux import keys as K
    from library.families.flux.loading import load_transformer_file

    torch.manual_seed(0)
    model = FluxTransformer2DModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
                                   num_attention_heads=1, joint_attention_dim=24, pooled_projection_dim=20,
                                   guidance_embeds=True, axes_dims_rope=(16, 56, 56)).eval()  # fmt: skip
    view = K.BflView(model.state_dict())
    path = tmp_path / "flux_variant.safetensors"
    save_file({k: view[k].clone().contiguous() for k in view}, str(path))
    state, _ = load_state_dict(path)
    loaded, variant = load_transformer_file(path, state, None, None, torch.float32, "cpu")
    assert variant == "flux-dev" and (loaded.config.joint_attention_dim, loaded.config.pooled_projection_dim) == (
        24,
        20,
    )
    x, txt = torch.randn(1, 4, 16), torch.randn(1, 3, 24)
    inputs = dict(hidden_states=x, encoder_hidden_states=txt, pooled_projections=torch.randn(1, 20),
                  timestep=torch.tensor([0.5]), img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3),
                  guidance=torch.tensor([3.5]))  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**inputs).sample, model(**inputs).sample)
