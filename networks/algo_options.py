"""Which ``--network_args`` each adapter algorithm and sd-scripts module takes: the options LyCORIS reads but ignores
for an algorithm (warned and switched off) and sd-scripts' networks.oft flags. :class:`networks.config.NetworkConfig`
calls these while it reads the flags (and checks what DyLoRA, LoRA-FA and the OFT family refuse once it is built);
every problem is appended to the reader's one list, so a command line still gets all of them at once.
"""

from __future__ import annotations

import argparse
import logging

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
