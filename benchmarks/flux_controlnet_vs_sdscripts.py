"""Our FLUX ControlNet file read by sd-scripts' own ``ControlNetFlux`` (strict) and both forwards compared.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/flux_controlnet_vs_sdscripts.py [--record]

On the tiny FLUX.1-dev: a ControlNet built by flux_train_control_net.py's code, every tensor perturbed (the zero
outputs would hide the branch), saved by the Trainable (sd-scripts' keys), and the transformer as its BFL file. In
sd-scripts' venv (the peer kit, PEER_WORK, default ~/sdtrain-peer) its ``ControlNetFlux`` and ``Flux`` load them
with ``strict=True`` and run on the same inputs; prints the largest differences of the residuals and of the
transformer's output with them. ``--record``: writes sd-scripts' ControlNet layout (keys, shapes) for the tiny
model to tests/data/sd_scripts_flux_controlnet_tiny_layout.json (what tests/test_flux_control_net.py checks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(os.environ.get("PEER_WORK", "~/sdtrain-peer")).expanduser()
LAYOUT = ROOT / "tests" / "data" / "sd_scripts_flux_controlnet_tiny_layout.json"


def tiny_params(transformer: torch.nn.Module) -> dict:
    c = transformer.config
    return dict(in_channels=c.in_channels, vec_in_dim=c.pooled_projection_dim, context_in_dim=c.joint_attention_dim,
                hidden_size=c.num_attention_heads * c.attention_head_dim, mlp_ratio=4.0,
                num_heads=c.num_attention_heads, depth=c.num_layers, depth_single_blocks=c.num_single_layers,
                axes_dim=list(c.axes_dims_rope), theta=10000, qkv_bias=True, guidance_embed=c.guidance_embeds)  # fmt: skip


def main(record: bool) -> None:
    from library.families.flux import controlnet as C
    from library.families.flux.controlnet_trainable import FluxControlNet
    from library.families.flux.keys import diffusers_to_bfl
    from library.families.flux.tiny import build_tiny_flux

    torch.manual_seed(0)
    transformer = build_tiny_flux("flux-dev").denoiser
    net = FluxControlNet.create(transformer)
    with torch.no_grad():
        for p in net.model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    work = Path(tempfile.mkdtemp(prefix="flux_cn_peer_"))
    net.save(work / "controlnet.safetensors")
    save_file({k: v.contiguous() for k, v in diffusers_to_bfl(transformer.state_dict()).items()},
              str(work / "flux.safetensors"))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    b, h, w, t = 2, 4, 4, 7  # 64 x 64 pixels: 8 x 8 latents, 4 x 4 tokens
    from library.families.flux.latents import image_ids

    img_ids = image_ids(2 * h, 2 * w, torch.device("cpu"), torch.float32)
    x = dict(img=torch.randn(b, h * w, 64, generator=g), txt=torch.randn(b, t, 32, generator=g),
             y=torch.randn(b, 32, generator=g), timesteps=torch.tensor([0.3, 0.8]), guidance=torch.tensor([3.5, 3.5]),
             cond=torch.rand(b, 3, 64, 64, generator=g) * 2 - 1, img_ids=img_ids.expand(b, -1, -1).contiguous(),
             txt_ids=torch.zeros(b, t, 3), mask=torch.tensor([[1.0] * t, [1.0] * 3 + [0.0] * (t - 3)]))  # fmt: skip
    save_file(x, str(work / "inputs.safetensors"))
    (work / "request.json").write_text(json.dumps({"params": tiny_params(transformer)}))
    kwargs = dict(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"],
                  timestep=x["timesteps"], img_ids=img_ids, txt_ids=torch.zeros(t, 3), guidance=x["guidance"])  # fmt: skip
    from library.families.flux.text import transformer_mask

    masked = {**kwargs, "joint_attention_kwargs": {"attention_mask": transformer_mask(x["mask"], h * w)[:, None, None]}}
    with torch.no_grad():
        net.use_guide_image(x["cond"])
        ours = {case: (C.residuals(net.model, x["cond"], k), transformer(**k, return_dict=False)[0])
                for case, k in (("", kwargs), ("masked.", masked))}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{PEER / 'sd-scripts'}:{ROOT / 'benchmarks' / 'peer' / 'sds_shims'}"}  # fmt: skip
    side = ROOT / "benchmarks" / "peer" / "flux_controlnet_sdscripts_side.py"
    done = subprocess.run([str(PEER / "sdsvenv" / "bin" / "python"), str(side), str(work)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        sys.exit(done.stderr[-3000:])
    theirs = load_file(str(work / "outputs.safetensors"))
    for case, (residuals, out) in ours.items():
        print("with the T5 mask (--apply_t5_attn_mask):" if case else "without a mask:")
        for i, r in enumerate(residuals):
            print(f"  residual {i}: max |ours - sd-scripts| = {(r - theirs[f'{case}residual.{i}']).abs().max():.3g} "
                  f"(max |residual| {r.abs().max():.3g})")  # fmt: skip
        print(f"  transformer output with the residuals: max diff {(out - theirs[f'{case}flux']).abs().max():.3g} "
              f"(max |output| {out.abs().max():.3g})")  # fmt: skip
    layout = json.loads((work / "layout.json").read_text())
    mine = {k: list(v.shape) for k, v in load_file(str(work / "controlnet.safetensors")).items()}
    print(f"sd-scripts read our file strict=True: {len(layout)} tensors; same keys and shapes: {layout == mine}")
    if record:
        LAYOUT.write_text(json.dumps(layout, indent=1, sort_keys=True) + "\n")
        print(f"recorded {LAYOUT}")


if __name__ == "__main__":
    main("--record" in sys.argv[1:])
