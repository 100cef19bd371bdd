"""bench_vs_sdscripts.py's cases for the families sd-scripts builds from hard-coded release configs (SD3 and after).

Both sides run the same entry script name (sd-scripts' and ours), on the same single files of
benchmarks/peer/tiny_families.py under ``ASSETS/models/<folder>``, with the same flags: 64 px, batch 1, LoRA dim 4
alpha 2 with the family's ``networks.lora_<family>``, AdamW, seed 1, cached latents and text-encoder outputs, the
denoiser only. sd-scripts runs through a wrapper that patches its released configs to the tiny widths from the
``tiny_config.json`` beside the model file: the peer kit's helpers/run_sdscripts_tiny.py for SD3 and FLUX.1
(``--kit``), this folder's run_reference_tiny.py for the others (Anima, Lumina 2, Chroma, HunyuanImage 2.1, and Stable Cascade
stage C on sd-scripts' ``stable-cascade`` branch: ``--sdscripts`` names that branch's tree, in an invocation of its
own), and Würstchen 2's prior on sd-scripts' ``wuerstchen`` branch (full fine-tuning: the branch has no network
trainer; its script is ``wuerstchen/wuerstchen_train.py``, ours ``wuerstchen_train.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMON = ["--network_dim", "4", "--network_alpha", "2", "--seed", "1", "--cache_latents", "--cache_text_encoder_outputs",
          "--network_train_unet_only"]  # fmt: skip


@dataclass(frozen=True)
class DitCase:
    script: str
    folder: str  # under ASSETS/models, written by tiny_families.py's builder of the same family
    family: str
    files: tuple[tuple[str, str], ...]  # (flag, file name in the folder)
    flags: tuple[str, ...]
    kit_wrapper: bool = False  # the peer kit's run_sdscripts_tiny.py (else run_reference_tiny.py)
    network: bool = True  # a LoRA case (COMMON's flags); else a full fine-tune with the seed alone
    reference_script: str | None = None  # the reference's entry script where its path differs from ours
    save_as: str = "safetensors"  # --save_model_as
    drop: tuple[str, ...] = ()  # shared flags (with their value) this case leaves out on both sides


DIT_CASES = {
    "sd3": DitCase("sd3_train_network.py", "tiny-sd3", "sd3",
                   (("--pretrained_model_name_or_path", "sd3_tiny.safetensors"), ("--clip_l", "clip_l.safetensors"),
                    ("--clip_g", "clip_g.safetensors"), ("--t5xxl", "t5xxl.safetensors")),
                   ("--network_module", "networks.lora_sd3", "--weighting_scheme", "uniform", "--sdpa"),
                   kit_wrapper=True),
    "anima": DitCase("anima_train_network.py", "tiny-anima", "anima",
                     (("--pretrained_model_name_or_path", "tiny_dit.safetensors"), ("--qwen3", "tiny_qwen3.safetensors"),
                      ("--vae", "tiny_vae.safetensors")),
                     ("--network_module", "networks.lora_anima")),
    "lumina": DitCase("lumina_train_network.py", "tiny-lumina", "lumina",
                      (("--pretrained_model_name_or_path", "model.safetensors"), ("--gemma2", "gemma2.safetensors"),
                       ("--ae", "ae.safetensors")),
                      ("--network_module", "networks.lora_lumina")),
    "flux": DitCase("flux_train_network.py", "tiny-flux", "flux",
                    (("--pretrained_model_name_or_path", "flux_tiny.safetensors"), ("--clip_l", "clip_l.safetensors"),
                     ("--t5xxl", "t5xxl.safetensors"), ("--ae", "ae.safetensors")),
                    ("--network_module", "networks.lora_flux", "--timestep_sampling", "shift", "--discrete_flow_shift",
                     "3.1582", "--model_prediction_type", "raw", "--guidance_scale", "1.0"),
                    kit_wrapper=True),
    "chroma": DitCase("flux_train_network.py", "tiny-chroma", "chroma",
                      (("--pretrained_model_name_or_path", "chroma_tiny.safetensors"),
                       ("--t5xxl", "t5xxl.safetensors"), ("--ae", "ae.safetensors")),
                      ("--network_module", "networks.lora_flux", "--model_type", "chroma", "--apply_t5_attn_mask",
                       "--timestep_sampling", "shift", "--discrete_flow_shift", "3.1582", "--model_prediction_type",
                       "raw", "--guidance_scale", "0.0")),
    "hunyuan_image": DitCase("hunyuan_image_train_network.py", "tiny-hunyuan_image", "hunyuan_image",
                             (("--pretrained_model_name_or_path", "tiny_dit.safetensors"),
                              ("--text_encoder", "tiny_qwen.safetensors"), ("--byt5", "tiny_byt5.safetensors"),
                              ("--vae", "tiny_vae.safetensors")),
                             ("--network_module", "networks.lora_hunyuan_image", "--model_prediction_type", "raw",
                              "--discrete_flow_shift", "5.0", "--attn_mode", "torch")),
    "stable_cascade": DitCase("stable_cascade_train_c_network.py", "tiny-stable_cascade", "stable_cascade",
                              (("--stage_c_checkpoint_path", "tiny_stage_c.safetensors"),
                               ("--text_model_checkpoint_path", "tiny_text_model.safetensors"),
                               ("--effnet_checkpoint_path", "tiny_effnet.safetensors")),
                              ("--network_module", "networks.lora", "--sdpa")),
    "wuerstchen": DitCase("wuerstchen_train.py", "tiny-wuerstchen", "wuerstchen",
                          (("--pretrained_prior_model_name_or_path", "prior"),
                           ("--effnet_checkpoint_path", "model_v2_stage_b.pt")), (), network=False,
                          reference_script="wuerstchen/wuerstchen_train.py", save_as="diffusers_safetensors",
                          drop=("--tokenizer_cache_dir",)),
}  # fmt: skip


def dit_flags(case: str, models: Path) -> list[str]:
    """The model files and case flags both sides get (the shared ones come from the caller)."""
    c = DIT_CASES[case]
    common = COMMON if c.network else ["--seed", "1"]
    return [x for flag, name in c.files for x in (flag, str(models / c.folder / name))] + list(c.flags) + common


def reference_wrapper(case: str, kit: Path) -> Path:
    return kit / "run_sdscripts_tiny.py" if DIT_CASES[case].kit_wrapper else HERE / "run_reference_tiny.py"
