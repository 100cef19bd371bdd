"""DreamBooth for SD 1.x / 2.x: fine-tune the whole model on instance images, with class (regularisation) images
weighted by ``--prior_loss_weight`` (prior preservation). fine_tune.py's recipe with train_db.py's flags: the text
encoder trains by default until ``--stop_text_encoder_training`` (-1: never), at ``--learning_rate_te``.

accelerate launch train_db.py --pretrained_model_name_or_path model.safetensors --train_data_dir instance \
    --reg_data_dir class --prior_loss_weight 1.0 --output_dir out ...
"""

import functools
import sys

from fine_tune import main as _main
from train_network import run_cli

main = functools.partial(_main, script="train_db")

if __name__ == "__main__":
    sys.exit(run_cli(entry=main))
