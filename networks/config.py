"""The network flags (sd-scripts names, types and defaults) and their one reader, :class:`NetworkConfig`.

``--network_args`` is a list of ``key=value`` strings. Both ``networks.lora`` (sd-scripts) and ``lycoris.kohya``
(LyCORIS) spellings are accepted; every key is typed (``networks.network_args``; a per-family module's own keys by
its family's rules, into ``NetworkConfig.module_args``) and validated here, and all problems are reported in one
``ValueError``. Keys the chosen module would silently ignore (sd-scripts' block arguments under LyCORIS, LyCORIS
options with no effect on the chosen algorithm) are accepted with a warning, so existing command lines run unchanged;
any other unknown key is an error with a "did you mean".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from library.cli.problems import ConfigError, did_you_mean
from library.families import FAMILIES, block_layout_title
from library.families.adapters import LoraModuleArgs

from . import algo_options
from .algo_options import OFT_ALGOS
from .algos import NOT_SUPPORTED
from .network_args import ALGO_NAMES, MODULE_ALGOS, check_module, read_network_args, rules_for, split_network_args
from .targets import PRESETS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NetworkConfig:
    """Everything that shapes the adapter network, read once from the flags (see :func:`add_network_args`)."""

    module: str = "networks.lora"
    algo: str = "lora"  # lora | loha | lokr ("locon" is lora; "dora" is lora + dora)
    dora: bool = False
    wd_on_output: bool = True  # DoRA magnitude per output row (LyCORIS >= 3.2, PEFT); False: per input column
    dim: int = 4
    alpha: float = 1.0
    dropout: float | None = None
    conv_dim: int | None = None
    conv_alpha: float | None = None
    block_dims: tuple[int, ...] | None = None
    block_alphas: tuple[float, ...] | None = None
    conv_block_dims: tuple[int, ...] | None = None
    conv_block_alphas: tuple[float, ...] | None = None
    down_lr_weight: str | tuple[float, ...] | None = None
    mid_lr_weight: tuple[float, ...] | None = None
    up_lr_weight: str | tuple[float, ...] | None = None
    block_lr_zero_threshold: float = 0.0
    rank_dropout: float | None = None
    module_dropout: float | None = None
    rank_dropout_scale: bool = False
    loraplus_lr_ratio: float | None = None
    loraplus_unet_lr_ratio: float | None = None
    loraplus_text_encoder_lr_ratio: float | None = None
    train_norm: bool = False
    use_tucker: bool = False
    use_scalar: bool = False
    rs_lora: bool = False
    factor: int = -1
    decompose_both: bool = False
    full_matrix: bool = False
    unbalanced_factorization: bool = False
    train_on_input: bool = False  # (IA)³: scale the input channels instead of the output channels
    preset: str | None = None
    unit: int = 1  # networks.dylora: rank block trained per step (sd-scripts)
    block_size: int = 4  # lycoris.kohya algo=dylora: rank block trained per step (LyCORIS)
    constraint: float = 0.0  # LyCORIS OFT / BOFT: the norm cap of Q per output row, stored as alpha (0: none)
    rescaled: bool = False  # LyCORIS OFT / BOFT: a trained per-row rescale
    enable_all_linear: bool = False  # networks.oft: every Linear of the transformer blocks, not only attention
    enable_conv: bool = False  # networks.oft: also the ResNet / down / up-sampler blocks, 3x3 convs included
    # a per-family module's own arguments (networks.lora_<family>: its rules' Args; None for the other modules)
    module_args: LoraModuleArgs | None = None
    network_weights: str | None = None
    dim_from_weights: bool = False
    base_weights: tuple[str, ...] = ()
    base_weights_multiplier: tuple[float, ...] = ()
    scale_weight_norms: float | None = None
    train_unet_only: bool = False
    train_text_encoder_only: bool = False
    network_args: dict[str, str] = field(default_factory=dict)  # as given, for ss_network_args

    @property
    def trains_text_encoder(self) -> bool:
        """sd-scripts: text-encoder adapters train unless --network_train_unet_only (a 0 lr drops them later)."""
        return not self.train_unet_only

    @property
    def is_lycoris(self) -> bool:
        return self.module == "lycoris.kohya"

    @property
    def dylora_style(self) -> str:
        """``"kohya"`` (sd-scripts networks.dylora) or ``"lycoris"`` (lycoris.kohya algo=dylora)."""
        return "lycoris" if self.is_lycoris else "kohya"

    @property
    def dylora_block(self) -> int:
        """The DyLoRA rank block: ``unit`` (networks.dylora) or ``block_size`` (lycoris.kohya)."""
        return self.block_size if self.is_lycoris else self.unit

    @property
    def is_oft(self) -> bool:
        """An orthogonal algorithm (diag-oft, boft, sd-scripts' oft): alpha is a constraint, ΔW depends on W."""
        return self.algo in OFT_ALGOS

    def oft_alpha(self) -> float:
        """The constraint stored as each module's alpha: ``--network_alpha`` for networks.oft, ``constraint=`` for
        LyCORIS' diag-oft / boft."""
        return self.alpha if self.module == "networks.oft" else self.constraint

    @property
    def uses_loraplus(self) -> bool:
        """A LoRA+ ratio given (for the whole network, the U-Net or the text encoders)."""
        return bool(self.loraplus_lr_ratio or self.loraplus_unet_lr_ratio or self.loraplus_text_encoder_lr_ratio)

    @property
    def uses_blocks(self) -> bool:
        """sd-scripts' per-block mode: block dims or block lr weights given."""
        return any(v is not None for v in (self.block_dims, self.down_lr_weight, self.mid_lr_weight, self.up_lr_weight))

    def resolved_conv(self) -> tuple[int, float]:
        """(rank, alpha) for k > 1 convolutions; rank 0 means no conv adapters.

        networks.lora: only with ``conv_dim`` (alpha default 1.0). lycoris.kohya: ``conv_dim`` defaults to
        ``--network_dim`` and ``conv_alpha`` to ``--network_alpha`` (LyCORIS' defaults).
        """
        if self.is_lycoris:
            dim = self.dim if self.conv_dim is None else self.conv_dim
            alpha = self.alpha if not self.conv_alpha else self.conv_alpha
        elif self.module == "networks.dylora":  # sd-scripts: conv_dim == network_dim, network_alpha everywhere
            dim, alpha = (self.dim if self.conv_dim else 0), self.alpha
        else:
            dim = self.conv_dim or 0
            alpha = 1.0 if self.conv_alpha is None else self.conv_alpha
        return dim, (alpha or float(dim))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NetworkConfig:
        """Read and validate the network flags; raise one ``ValueError`` listing every problem."""
        errors: list[str] = []
        module = check_module(getattr(args, "network_module", None), errors)
        values: dict[str, Any] = {"module": module}
        raw = split_network_args(getattr(args, "network_args", None) or [], errors)
        values["network_args"] = raw
        read_network_args(raw, module, values, errors)
        _read_flags(args, values, errors)
        if module in MODULE_ALGOS:
            if "algo" in values:
                errors.append(f"--network_args algo={values['algo']}: {module} trains {MODULE_ALGOS[module]} only; "
                              "drop algo= (or use --network_module lycoris.kohya / networks.lora for other "
                              "algorithms)")  # fmt: skip
            values["algo"] = MODULE_ALGOS[module]
        if module == "networks.oft":
            algo_options.read_oft_flags(args, values, errors)
        algo = values.get("algo", "lora")
        if algo in ("locon", "dora"):
            values["dora"] = values.get("dora", False) or algo == "dora"
            values["algo"] = "lora"
        if algo == "diff":  # the name of the file format (diff / diff_b): LyCORIS' algo=full
            values["algo"] = "full"
        algo_options.switch_off_ignored(values)
        cfg = cls(**values)  # holds every value that parsed, so the checks below still report their problems
        _validate(cfg, errors)
        # cached outputs with text-encoder adapters: library/run/config.py read_config asks the family
        # (FLUX.1 recomputes CLIP-L's pooled output over the T5 cache, as sd-scripts); the rules refuse what never can
        rules = rules_for(cfg.module)
        if getattr(args, "cache_text_encoder_outputs", False) and rules is not None:
            errors += rules.text_cache_problems(cfg)
        if errors:
            raise ConfigError(errors, "network options")
        return cfg

    def metadata(self) -> dict[str, str]:
        """The ``ss_network_*`` keys sd-scripts writes (the trainer adds the rest)."""
        return {
            "ss_network_module": self.module,
            "ss_network_dim": str(self.dim),
            "ss_network_alpha": str(self.alpha),
            "ss_network_dropout": str(self.dropout),
            # sd-scripts writes the key only when network_args were given
            **({"ss_network_args": json.dumps(self.network_args)} if self.network_args else {}),
        }


def _read_flags(args: argparse.Namespace, values: dict, errors: list[str]) -> None:
    dim = getattr(args, "network_dim", None)
    values["dim"] = 4 if dim is None else dim
    alpha = getattr(args, "network_alpha", 1.0)
    values["alpha"] = float(values["dim"]) if not alpha else float(alpha)  # 0 / None -> alpha = dim
    flag_dropout = getattr(args, "network_dropout", None)
    if flag_dropout is not None:
        values["dropout"] = flag_dropout
    values["network_weights"] = getattr(args, "network_weights", None)
    values["dim_from_weights"] = bool(getattr(args, "dim_from_weights", False))
    values["base_weights"] = tuple(getattr(args, "base_weights", None) or ())
    values["base_weights_multiplier"] = tuple(getattr(args, "base_weights_multiplier", None) or ())
    values["scale_weight_norms"] = getattr(args, "scale_weight_norms", None)
    values["train_unet_only"] = bool(getattr(args, "network_train_unet_only", False))
    values["train_text_encoder_only"] = bool(getattr(args, "network_train_text_encoder_only", False))


def _validate(cfg: NetworkConfig, errors: list[str]) -> None:
    _validate_oft(cfg, errors)
    if cfg.algo == "oft" and cfg.module != "networks.oft":
        errors.append("--network_args algo=oft: LyCORIS has no algorithm 'oft'; use algo=diag-oft or algo=boft, or "
                      "--network_module networks.oft for sd-scripts' OFT")  # fmt: skip
    elif cfg.algo not in ALGO_NAMES and cfg.algo not in MODULE_ALGOS.values() and cfg.module != "networks.oft":
        if cfg.algo in NOT_SUPPORTED:
            errors.append(f"--network_args algo={cfg.algo} is not supported yet; supported: {', '.join(ALGO_NAMES)}")
        else:
            errors.append(f"--network_args algo={cfg.algo}: unknown algorithm{did_you_mean(cfg.algo, ALGO_NAMES)}")
    if cfg.dim < 1:
        errors.append(f"--network_dim {cfg.dim}: the rank must be at least 1")
    if cfg.alpha < 0:
        errors.append(f"--network_alpha {cfg.alpha}: must not be negative")
    for name in ("conv_dim", "factor"):
        value = getattr(cfg, name)
        if value is not None and value < 0 and not (name == "factor" and value == -1):
            errors.append(f"--network_args {name}={value}: must not be negative" + (" (or -1)" * (name == "factor")))
    for name in ("dropout", "rank_dropout", "module_dropout"):
        p = getattr(cfg, name)
        if p is not None and not 0.0 <= p < 1.0:
            flag = "--network_dropout" if name == "dropout" else f"--network_args {name}"
            errors.append(f"{flag} {p}: a probability in [0, 1) is needed")
    for name in ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio"):
        r = getattr(cfg, name)
        if r is not None and r <= 0:
            errors.append(f"--network_args {name}={r}: must be > 0")
    if cfg.uses_loraplus and cfg.algo in ("loha", "lokr", "full", "ia3", "glora", *OFT_ALGOS):
        logger.warning("loraplus_*lr_ratio applies to LoRA's lora_up only; with algo=%s it has no effect (as in "
                       "LyCORIS)", cfg.algo)  # fmt: skip
    _validate_blocks(cfg, errors)
    _validate_files(cfg, errors)
    rules = rules_for(cfg.module)
    if rules is not None:
        rules.validate(cfg, errors)
    _validate_dylora(cfg, errors)
    _validate_lora_fa(cfg, errors)


def _validate_blocks(cfg: NetworkConfig, errors: list[str]) -> None:
    for name in ("block_dims", "block_alphas", "conv_block_dims", "conv_block_alphas"):
        values = getattr(cfg, name)
        if values is not None:
            counts, text = _block_numberings()
            if len(values) not in counts:
                errors.append(f"--network_args {name}: {len(values)} values given; {text}")
        if values is not None and any(v < 0 for v in values):
            errors.append(f"--network_args {name}: values must not be negative")
    if cfg.preset is not None and cfg.preset not in PRESETS and not cfg.preset.endswith(".toml"):
        errors.append(f"--network_args preset={cfg.preset}: unknown preset{did_you_mean(cfg.preset, list(PRESETS))} "
                      f"(built-in: {', '.join(PRESETS)}, or a LyCORIS preset .toml file)")  # fmt: skip
    elif cfg.preset is not None and cfg.preset.endswith(".toml") and not os.path.isfile(cfg.preset):
        errors.append(f"--network_args preset={cfg.preset}: no such file")
    if cfg.train_unet_only and cfg.train_text_encoder_only:
        errors.append("--network_train_unet_only and --network_train_text_encoder_only exclude each other")


def _block_numberings() -> tuple[set[int], str]:
    """The block counts the registered families' UNet numberings take ``block_dims`` in, and a sentence saying which
    ("SD1/SD2 need 25 (IN00-IN11, MID, OUT00-OUT11) and SDXL needs 23")."""
    layouts = list(dict.fromkeys(f.blocks for f in FAMILIES.values() if f.blocks.down))
    parts = []
    for layout in layouts:
        several = sum(f.blocks == layout for f in FAMILIES.values()) > 1
        names = "" if layout.edges else f" (IN00-IN{layout.down - 1:02d}, MID, OUT00-OUT{layout.up - 1:02d})"
        parts.append(f"{block_layout_title(layout)} need{'' if several else 's'} {layout.num_blocks}{names}")
    return {layout.num_blocks for layout in layouts}, " and ".join(parts)


def _validate_files(cfg: NetworkConfig, errors: list[str]) -> None:
    if cfg.dim_from_weights and not cfg.network_weights:
        errors.append("--dim_from_weights needs --network_weights (the file to read the ranks from)")
    for flag, paths in (("--network_weights", [cfg.network_weights] if cfg.network_weights else []),
                        ("--base_weights", list(cfg.base_weights))):  # fmt: skip
        for path in paths:
            if not os.path.isfile(path):
                errors.append(f"{flag} {path}: no such file")
    if len(cfg.base_weights_multiplier) > len(cfg.base_weights):
        errors.append(
            f"--base_weights_multiplier has {len(cfg.base_weights_multiplier)} values for "
            f"{len(cfg.base_weights)} --base_weights files"
        )
    if cfg.scale_weight_norms is not None and cfg.scale_weight_norms <= 0:
        errors.append(f"--scale_weight_norms {cfg.scale_weight_norms}: must be > 0")


# ------------------------------------------------------------------------------------------ per-algorithm checks
def _validate_oft(cfg: NetworkConfig, errors: list[str]) -> None:
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


def _validate_dylora(cfg: NetworkConfig, errors: list[str]) -> None:
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


def _validate_lora_fa(cfg: NetworkConfig, errors: list[str]) -> None:
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


def add_network_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The network flags of sd-scripts' train_network.py, with its types and defaults, as one argument group."""
    g = parser.add_argument_group("network", "adapter network (LoRA, LoCon, LoHa, LoKr, DoRA)")
    g.add_argument(
        "--network_module",
        type=str,
        default=None,
        help="networks.lora (LoRA/LoCon/LoHa/LoKr/DoRA via algo=), lycoris.kohya (also algo=dylora/diag-oft/boft), "
        "networks.dylora, networks.lora_fa or networks.oft (sd-scripts' DyLoRA, LoRA-FA and OFT)",
    )
    g.add_argument("--network_dim", type=int, default=None, help="rank (default 4)")
    g.add_argument(
        "--network_alpha",
        type=float,
        default=1,
        help="alpha for scaling: scale = alpha / rank (default 1; 0 means alpha = rank)",
    )
    g.add_argument(
        "--network_dropout",
        type=float,
        default=None,
        help="dropout on the adapter's rank-r activation (0 or None: none)",
    )
    g.add_argument(
        "--network_args",
        type=str,
        default=None,
        nargs="*",
        help="key=value options: algo, conv_dim, conv_alpha, block_dims, preset, dora_wd, ...",
    )
    g.add_argument("--network_weights", type=str, default=None, help="adapter file to start from")
    g.add_argument(
        "--dim_from_weights",
        action="store_true",
        help="build the network (algorithm, ranks, modules) from --network_weights",
    )
    g.add_argument("--network_train_unet_only", action="store_true", help="adapters on the U-Net only")
    g.add_argument(
        "--network_train_text_encoder_only", action="store_true", help="adapters on the text encoder(s) only"
    )
    g.add_argument(
        "--scale_weight_norms",
        type=float,
        default=None,
        help="after each step, scale down each module whose ||ΔW|| exceeds this (1 is a good start)",
    )
    g.add_argument(
        "--base_weights",
        type=str,
        default=None,
        nargs="*",
        help="adapter files merged into the base model before training",
    )
    g.add_argument("--base_weights_multiplier", type=float, default=None, nargs="*",
                   help="multiplier for each --base_weights file (default 1.0)")  # fmt: skip
    return g
