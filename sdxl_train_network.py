"""Train a LoRA-family adapter for SDXL: train_network.py's recipe with the SDXL family (same flags).

accelerate launch sdxl_train_network.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors ...
"""

import sys

from train_network import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(family_names=("sdxl",)))
