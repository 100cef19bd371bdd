"""Device memory of a real-size FLUX.1-dev LoRA step with ``--blocks_to_swap`` N, on the simulated device (any CPU).

    python benchmarks/bench_block_swap.py                                   # N = 0, 8, 16, 22, 28
    python benchmarks/bench_block_swap.py --blocks_to_swap 0 16 --batch 2 --cpu_offload_checkpointing

The transformer is diffusers' ``FluxTransformer2DModel`` with FLUX.1-dev's released config (19 double and 38 single
blocks, 3072 wide, 24 heads of 128, joint 4096, pooled 768, guidance embedding), built on the meta device and given
uninitialised host memory (``to_empty``: no resident memory until written; nothing here writes it). The step is the
low-VRAM LoRA step of sd-scripts' docs/flux_train_network.md VRAM table: ``--fp8_base`` (every Linear weight stored
in float8 e4m3fn and computed in bf16, as sd-scripts' ``model.to(float8)``), ``--gradient_checkpointing``, cached
latents and text-encoder outputs (the text encoders and the AE are not on the device), 1024 px (4096 image tokens,
64 channels) with 512 T5 tokens, batch 1, a rank-16 LoRA (fp32, AdamW) on every Linear of the blocks that
sd-scripts' ``networks.lora_flux`` adapts by default (q|k|v, proj, mlp 0/2, modulation; single linear1, linear2,
modulation). Then: ``BlockSwap.place`` (the swapped blocks' frozen weights on the host), one forward + backward +
``optimizer.step()``.

library/measure/simulated_device.py counts the bytes of every tensor on the device (meta) with their real shapes and
lifetimes, without arithmetic; attention is counted as the fused kernel a GPU runs. Printed per N: the device bytes
after placement (weights, adapters) and the peak of the step, in GiB, and the host bytes of the swapped weights; the
last column says whether the step fits each card of the table with 1 GiB left for the CUDA context. Not measured:
the CUDA caching allocator's fragmentation, cuBLAS workspaces, and the load phase of a whole run (the FLUX family
and entry script are written separately: see ``docs/training.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))  # fmt: skip
# docs/flux_train_network.md "Recommended Settings by GPU Memory" (GiB of the card, blocks_to_swap)
CARDS = {24: 0, 16: 16, 12: 16, 10: 22, 8: 28}
CONTEXT_GIB = 1.0
# the modules sd-scripts' lora_flux adapts by default, as groups of diffusers leaves (one group = one fused kohya
# module: img_attn_qkv = to_q | to_k | to_v, single linear1 = to_q | to_k | to_v | proj_mlp, ...)
DOUBLE_TARGETS = (("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.to_out.0",), ("ff.net.0.proj",), ("ff.net.2",),
                  ("norm1.linear",), ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), ("attn.to_add_out",),
                  ("ff_context.net.0.proj",), ("ff_context.net.2",), ("norm1_context.linear",))  # fmt: skip
SINGLE_TARGETS = (("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), ("proj_out",), ("norm.linear",))


def lora_module(torch, nn):
    class LoRALeaf(nn.Module):
        """One leaf of a fused LoRA: ``base(x) + up[rows] @ down @ x`` (fp32 factors, computed in x's dtype); the
        factors are the fused module's (one ``down`` of r x in, one ``up`` over all leaves' rows)."""

        def __init__(self, base: nn.Module, down: nn.Parameter, up: nn.Parameter, rows: slice) -> None:
            super().__init__()
            self.base, self.rows, self.factors = base, rows, [down, up]  # (a list: not submodule parameters twice)

        def forward(self, x):
            down, up = self.factors
            return self.base(x) + (x @ down.t().to(x.dtype)) @ up[self.rows].t().to(x.dtype)

    return LoRALeaf


def fused_attention(torch) -> None:
    """On meta, count SDPA as the fused kernel a GPU runs (torch's math path would hold the attention matrix)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if query.device.type != "meta":
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, **kwargs)  # fmt: skip
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return op(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    torch.nn.functional.scaled_dot_product_attention = sdpa


def measure(n: int, args: argparse.Namespace) -> dict:
    import torch
    from diffusers import FluxTransformer2DModel
    from torch import nn

    from library.device.fp8 import store_in_fp8
    from library.families.base import BlockList
    from library.measure.simulated_device import DEVICE, SimulatedDevice
    from library.run.block_swap import BlockSwap, offloaded_checkpoint

    gc.collect()
    bf16 = torch.bfloat16
    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX_DEV).to(bf16)
    model.requires_grad_(False)
    if not args.no_fp8:
        skip = tuple(x for x in args.fp8_skip.split(",") if x)  # sd-scripts' --fp8_base: model.to(float8_e4m3fn)
        store_in_fp8(model, bf16, skip=skip)
    model.to_empty(device="cpu")  # uninitialised host memory: resident only where written
    if args.cpu_offload_checkpointing:
        model.enable_gradient_checkpointing(offloaded_checkpoint)
    else:
        model.enable_gradient_checkpointing()
    model.train()
    lists = [BlockList(model.transformer_blocks, 1), BlockList(model.single_transformer_blocks, 2)]
    lora = lora_module(torch, nn)
    tokens = (args.resolution // 16) ** 2
    with SimulatedDevice() as sim:
        swap = None
        if n:
            swap = BlockSwap(lists, n, DEVICE)
            swap.place(model)  # as library/run/setup.py place_denoiser
        else:
            model.to(DEVICE)
        adapters = []  # injected after placement (as train_network.py), created on the device
        for blocks, groups in (
            (model.transformer_blocks, DOUBLE_TARGETS),
            (model.single_transformer_blocks, SINGLE_TARGETS),
        ):
            for block in blocks:
                for group in groups:
                    bases = [block.get_submodule(path) for path in group]
                    down = nn.Parameter(torch.empty(args.rank, bases[0].in_features, device=DEVICE))
                    up = nn.Parameter(torch.empty(sum(b.out_features for b in bases), args.rank, device=DEVICE))
                    adapters += [down, up]
                    start = 0
                    for path, base in zip(group, bases):
                        parent, _, leaf = path.rpartition(".")
                        rows = slice(start, start + base.out_features)
                        setattr(block.get_submodule(parent) if parent else block, leaf, lora(base, down, up, rows))
                        start = rows.stop
        optimizer = torch.optim.AdamW(adapters, lr=1e-4)
        gc.collect()
        placed = sim.live_bytes[DEVICE.type]
        sim.reset_peak()
        b = args.batch
        batch = dict(hidden_states=torch.empty(b, tokens, 64, dtype=bf16, device=DEVICE),
                     encoder_hidden_states=torch.empty(b, 512, 4096, dtype=bf16, device=DEVICE),
                     pooled_projections=torch.empty(b, 768, dtype=bf16, device=DEVICE),
                     timestep=torch.empty(b, device=DEVICE), guidance=torch.empty(b, device=DEVICE),
                     img_ids=torch.empty(tokens, 3, device=DEVICE), txt_ids=torch.empty(512, 3, device=DEVICE))  # fmt: skip
        for t in (batch["hidden_states"], batch["encoder_hidden_states"]):
            t.requires_grad_(True)  # as sd-scripts' flux_train_network under gradient checkpointing
        out = model(**batch).sample
        out.float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak = sim.peak_bytes[DEVICE.type]
    gib = 2**30
    return {"blocks_to_swap": n, "split": swap.counts if swap else [0, 0], "batch": args.batch,
            "placed_gib": round(placed / gib, 2), "step_peak_gib": round(peak / gib, 2),
            "host_gib": round(swap.host_bytes / gib, 2) if swap else 0.0,
            "lora_params_m": round(sum(p.numel() for p in adapters) / 1e6, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks_to_swap", type=int, nargs="+", default=[0, 8, 16, 22, 28])
    parser.add_argument("--resolution", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--cpu_offload_checkpointing", action="store_true")
    parser.add_argument("--no_fp8", action="store_true", help="bf16 weights instead of --fp8_base")
    parser.add_argument("--fp8_skip", default="", help="module-path parts whose Linear weights stay bf16, comma-"
                        "separated (library/device/fp8.py's default for UNets is 'norm', which in FLUX names the modulation "
                        "Linears norm1.linear / norm.linear); default: none, as sd-scripts")  # fmt: skip
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    fused_attention(torch)
    rows = []
    for n in args.blocks_to_swap:
        start = time.time()
        row = measure(n, args)
        row["fits"] = [card for card in sorted(CARDS, reverse=True) if row["step_peak_gib"] + CONTEXT_GIB <= card]
        row["wall_s"] = round(time.time() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        "\n| blocks_to_swap | double + single swapped | device after placing (GiB) | step peak (GiB) | host (GiB) | fits "
        f"(card GiB, {CONTEXT_GIB:g} GiB left for CUDA) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        fits = ", ".join(map(str, r["fits"])) or "none"
        print(
            f"| {r['blocks_to_swap']} | {r['split'][0]} + {r['split'][1]} | {r['placed_gib']} | {r['step_peak_gib']} "
            f"| {r['host_gib']} | {fits} |"
        )


if __name__ == "__main__":
    main()
