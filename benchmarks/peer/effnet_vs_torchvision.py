"""sdtrain's plain-torch EfficientNet encoder (library/families/stable_cascade/effnet.py) against torchvision's
``efficientnet_v2_s().features`` + the mapper of sd-scripts' stable-cascade branch (``EfficientNetEncoder``), on the
same random weights (running statistics too), in evaluation mode.

    python benchmarks/peer/effnet_vs_torchvision.py [--size 256] [--seed 0]

Run it with a Python that has torchvision (sdtrain's venv must not: the project never installs it); the repository
is put on the path from this file's place. Prints one JSON line: the state-dict keys equal (both ways), the shapes
equal, and the largest absolute difference of the latents (float32, CPU). Exit status 2 without torchvision.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=256, help="image side in pixels (a multiple of 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        import torchvision
    except ImportError:
        print("torchvision is not installed in this Python: run this script with one that has it", file=sys.stderr)
        return 2
    import torch
    from torch import nn

    from library.families.stable_cascade.effnet import EfficientNetEncoder

    torch.manual_seed(args.seed)
    theirs = nn.Module()
    theirs.backbone = torchvision.models.efficientnet_v2_s().features
    theirs.mapper = nn.Sequential(nn.Conv2d(1280, 16, kernel_size=1, bias=False), nn.BatchNorm2d(16, affine=False))
    with torch.no_grad():
        for m in theirs.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                if m.affine:
                    m.weight.normal_(1, 0.1)
                    m.bias.normal_(0, 0.1)
    theirs.eval()
    ours = EfficientNetEncoder().eval()
    state = theirs.state_dict()
    same_keys = set(state) == set(ours.state_dict())
    same_shapes = same_keys and all(state[k].shape == v.shape for k, v in ours.state_dict().items())
    ours.load_state_dict(state, strict=True)
    x = torch.randn(2, 3, args.size, args.size)
    with torch.no_grad():
        expected = theirs.mapper(theirs.backbone(x))
        got = ours(x)
    print(json.dumps({"torchvision": torchvision.__version__, "same_keys": same_keys, "same_shapes": same_shapes,
                      "keys": len(state), "latent_shape": list(got.shape),
                      "max_abs_diff": float((got - expected).abs().max())}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
