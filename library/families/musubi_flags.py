"""musubi-tuner's training flags that the musubi-family scripts (Qwen-Image, Z-Image, FLUX.2) read and refuse with
the reason, because nothing here acts on them: one table, each family adding its own (:func:`musubi_refused`)."""

from __future__ import annotations

# flag -> (argparse kwargs, why refused)
_COMMON: dict[str, tuple[dict, str]] = {
    "--flash_attn": ({"action": "store_true"}, "attention runs on PyTorch SDPA here; use --sdpa"),
    "--flash3": ({"action": "store_true"}, "attention runs on PyTorch SDPA here; use --sdpa"),
    "--sage_attn": ({"action": "store_true"}, "attention runs on PyTorch SDPA here; use --sdpa"),
    "--gradient_checkpointing_cpu_offload": ({"action": "store_true"}, "use --cpu_offload_checkpointing"),
    "--show_timesteps": ({"type": str, "default": None}, "print / plot the timestep law: not done here"),
    "--block_swap_h2d_only": ({"action": "store_true"}, "our block swap moves blocks both ways"),
    "--block_swap_ring_size": ({"type": int, "default": None}, "our block swap has no ring buffer setting"),
    "--use_pinned_memory_for_block_swap": ({"action": "store_true"}, "our block swap chooses its own host memory"),
    "--compile_backend": ({"type": str, "default": None}, "see --compile"),
    "--compile_mode": ({"type": str, "default": None}, "see --compile"),
    "--compile_dynamic": ({"type": str, "default": None}, "see --compile"),
    "--compile_fullgraph": ({"action": "store_true"}, "see --compile"),
    "--compile_cache_size_limit": ({"type": int, "default": None}, "see --compile"),
    "--cuda_allow_tf32": ({"action": "store_true"}, "not read here"),
    "--cuda_cudnn_benchmark": ({"action": "store_true"}, "not read here"),
    "--disable_numpy_memmap": ({"action": "store_true"}, "musubi-tuner's cache files are not read here"),
    "--async_upload": ({"action": "store_true"}, "Hugging Face upload is not done here"),
    "--flow_shift": ({"type": float, "default": None}, "musubi-tuner's sampling shift; use --discrete_flow_shift for "
                     "training"),
    "--metadata_arch": ({"type": str, "default": None}, "the architecture is the family's"),
    "--dynamo_mode": ({"type": str, "default": None}, "torch.compile settings are not read here"),
    "--dynamo_fullgraph": ({"action": "store_true"}, "torch.compile settings are not read here"),
    "--dynamo_dynamic": ({"action": "store_true"}, "torch.compile settings are not read here"),
    "--metadata_reso": ({"type": str, "default": None}, "the resolution metadata is written from the dataset"),
}  # fmt: skip


def musubi_refused(title: str, own: dict[str, tuple[dict, str]]) -> dict[str, tuple[dict, str]]:
    """The refused musubi-tuner flags of the family called ``title``: the shared ones and ``own`` (which wins)."""
    named = {
        "--img_in_txt_in_offloading": ({"action": "store_true"}, f"HunyuanVideo's offloading; not for {title}"),
        "--compile": ({"action": "store_true"}, f"torch.compile of the DiT is not done for {title}"),
    }
    return {**_COMMON, **named, **own}
