"""diffusers <-> ldm UNet names, checked against diffusers' own single-file converter."""

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

from library.families.sd.unet_keys import diffusers_to_ldm, unet_state_dict_from_ldm, unet_state_dict_to_ldm


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl"])
def test_our_ldm_names_read_back_by_diffusers(tiny_parts, family):
    unet = tiny_parts[family].denoiser
    sd = unet.state_dict()
    ldm = unet_state_dict_to_ldm(sd, unet.config)
    back = convert_ldm_unet_checkpoint(ldm, dict(unet.config))  # diffusers' converter is the oracle
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    ours = unet_state_dict_from_ldm(ldm, unet.config)
    assert set(ours) == set(sd) and all(ours[k] is sd[k] for k in sd)


def test_known_sdxl_names(tiny_parts):
    cfg = tiny_parts["sdxl"].denoiser.config
    assert diffusers_to_ldm("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", cfg) == (
        "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
    )
    assert diffusers_to_ldm("up_blocks.0.upsamplers.0.conv", cfg) == "output_blocks.2.2.conv"
    assert diffusers_to_ldm("down_blocks.0.downsamplers.0.conv", cfg) == "input_blocks.3.0.op"
    assert diffusers_to_ldm("mid_block.attentions.0.proj_in", cfg) == "middle_block.1.proj_in"
    assert diffusers_to_ldm("up_blocks.2.resnets.0.conv_shortcut", cfg) == "output_blocks.6.0.skip_connection"
    assert diffusers_to_ldm("down_blocks.2.resnets.1.time_emb_proj", cfg) == "input_blocks.8.0.emb_layers.1"
    sd1 = tiny_parts["sd1"].denoiser.config
    assert diffusers_to_ldm("up_blocks.0.upsamplers.0.conv", sd1) == "output_blocks.2.1.conv"
    assert diffusers_to_ldm("up_blocks.1.upsamplers.0.conv", sd1) == "output_blocks.5.2.conv"
