"""Train a textual-inversion embedding for SDXL: train_textual_inversion.py's recipe with the SDXL family (same
flags). The token is added to both text encoders; the file holds ``clip_l`` (n, 768) and ``clip_g`` (n, 1280).

accelerate launch sdxl_train_textual_inversion.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors ...
"""

import sys

from train_network import run_cli
from train_textual_inversion import main

if __name__ == "__main__":
    sys.exit(run_cli(family_names=("sdxl",), entry=main))
