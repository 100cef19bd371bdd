"""Max |difference| of full / (IA)³ / GLoRA against lycoris-lora 4.1.3 (run by hand; no timings).

    OMP_NUM_THREADS=1 python benchmarks/lyco_oracle_diffs.py

1. Per algorithm and base layer (Linear 6→5, Conv2d 4→6 3x3 stride 2, Conv2d 4→6 1x1): lycoris-lora's module class
   (``FullModule``, ``IA3Module``, ``GLoRAModule``) trained 3 Adam steps so that no tensor is zero; its tensors
   loaded into our ``AdapterLayer`` on the same base weights; max |our forward − its forward| at multiplier 0.8, and
   max |merged forward − unmerged forward| of ours.
2. Per family (tiny SD1, tiny SDXL) and algorithm: our network (random tensors, multiplier 0.7) saved, read back by
   lycoris-lora's loader (``networks.lycoris_reader.apply_with_lycoris``); max |UNet and text-encoder outputs ours −
   theirs| and, for scale, how far the adapter moves the UNet output.
The tests assert the same comparisons at 1e-5 (tests/test_networks_lyco_algos.py).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.families import get_family  # noqa: E402
from library.families.sd.tiny import build_tiny  # noqa: E402
from networks import NetworkConfig, add_network_args, inject  # noqa: E402
from networks.layers import AdapterLayer, AdapterWeights  # noqa: E402
from networks.lycoris_reader import apply_with_lycoris  # noqa: E402

BASES = {"linear": lambda: nn.Linear(6, 5), "conv3x3": lambda: nn.Conv2d(4, 6, 3, padding=1, stride=2),
         "conv1x1": lambda: nn.Conv2d(4, 6, 1)}  # fmt: skip


def _modules():
    from lycoris.modules.full import FullModule
    from lycoris.modules.glora import GLoRAModule
    from lycoris.modules.ia3 import IA3Module

    return {"full": ("full", FullModule, {}), "ia3": ("ia3", IA3Module, {}),
            "ia3 on_input": ("ia3", IA3Module, {"train_on_input": True}),
            "glora": ("glora", GLoRAModule, {"lora_dim": 2, "alpha": 3.0})}  # fmt: skip


def _base(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return BASES[kind]()


def _input(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((3, 6) if kind == "linear" else (2, 4, 7, 7), generator=g)


def module_diffs() -> None:
    for case, (algo, cls, opts) in _modules().items():
        for kind in BASES:
            torch.manual_seed(2)
            theirs = cls("m", _base(kind), 0.8, **opts)
            theirs.apply_to()
            opt = torch.optim.Adam([p for p in theirs.parameters() if p.requires_grad], lr=0.05)
            x = _input(kind, 1)
            target = torch.randn_like(theirs(x))
            for _ in range(3):
                opt.zero_grad()
                ((theirs(x) - target) ** 2).mean().backward()
                opt.step()
            tensors = {k: v.detach().clone() for k, v in theirs.state_dict().items()}
            layer = AdapterLayer(_base(kind), AdapterWeights.from_file(tensors, algo, "m"))
            layer.multiplier = 0.8
            x = _input(kind, 3)
            with torch.no_grad():
                ours = layer(x)
                oracle = (ours - theirs(x)).abs().max().item()
                layer.merge()
                merged = (layer(x) - ours).abs().max().item()
            print(f"{case:13s} {kind:8s} max|ours - lycoris module| {oracle:.2e}   max|merged - unmerged| {merged:.2e}")


def _config(*network_args: str) -> NetworkConfig:
    parser = argparse.ArgumentParser()
    add_network_args(parser)
    argv = ["--network_module", "lycoris.kohya", "--network_dim", "4", "--network_alpha", "2", "--network_args"]
    return NetworkConfig.from_args(parser.parse_args(argv + list(network_args)))


def _outputs(parts, family, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        unet = parts.denoiser(**inputs).sample
        tokens = torch.arange(7).reshape(1, 7) % 40 + 1
        return [unet, *[te(tokens).last_hidden_state for te in parts.text_encoders]]


def network_diffs() -> None:
    for name in ("sd1", "sdxl"):
        parts, family = build_tiny(name), get_family(name)
        g = torch.Generator().manual_seed(0)
        cfg = parts.denoiser.config
        inputs = {"sample": torch.randn(1, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
                  "timestep": torch.tensor([500]),
                  "encoder_hidden_states": torch.randn(1, 5, cfg.cross_attention_dim, generator=g)}  # fmt: skip
        if cfg.addition_embed_type == "text_time":
            width = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
            inputs["added_cond_kwargs"] = {"text_embeds": torch.randn(1, width, generator=g),
                                           "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}  # fmt: skip
        before = _outputs(parts, family, inputs)
        for args in (("algo=full",), ("algo=ia3",), ("algo=ia3", "train_on_input=True"), ("algo=glora", "conv_dim=2")):
            ours = copy.deepcopy(parts)
            network = inject(_config(*args), family.adapter_roots(ours), family.target_classes)
            with torch.no_grad():
                for p in network.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            network.set_multiplier(0.7)
            expected = _outputs(ours, family, inputs)
            path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
            network.save(path)
            theirs = copy.deepcopy(parts)
            apply_with_lycoris(path, family.adapter_roots(theirs), multiplier=0.7)
            got = _outputs(theirs, family, inputs)
            diff = max((a - b).abs().max().item() for a, b in zip(got, expected))
            moved = (expected[0] - before[0]).abs().max().item()
            print(f"{name:5s} {' '.join(args):30s} {len(network):4d} modules  max|ours - lycoris-lora loader| "
                  f"{diff:.2e}  (the adapter moves the UNet output by up to {moved:.2f})")  # fmt: skip


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    module_diffs()
    network_diffs()
