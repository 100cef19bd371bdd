"""Adapter networks (LoRA, LoCon, LoHa, LoKr, DoRA) in kohya / LyCORIS file format.

    cfg = NetworkConfig.from_args(args)                 # --network_module, --network_dim, --network_args, ...
    network = prepare_network(cfg, family.adapter_roots(parts), family.target_classes)
    optimizer = AdamW(network.param_groups(unet_lr, text_encoder_lr, learning_rate))
    ...
    network.save("out.safetensors", metadata, dtype=torch.float16)

``networks.algos`` holds the math as pure functions; ``layers`` the wrapper layer; ``fused`` one adapter over several
Linear leaves (FLUX's q|k|v); ``targets`` the module choice (presets through the family's ``target_classes``) and kohya
names; ``inject`` / ``network`` build and manage the injected network.
"""

from .config import NetworkConfig, add_network_args
from .inject import inject, merge_files_into_base, network_from_file, network_from_state_dict, prepare_network
from .layers import AdapterLayer, AdapterWeights, NormAdapterLayer
from .network import AdapterNetwork, LoadReport

__all__ = [
    "AdapterLayer",
    "AdapterNetwork",
    "AdapterWeights",
    "LoadReport",
    "NetworkConfig",
    "NormAdapterLayer",
    "add_network_args",
    "inject",
    "merge_files_into_base",
    "network_from_file",
    "network_from_state_dict",
    "prepare_network",
]
