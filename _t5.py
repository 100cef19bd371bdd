import functools, sys, tempfile
from pathlib import Path
import train_network
from library.flow_matching import add_sd3_flow_args
from library.demo import make_example_dataset
from library.families.sd3.tiny import build_tiny_sd3
from library.families import SD3_MEDIUM

def build_parser():
    p = train_network.build_parser("x", block_swap=True)
    add_sd3_flow_args(p)
    return p

tmp = Path(tempfile.mkdtemp())
parts = build_tiny_sd3(sys.argv[1])
from library.families import FAMILIES
model = FAMILIES[sys.argv[1]].save(parts, tmp / "m.safetensors")
data = make_example_dataset(tmp / "data")
argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--caption_extension", ".txt",
        "--output_dir", str(tmp / "out"), "--output_name", "t", "--network_module", "networks.lora", "--network_dim", "2",
        "--train_batch_size", "1", "--max_train_steps", "3", "--max_data_loader_n_workers", "0", "--seed", "1",
        "--resolution", "64", "--learning_rate", "1e-3"] + sys.argv[2:]
rc = train_network.run(argv, family_names=("sd3", "sd3.5-medium", "sd3.5-large"), parser=build_parser)
print("rc", rc, sorted(p.name for p in (tmp / "out").iterdir()))
from safetensors import safe_open
with safe_open(str(tmp / "out" / "t.safetensors"), "pt") as f:
    keys = list(f.keys()); print(len(keys), keys[:4]); print({k: v for k, v in f.metadata().items() if k in ("ss_base_model_version", "modelspec.architecture", "modelspec.implementation")})

class Opts:
    def __init__(self, args): pass
    def load_kwargs(self):
        return dict(clip_l_dropout_rate=0.5, clip_g_dropout_rate=0.5, t5_dropout_rate=0.5, pos_emb_random_crop_rate=0.5,
                    enable_scaled_pos_embed=True, apply_lg_attn_mask=True, apply_t5_attn_mask=True, t5xxl_max_token_length=64)
    def family_problems(self, family, path): return []
    def metadata(self): return {}
    text_encoder_batch_size = None
rc = train_network.run(argv, family_names=("sd3", "sd3.5-medium", "sd3.5-large"), parser=build_parser, model_options=Opts)
print("rc2", rc.losses)
