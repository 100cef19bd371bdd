"""Fine-tune a whole SDXL model (full fine-tune or DreamBooth with class images): fine_tune.py's recipe with the
SDXL family and sdxl_train.py's flags (``--learning_rate_te1`` / ``--learning_rate_te2``, ``--block_lr``).

accelerate launch sdxl_train.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors ...
"""

import functools
import sys

from fine_tune import main as _main
from train_network import run_cli

main = functools.partial(_main, family_names=("sdxl",), script="sdxl_train")

if __name__ == "__main__":
    sys.exit(run_cli(family_names=("sdxl",), entry=main))
