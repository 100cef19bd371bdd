"""Which ``--network_args`` each adapter algorithm and sd-scripts module takes: the options LyCORIS reads but ignores
for an algorithm (warned and switched off), sd-scripts' networks.oft flags, and what DyLoRA, LoRA-FA and the OFT
family refuse. :class:`networks.config.NetworkConfig` calls these while it reads the flags; every problem is appended
to the reader's one list, so a command line still gets all of them at once.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import NetworkConfig

logger = logging.getLogger("networks.config")  # the network flags' messages come from one logger

OFT_ALGOS = ("diag-oft", "boft", "oft")  # "oft" is sd-scripts' networks.oft (not a LyCORIS algo= name)
# Options LyCORIS 4.1.3 reads but that do nothing with an algorithm (its module ignores them; GLoRA applies dropouts
# only in bypass mode, which is not how either side runs it): accepted with a warning and switched off, so the run is
# the one LyCORIS would do. Fields of NetworkConfig -> why.
_IGNORED_BY_ALGO: dict[str, dict[str, str]] = {
    "full": {"dropout": "the full module has no dropout", "use_tucker": "a full ΔW has no factors",
             "use_scalar": "a full ΔW has no factors", "rs_lora": "full has no rank", "dora": "LyCORIS' full "
             "module ignores dora_wd", "train_on_input": "only (IA)³ reads it"},
    "ia3": {"dropout": "(IA)³ has no dropout", "rank_dropout": "(IA)³ has no rank", "use_tucker": "(IA)³ has no "
            "factors", "use_scalar": "(IA)³ has no factors", "rs_lora": "(IA)³ has no rank", "dora": "LyCORIS' "
            "(IA)³ module ignores dora_wd"},
    "glora": {"dropout": "LyCORIS applies it only in bypass mode", "rank_dropout": "LyCORIS applies it only in "
              "bypass mode", "use_tucker": "LyCORIS 4.1.3 never builds GLoRA's tucker core (its condition cannot "
              "hold)", "dora": "LyCORIS' GLoRA module ignores dora_wd", "train_on_input": "only (IA)³ reads it"},
}  # fmt: skip


def switch_off_ignored(values: dict) -> None:
    """Warn about (and switch off) options LyCORIS ignores for the chosen algorithm (``_IGNORED_BY_ALGO``)."""
    algo = values.get("algo", "lora")
    if values.get("train_on_input") and algo not in _IGNORED_BY_ALGO:
        logger.warning("--network_args train_on_input has no effect with algo=%s (only (IA)³ reads it); ignored", algo)
        values["train_on_input"] = False
    for name, why in _IGNORED_BY_ALGO.get(algo, {}).items():
        if values.get(name):
            flag = {"dora": "dora_wd", "dropout": "dropout / --network_dropout"}.get(name, name)
            logger.warning("--network_args %s has no effect with algo=%s (%s); ignored", flag, algo, why)
            values[name] = None if name in ("dropout", "rank_dropout") else False
    if algo in ("full", "ia3"):
        logger.info("algo=%s: --network_dim and --network_alpha are not used (as in LyCORIS); conv_dim=0 still "
                    "leaves convolutions out", algo)  # fmt: skip


def read_oft_flags(args: argparse.Namespace, values: dict, errors: list[str]) -> None:
    """sd-scripts' networks.oft: the U-Net only, ``--network_dim`` = number of blocks, ``--network_alpha`` = the
    constraint as given (sd-scripts: None -> 1e-3; 0 would freeze every rotation, so it is refused)."""
    values["algo"] = "oft"
    values["train_unet_only"] = True
    alpha = getattr(args, "network_alpha", None)
    values["alpha"] = 1e-3 if alpha is None else float(alpha)
    if values["alpha"] <= 0:
        errors.append(f"--network_alpha {alpha}: networks.oft uses it as the constraint (constraint = alpha x output "
                      "width; sd-scripts clamps ||Q|| to it), and 0 would keep every rotation at identity; use a small "
                      "value such as 1e-3")  # fmt: skip
    elif values["alpha"] >= 1:
        logger.warning("--network_alpha %s is large for networks.oft (the constraint); sd-scripts suggests 1e-3", alpha)
    if getattr(args, "network_train_text_encoder_only", False):
        errors.append("--network_train_text_encoder_only: networks.oft adapts the U-Net only (as sd-scripts)")
    if values.get("dropout"):
        logger.warning("--network_dropout %s is ignored by networks.oft (sd-scripts' OFT has no dropout)",
                       values["dropout"])  # fmt: skip
        values["dropout"] = None


def validate_oft(cfg: NetworkConfig, errors: list[str]) -> None:
    if not cfg.is_oft:
        for key in ("constraint", "rescaled"):
            if key in cfg.network_args:
                logger.warning("--network_args %s has no effect with algo=%s (only LyCORIS' diag-oft and boft read "
                               "it); ignored", key, cfg.algo)  # fmt: skip
        return
    if cfg.constraint < 0:
        errors.append(f"--network_args constraint={cfg.constraint}: must not be negative (0: no constraint)")
    bypass = cfg.network_args.get("bypass_mode", "false").strip().lower() in ("1", "true", "yes", "on")
    if bypass:
        errors.append(f"--network_args bypass_mode=True is not supported with algo={cfg.algo}: LyCORIS' bypass form "
                      "turns the layer's output, bias included (y = R·(Wx + b)), a different model from the weight "
                      "form W' = R·W trained here (LyCORIS' default); remove it")  # fmt: skip
    for flag, on in (("dora_wd", cfg.dora), ("use_scalar", cfg.use_scalar)):
        if on:
            errors.append(f"--network_args {flag}=True is not supported with algo={cfg.algo} (an orthogonal "
                          "rotation has no DoRA magnitude or scalar; LyCORIS ignores it silently); remove it")  # fmt: skip
    for flag, on in (("use_tucker", cfg.use_tucker), ("rs_lora", cfg.rs_lora)):
        if on and cfg.module != "networks.oft":
            logger.warning("--network_args %s has no effect with algo=%s (as in LyCORIS); ignored", flag, cfg.algo)


# Options the DyLoRA references read but never use (sd-scripts networks.dylora: no dropout of any kind; LyCORIS'
# DyLoraModule: module_dropout only), refused rather than ignored.
_DYLORA_UNSUPPORTED = {
    "dropout": "--network_dropout", "rank_dropout": "--network_args rank_dropout", "dora": "dora_wd / algo=dora",
    "use_tucker": "use_tucker / use_cp", "use_scalar": "use_scalar", "rs_lora": "rs_lora",
}  # fmt: skip


def validate_dylora(cfg: NetworkConfig, errors: list[str]) -> None:
    if "block_size" in cfg.network_args and cfg.algo not in ("dylora",):
        logger.warning("--network_args block_size=%s has no effect with algo=%s (LyCORIS reads it for DyLoRA and "
                       "OFT); ignored", cfg.network_args["block_size"], cfg.algo)  # fmt: skip
    if cfg.algo != "dylora":
        return
    if cfg.module == "networks.lora":
        errors.append(
            "--network_args algo=dylora needs --network_module networks.dylora (sd-scripts' DyLoRA, "
            "unit=) or lycoris.kohya (LyCORIS' DyLoRA, block_size=)"
        )
        return
    who = "networks.dylora" if cfg.module == "networks.dylora" else "lycoris.kohya algo=dylora"
    reference = "sd-scripts" if cfg.module == "networks.dylora" else "LyCORIS"
    unsupported = dict(_DYLORA_UNSUPPORTED)
    if cfg.module == "networks.dylora":
        unsupported["module_dropout"] = "--network_args module_dropout"
    for name, flag in unsupported.items():
        if getattr(cfg, name):
            errors.append(f"{flag} is not supported by {who}: the reference DyLoRA ({reference}) accepts it but "
                          "never applies it; drop it")  # fmt: skip
    block, arg = (cfg.unit, "unit") if cfg.module == "networks.dylora" else (cfg.block_size, "block_size")
    if block < 1:
        errors.append(f"--network_args {arg}={block}: must be at least 1")
        return
    conv_dim, _ = cfg.resolved_conv()
    for flag, rank in (("--network_dim", cfg.dim), ("conv_dim", conv_dim)):
        if rank and rank % block:
            errors.append(f"{flag} {rank} is not a multiple of {arg}={block} ({who} trains the rank in blocks of "
                          f"{arg}); use a multiple, e.g. {max(block, rank - rank % block)}")  # fmt: skip
    if cfg.module == "networks.dylora":
        if cfg.conv_dim and cfg.conv_dim != cfg.dim:
            errors.append(f"--network_args conv_dim={cfg.conv_dim}: networks.dylora needs conv_dim == --network_dim "
                          f"({cfg.dim}), as sd-scripts")  # fmt: skip
        if cfg.conv_alpha is not None and cfg.conv_alpha != cfg.alpha:
            errors.append(f"--network_args conv_alpha={cfg.conv_alpha}: networks.dylora uses --network_alpha "
                          f"({cfg.alpha}) for conv layers too (sd-scripts reads conv_alpha but never uses it); drop "
                          "it or set it equal")  # fmt: skip
        if cfg.uses_blocks or cfg.conv_block_dims is not None or cfg.block_alphas is not None:
            errors.append(
                "block_dims / block_alphas / conv_block_* / *_lr_weight are not supported by "
                "networks.dylora (sd-scripts' DyLoRA has no per-block ranks or learning rates)"
            )
        if cfg.preset is not None:
            errors.append("--network_args preset: networks.dylora targets sd-scripts' modules; use lycoris.kohya "
                          "algo=dylora for presets")  # fmt: skip
    elif cfg.uses_loraplus:
        errors.append("loraplus_*lr_ratio has no effect with lycoris.kohya algo=dylora (LyCORIS' DyLoRA tensors are "
                      "not named lora_up); use --network_module networks.dylora for LoRA+")  # fmt: skip


def validate_lora_fa(cfg: NetworkConfig, errors: list[str]) -> None:
    if cfg.algo != "lora_fa":
        return
    if cfg.dora or cfg.use_tucker or cfg.use_scalar:
        errors.append("dora_wd / use_tucker / use_scalar are not supported by networks.lora_fa (sd-scripts' LoRA-FA "
                      "is a plain LoRA whose lora_down is frozen)")  # fmt: skip
    if cfg.uses_loraplus:
        errors.append(
            "loraplus_*lr_ratio: networks.lora_fa trains lora_up only, so LoRA+ would only multiply the "
            "learning rate (sd-scripts' LoRA-FA ignores it); set --learning_rate / --unet_lr instead"
        )
