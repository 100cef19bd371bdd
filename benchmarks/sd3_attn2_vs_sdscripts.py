"""Where sd-scripts' SD3.5-medium differs from the reference architecture: its second x-attention (run by hand).

    PYTHONPATH=<sd-scripts> <sd-scripts venv>/bin/python benchmarks/sd3_attn2_vs_sdscripts.py [--depth 2] [--seed 0]

sd-scripts v0.10.1 (library/sd3_models.py, ``MMDiTBlock._forward``) calls ``attention(q2, k2, v2,
self.x_block.attn2.num_heads)`` where the argument is the head *width*: for SD3.5-medium (24 heads of 64) its
``attn2`` attends with 64 heads of 24. SAI's reference (mmditx.py), diffusers' ``SD3Transformer2DModel`` and ComfyUI
use 24 heads of 64, as the weights were trained. This script builds sd-scripts' own MMDiT (SD3.5-medium layout:
x-block self-attention in every block, RMS q/k norm) with random weights, converts its state dict with diffusers'
own single-file converter into ``SD3Transformer2DModel`` (the architecture sdtrain trains), and runs both on the same
latents, timesteps, context and pooled vector:

  1. sd-scripts as it is vs diffusers: differ;
  2. sd-scripts with attn2 given its head width (``attn2.num_heads`` set to ``attn2.head_dim`` for the call) vs
     diffusers: equal to float32 rounding;
  3. the flow-matching loss of one batch (target ε − x0, σ = 0.5) under each, as sd3_train_network.py computes it.

Everything on sd-scripts' side is its own code; nothing is re-typed. Printed: max |difference| per comparison and the
three losses.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=2, help="MMDiT depth (sd-scripts: width 64 x depth, depth heads)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    from library import sd3_models

    torch.manual_seed(a.seed)
    depth, context_in = a.depth, 32
    params = sd3_models.SD3Params(patch_size=2, depth=depth, num_patches=64 * 64, pos_embed_max_size=64,
                                  adm_in_channels=16, qk_norm="rms", x_block_self_attn_layers=list(range(depth)),
                                  context_embedder_in_features=context_in, context_embedder_out_features=64 * depth,
                                  model_type="sd3m")  # fmt: skip
    ours_style = sd3_models.create_sd3_mmdit(params, attn_mode="torch").eval()
    for p in ours_style.parameters():  # the zero-initialised gates and outputs would hide the attention
        torch.nn.init.normal_(p, std=0.05)
    state = {k: v.clone() for k, v in ours_style.state_dict().items()}
    converted = convert_sd3_transformer_checkpoint_to_diffusers(state)
    reference = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=depth,
                                      attention_head_dim=64, num_attention_heads=depth, joint_attention_dim=context_in,
                                      caption_projection_dim=64 * depth, pooled_projection_dim=16, out_channels=16,
                                      pos_embed_max_size=64, dual_attention_layers=tuple(range(depth)),
                                      qk_norm="rms_norm").eval()  # fmt: skip
    missing, unexpected = reference.load_state_dict(converted, strict=False)
    assert not missing and not unexpected, (missing[:3], unexpected[:3])

    x0, noise = torch.randn(2, 16, 16, 16), torch.randn(2, 16, 16, 16)
    sigma = torch.full((2,), 0.5)
    noisy = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
    t, y, context = sigma * 1000, torch.randn(2, 16), torch.randn(2, 7, context_in)
    target = noise - x0

    with torch.no_grad():
        ref = reference(hidden_states=noisy, timestep=t, encoder_hidden_states=context, pooled_projections=y).sample
        as_is = ours_style(noisy, t, y=y, context=context)
        heads = [b.x_block.attn2.num_heads for b in ours_style.joint_blocks]
        for b in ours_style.joint_blocks:
            b.x_block.attn2.num_heads = b.x_block.attn2.head_dim  # what the call means: the head width
        fixed = ours_style(noisy, t, y=y, context=context)
        for b, h in zip(ours_style.joint_blocks, heads):
            b.x_block.attn2.num_heads = h

    def loss(pred: torch.Tensor) -> float:
        return torch.nn.functional.mse_loss(pred.float(), target).item()

    print(f"depth {depth}: attn2 heads {heads[0]} of width {ours_style.joint_blocks[0].x_block.attn2.head_dim}")
    print(f"1. sd-scripts as it is vs diffusers        max |diff| = {(as_is - ref).abs().max().item():.3e}")
    print(f"2. sd-scripts, attn2 head width fixed      max |diff| = {(fixed - ref).abs().max().item():.3e}")
    print(f"3. loss: sd-scripts {loss(as_is):.6f}, sd-scripts fixed {loss(fixed):.6f}, diffusers {loss(ref):.6f}")


if __name__ == "__main__":
    main()
