"""``AdapterNetwork``: the adapters injected into a model, keyed by kohya name, and what a trainer does with them.

The network owns only the adapter tensors (``network.parameters()`` / ``state_dict()`` never contain base weights);
the wrapper layers live inside the UNet / text encoders in place of the modules they adapt, until ``eject()``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from library.cli.problems import ConfigError
from library.families import block_layout
from library.families.adapters import first_match

from . import files
from .layers import AdapterLayer, AdapterWeights, DyLoRALayer, NormAdapterLayer
from .targets import Root, Target

logger = logging.getLogger(__name__)


@dataclass
class Slot:
    """Where one adapter layer sits: the layer, its parent module and attribute, the target. A fused target's layer
    is not in the model: ``leaves`` holds (parent, attribute, original leaf) of each leaf its wrappers replaced."""

    layer: AdapterLayer | NormAdapterLayer
    parent: nn.Module
    attr: str
    target: Target
    leaves: tuple[tuple[nn.Module, str, nn.Module], ...] = ()

    def restore(self) -> None:
        """Put the original module(s) back in the model."""
        if self.leaves:
            for parent, attr, leaf in self.leaves:
                setattr(parent, attr, leaf)
        else:
            setattr(self.parent, self.attr, self.layer.base_layer)


@dataclass
class LoadReport:
    """What ``AdapterNetwork.load_*`` matched: loaded module names, network modules not in the file, file modules
    not in the network."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


class AdapterNetwork(nn.Module):
    """Adapters keyed by kohya module name (``lora_unet_...``, ``lora_te_...``, ``lora_te1_...``).

    Implements the run layer's :class:`library.run.trainable.Trainable` (``kind == "network"``).
    """

    kind = "network"
    modelspec_kind = "lora"
    gradient_sync = "manual"  # the adapters run inside a frozen model DDP cannot see: the trainer averages them

    def __init__(self, slots: Sequence[Slot], roots: Sequence[Root], config=None, block_lr: list[float] | None = None):
        super().__init__()
        self.adapters = nn.ModuleDict({s.target.name: s.layer.adapter for s in slots})
        self._slots: dict[str, Slot] = {s.target.name: s for s in slots}
        self._roots = list(roots)
        self.config = config
        self.block_lr_weight = block_lr
        self.multiplier = 1.0

    @property
    def sparse_gradients(self) -> bool:
        """DyLoRA trains one rank block per step: the others get no gradient (see ``library.run.trainable``)."""
        return any(isinstance(s.layer, DyLoRALayer) for s in self._slots.values())

    # ------------------------------------------------------------------------------------------------- inspection
    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def layer(self, name: str) -> AdapterLayer | NormAdapterLayer:
        return self._slots[name].layer

    def layers(self) -> list[AdapterLayer | NormAdapterLayer]:
        return [s.layer for s in self._slots.values()]

    def __len__(self) -> int:
        return len(self._slots)

    def _part(self, unet: bool) -> list[Slot]:
        return [s for s in self._slots.values() if s.target.is_unet == unet]

    # ------------------------------------------------------------------------------------------ the Trainable seam
    def step_models(self, models: Any) -> Any:
        """The step's inputs unchanged: the adapters sit inside the model the step already calls."""
        return models

    def set_training(self, mode: bool) -> None:
        """Train / eval mode of every adapter layer (dropout, rank dropout, module dropout)."""
        for layer in self.layers():
            layer.train(mode)

    def after_step(self) -> dict[str, float]:
        """``--scale_weight_norms``: max-norm scaling after each optimizer step; returns the values sd-scripts logs."""
        max_norm = self.config.scale_weight_norms if self.config is not None else None
        if not max_norm:
            return {}
        scaled, mean_norm, max_key_norm = self.apply_max_norm(max_norm)
        return {"max_norm/keys_scaled": scaled, "norm/avg_key_norm": mean_norm, "max_norm/max_key_norm": max_key_norm}

    def prepare(self, accelerator) -> AdapterNetwork:
        return self

    # ----------------------------------------------------------------------------------------------- multiplier
    def set_multiplier(self, multiplier: float) -> None:
        """Scale every adapter's contribution (merged layers are re-merged at the new value)."""
        self.multiplier = float(multiplier)
        for layer in self.layers():
            was_merged = layer.merged
            layer.unmerge()
            layer.multiplier = self.multiplier
            if was_merged:
                layer.merge()

    # ------------------------------------------------------------------------------------------- optimizer groups
    def param_groups(
        self,
        unet_lr: float | None = None,
        text_encoder_lr: float | Sequence[float] | None = None,
        learning_rate: float | None = None,
    ) -> list[dict]:
        """sd-scripts' ``prepare_optimizer_params``: text-encoder group(s), then UNet group(s), each dict with
        ``params``, ``lr`` and ``name`` (for logging).

        * ``text_encoder_lr`` may be one value or one per text encoder (SDXL: TE1, TE2); None -> ``learning_rate``.
        * With block lr weights (``down/mid/up_lr_weight``) the UNet is split per block (``unet_block<i>``).
        * LoRA+ (``loraplus_*lr_ratio``): the algorithm's "B" parameters (``lora_up``) go to a ``... plus`` group
          with lr × ratio.
        * Groups whose lr is 0 or None are dropped and their parameters frozen ("NO LR skipping" in sd-scripts).
        """
        cfg = self.config
        ratio_te = cfg and (cfg.loraplus_text_encoder_lr_ratio or cfg.loraplus_lr_ratio)
        ratio_unet = cfg and (cfg.loraplus_unet_lr_ratio or cfg.loraplus_lr_ratio)
        groups: list[dict] = []
        te_prefixes = [r[0] for r in self._roots if not r[0].startswith("lora_unet")]
        te_lrs = self._te_lrs(text_encoder_lr, learning_rate, len(te_prefixes))
        split_te = len(set(te_lrs)) > 1
        for i, prefix in enumerate(te_prefixes):
            slots = [s for s in self._part(unet=False) if s.target.name.startswith(prefix + "_")]
            label = f"textencoder{i + 1}" if split_te else "textencoder"
            groups += self._with_reg_lrs(slots, te_lrs[i], ratio_te, label, None if split_te else groups)
        base_lr = unet_lr if unet_lr is not None else learning_rate
        unet_slots = self._part(unet=True)
        if self.block_lr_weight is None:
            groups += self._with_reg_lrs(unet_slots, base_lr, ratio_unet, "unet")
        else:
            by_block: dict[int, list[Slot]] = {}
            layout = block_layout(s.target.name for s in unet_slots)
            for s in unet_slots:
                by_block.setdefault(layout.index(s.target.name), []).append(s)
            for idx, slots in by_block.items():
                weight = self.block_lr_weight[idx] if 0 <= idx < len(self.block_lr_weight) else 1.0
                lr = None if base_lr is None else base_lr * weight
                groups += self._assemble(slots, lr, ratio_unet, f"unet_block{idx}")
        return groups

    def _with_reg_lrs(self, slots, lr, ratio, label: str, merge_into: list[dict] | None = None) -> list[dict]:
        """A per-family module's ``network_reg_lrs``: the modules a regex matches (the first that ``re.search``-es
        the kohya name) in a ``<label> reg_lr_<i>`` group at its lr (LoRA+ inside it), placed before the part's own
        groups as in sd-scripts; the rest as usual."""
        args = getattr(self.config, "module_args", None)
        regs = args.reg_lrs if args is not None else ()
        if not regs:
            return self._assemble(slots, lr, ratio, label, merge_into)
        matched: dict[int, list[Slot]] = {}
        rest = []
        for s in slots:
            i = first_match(regs, s.target.name)
            (rest if i is None else matched.setdefault(i, [])).append(s)
        out = []
        for i in sorted(matched):
            out += self._assemble(matched[i], regs[i][1], ratio, f"{label} reg_lr_{i}", merge_into)
        return out + self._assemble(rest, lr, ratio, label, merge_into)

    @staticmethod
    def _te_lrs(te_lr, learning_rate, count: int) -> list[float | None]:
        if te_lr is None or isinstance(te_lr, (int, float)):
            value = learning_rate if te_lr is None else float(te_lr)
            return [value] * count
        values = [float(v) for v in te_lr]
        if len(values) == 1:
            return values * count
        if len(values) != count:
            raise ValueError(f"--text_encoder_lr: {len(values)} values given for {count} text encoder(s)")
        return values

    @staticmethod
    def _assemble(slots, lr, ratio, label: str, merge_into: list[dict] | None = None) -> list[dict]:
        plain: list[Tensor] = []
        plus: list[Tensor] = []
        for s in slots:
            adapter = s.layer.adapter
            algo = getattr(adapter, "algo", None)
            plus_names = getattr(algo, "plus_params", ()) if ratio else ()
            frozen = getattr(algo, "frozen_params", ())
            for name, p in adapter.named_parameters():
                logical = algo.logical_name(name.split(".")[-1]) if algo is not None else name.split(".")[-1]
                if logical in frozen:  # kept at its init (LoRA-FA's lora_down): no optimizer group
                    continue
                (plus if logical in plus_names else plain).append(p)
        out = []
        for params, group_lr, name in ((plain, lr, label), (plus, None if lr is None else lr * (ratio or 1), "plus")):
            if not params:
                continue
            full_name = label if name == label else f"{label} plus"
            if not group_lr:
                logger.info("lr is %s for %s: these parameters are not trained", group_lr, full_name)
                for p in params:
                    p.requires_grad_(False)
                continue
            existing = next((g for g in (merge_into or []) if g["name"] == full_name), None)
            if existing is not None:
                existing["params"] += params
            else:
                out.append({"params": params, "lr": group_lr, "name": full_name})
        return out

    # ------------------------------------------------------------------------------------------------ file output
    def state_dict_for_file(self, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """kohya/LyCORIS keys ``<name>.<suffix>`` (alpha per module, DoRA ``dora_scale``), cast to ``dtype``."""
        out = {}
        for name, s in self._slots.items():
            prefix = getattr(getattr(s.layer.adapter, "algo", None), "file_prefix", None)
            if prefix and name.startswith("lora_unet_"):  # sd-scripts' networks.oft: oft_unet_...
                name = prefix + name.removeprefix("lora_unet")
            for suffix, t in s.layer.adapter.file_tensors().items():
                t = t.detach().to("cpu")
                out[f"{name}.{suffix}"] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        return out

    def metadata(self) -> dict[str, str]:
        """``ss_network_*`` metadata for the trainer to extend (from the config, or from the modules' ranks)."""
        if self.config is not None:
            meta = self.config.metadata()
            if self.config.scale_weight_norms is not None:
                meta["ss_scale_weight_norms"] = str(self.config.scale_weight_norms)
            return meta
        ranks = [s.layer.adapter.rank for s in self._slots.values() if isinstance(s.layer, AdapterLayer)]
        alphas = [float(s.layer.adapter.alpha) for s in self._slots.values() if isinstance(s.layer, AdapterLayer)]
        dim = max(set(ranks), key=ranks.count) if ranks else None
        alpha = max(set(alphas), key=alphas.count) if alphas else None
        algos = {s.layer.adapter.algo.name for s in self._slots.values() if isinstance(s.layer, AdapterLayer)}
        module = "networks.oft" if algos == {"oft"} else "networks.lora"
        return {"ss_network_module": module, "ss_network_dim": str(dim), "ss_network_alpha": str(alpha)}

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None, dtype=None) -> None:
        """Write the adapter file atomically (``--save_precision`` as ``dtype``; metadata = ``metadata()`` + yours)."""
        from library.files.weights import save_state_dict

        meta = {**self.metadata(), **(metadata or {})}
        save_state_dict(self.state_dict_for_file(dtype), path, metadata=meta, wrap_ckpt=False)

    # ------------------------------------------------------------------------------------------------- file input
    def load_file(self, path: str | os.PathLike, strict: bool = True) -> LoadReport:
        """Load an adapter file into this network (``--network_weights``); see :meth:`load_kohya_state_dict`."""
        from library.files.weights import load_state_dict

        state_dict, _ = load_state_dict(path)
        return self.load_kohya_state_dict(state_dict, strict=strict, source=str(path))

    def load_kohya_state_dict(self, state_dict, strict: bool = True, source: str = "state dict") -> LoadReport:
        """Copy file tensors into the adapters. A module of another algorithm, a shape that does not fit, a file with
        no module of this model raise ``ValueError`` naming the key; with ``strict`` also modules present on only one
        side. The file's ``alpha`` replaces the network's (the scale follows it)."""
        files.raise_if_peft(state_dict, source)
        index = files.module_index(self._roots)
        report, errors, pending, unknown = LoadReport(), [], [], []
        for name, tensors in files.group_by_module(state_dict).items():
            target = index.get(name)
            if target is None or target.name not in self._slots:
                report.unexpected.append(name)
                if target is None:
                    unknown.append(name)
                continue
            try:
                pending.append((self._slots[target.name], self._checked(name, tensors, target.name, source)))
            except ValueError as e:
                errors.append(str(e))
        loaded = {s.target.name for s, _ in pending}
        report.loaded = sorted(loaded)
        report.missing = [n for n in self._slots if n not in loaded]
        if unknown and (strict or not loaded):  # the most telling problem first: another family's file
            errors.insert(0, files.explain_unmatched(unknown, self._roots, source))
        elif not loaded and not errors:
            errors.append(
                f"{source}: no module of the file is part of this network (file: "
                f"{', '.join(report.unexpected[:3]) or 'no modules'}; network: {', '.join(self.names[:3])})"
            )
        extra = [n for n in report.unexpected if n not in unknown]
        if strict and extra and not errors:
            errors.append(
                f"{source}: {len(extra)} module(s) of the file exist in the model but not in this network "
                f"(e.g. {', '.join(extra[:3])}); a different preset, conv_dim or --network_train_*_only? "
                "Pass --dim_from_weights to build the network from the file"
            )
        if strict and report.missing and not errors:
            errors.append(f"{source}: no tensors for {len(report.missing)} network module(s), e.g. "
                          f"{', '.join(report.missing[:3])}; pass --dim_from_weights to build the network from the "
                          "file")  # fmt: skip
        if errors:
            raise ConfigError(errors, "adapter file", limit=5)
        for slot, tensors in pending:
            _copy_into(slot.layer.adapter, tensors)
        if report.unexpected or report.missing:
            logger.warning("%s: %d module(s) not in the network, %d network module(s) not in the file", source,
                           len(report.unexpected), len(report.missing))  # fmt: skip
        return report

    def _checked(self, file_name: str, tensors: dict, name: str, source: str) -> dict[str, Tensor]:
        slot = self._slots[name]
        adapter = slot.layer.adapter
        file_algo = files.algo_of(file_name, tensors, source)
        net_algo = adapter.algo.name if isinstance(adapter, AdapterWeights) else "norm"
        if isinstance(adapter, AdapterWeights) and file_algo == adapter.algo.file_format:
            file_algo = net_algo  # DyLoRA / LoRA-FA files are plain LoRA files
        if file_algo != net_algo:
            example = next(k for k in tensors if k not in ("alpha", "dora_scale"))
            raise ValueError(f"{source}: {file_name}.{example} is a {file_algo} tensor but the network uses "
                             f"{net_algo} here; set --network_args algo={file_algo} or pass --dim_from_weights")  # fmt: skip
        shape = slot.layer.weight_shape if isinstance(slot.layer, AdapterLayer) else slot.layer.base_layer.weight.shape
        tensors = files.fit_to_base(tensors, tuple(shape))
        expected = adapter.file_tensors()
        if ("dora_scale" in tensors) != ("dora_scale" in expected):
            has = "has" if "dora_scale" in tensors else "has no"
            raise ValueError(f"{source}: {file_name} {has} a DoRA magnitude (dora_scale) but the network "
                             f"{'does not use' if has == 'has' else 'uses'} DoRA; match dora_wd or pass "
                             "--dim_from_weights")  # fmt: skip
        for param, value in adapter.constants.items() if isinstance(adapter, AdapterWeights) else ():
            suffix = adapter.algo.file_keys[param]
            if suffix in tensors and int(tensors[suffix]) != int(value):
                raise ValueError(f"{source}: {file_name}.{suffix} is {int(tensors[suffix])} but the network has "
                                 f"{int(value)} (another {param.replace('on_input', 'train_on_input')} setting); "
                                 "match it or pass --dim_from_weights")  # fmt: skip
        missing = [s for s in expected if s not in tensors and s != "alpha"]
        if missing:
            raise ValueError(f"{source}: module {file_name} has no {', '.join(missing)} tensor(s) (the file is "
                             "incomplete or damaged); re-save it, or use another file")  # fmt: skip
        for suffix, t in tensors.items():
            want = expected.get(suffix)
            if suffix != "alpha" and (want is None or tuple(want.shape) != tuple(t.shape)):
                got_shape = "missing" if want is None else tuple(want.shape)
                raise ValueError(f"{source}: {file_name}.{suffix} has shape {tuple(t.shape)} but the network expects "
                                 f"{got_shape} (another rank or option); set --network_dim / conv_dim to the file's "
                                 "or pass --dim_from_weights")  # fmt: skip
        return tensors

    # ----------------------------------------------------------------------------------------- merge / regularise
    def merge(self) -> None:
        """Write every adapter (at the current multiplier) into its base weight; ``unmerge()`` restores exactly."""
        for layer in self.layers():
            layer.merge()

    def unmerge(self) -> None:
        for layer in self.layers():
            layer.unmerge()

    def merge_into_base(self, progress: str | None = None) -> None:
        """Bake the adapters into the base weights permanently and remove them (``--base_weights``, merge tools).
        ``progress``: label of a tqdm bar over the modules (None: no bar)."""
        layers = self.layers()
        if progress is not None:
            from tqdm.auto import tqdm

            layers = tqdm(layers, desc=progress, unit="module", leave=False)
        for layer in layers:
            layer.merge(keep_backup=False)
        self._restore_base_layers()

    def eject(self) -> None:
        """Remove the adapters and restore the original modules (unmerging first)."""
        self.unmerge()
        self._restore_base_layers()

    def _restore_base_layers(self) -> None:
        for s in self._slots.values():
            s.restore()
        self._slots = {}
        self.adapters = nn.ModuleDict()

    @torch.no_grad()
    def apply_max_norm(self, max_norm: float, device: torch.device | str | None = None) -> tuple[int, float, float]:
        """sd-scripts' ``--scale_weight_norms`` for every algorithm: per module n = max(‖ΔW‖_F, c/2); if n > c, ΔW is
        scaled by c/n by scaling each of its k factors by (c/n)^(1/k) (LoRA: up and down by √(c/n)).
        Returns (modules scaled, mean and max of the resulting norms). The scaling stays on the device (a module
        under the cap is multiplied by exactly 1); the three numbers are read back once, not per module."""
        scaled, norms = [], []
        with torch.no_grad():
            for s in self._slots.values():
                if not isinstance(s.layer, AdapterLayer):
                    continue
                adapter = s.layer.adapter
                if adapter.algo.norm_params:  # LyCORIS OFT / BOFT: cap ‖oft_blocks‖, not ‖ΔW‖
                    scaled_one, norm_one = _cap_params(adapter, max_norm)
                    scaled.append(scaled_one)
                    norms.append(norm_one)
                    continue
                delta = s.layer.algo_delta()
                norm = delta.norm().clamp(min=max_norm / 2)
                ratio = norm.clamp(max=max_norm) / norm
                if adapter.scalar is not None:
                    adapter.scalar.mul_(ratio)
                else:
                    # every factor, frozen ones too (sd-scripts' LoRA-FA scales its frozen lora_down as well);
                    # algorithms whose ΔW is not one product give each parameter its own power (norm_exponents)
                    terms = adapter.algo.product_terms or len(adapter.params)
                    exponents = adapter.algo.norm_exponents
                    powers = exponents(adapter.params) if exponents else dict.fromkeys(adapter.params, 1.0 / terms)
                    for name, power in powers.items():
                        p = adapter.params[name]
                        p.mul_((ratio**power).to(p.dtype))
                scaled.append(ratio < 1.0)
                norms.append(delta.norm().float() * ratio)
        if not norms:
            return 0, 0.0, 0.0
        norms_t = torch.stack(norms)
        count, mean, largest = torch.stack([torch.stack(scaled).sum().float(), norms_t.mean(), norms_t.max()]).tolist()
        return int(count), mean, largest


@torch.no_grad()
def _cap_params(adapter: AdapterWeights, max_norm: float) -> tuple[Tensor, Tensor]:
    """LyCORIS' ``apply_max_norm`` for OFT / BOFT: n = max(‖p‖, c/2) over the algorithm's ``norm_params``; when
    n > c they are scaled by c/n. Returns (scaled?, the resulting norm) as 0-dim tensors."""
    params = [adapter.params[k] for k in adapter.algo.norm_params if k in adapter.params]
    orig = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.float()) for p in params]))
    norm = orig.clamp(min=max_norm / 2)
    ratio = norm.clamp(max=max_norm) / norm
    for p in params:
        p.mul_(ratio.to(p.dtype))
    return ratio < 1.0, orig * ratio


def _copy_into(adapter: nn.Module, tensors: dict[str, Tensor]) -> None:
    with torch.no_grad():
        if isinstance(adapter, AdapterWeights):
            algo = adapter.algo
            if algo.from_file is not None:  # DyLoRA: the file's lora_down / lora_up cut into this network's blocks
                unpacked = algo.from_file(tensors, **algo.options(adapter.params))
                for name, p in adapter.params.items():
                    p.copy_(unpacked[name])
            else:
                for name, p in adapter.params.items():
                    p.copy_(tensors[algo.file_keys[name]])
            if "alpha" in tensors:
                adapter.alpha.copy_(tensors["alpha"].reshape(()))
            else:
                adapter.alpha.fill_(float(adapter.rank or 1))
            if adapter.magnitude is not None:
                adapter.magnitude.copy_(tensors["dora_scale"])
            if adapter.scalar is not None:
                adapter.scalar.fill_(1.0)  # the file holds the scalar folded into its tensors
        else:
            for name, p in adapter.params.items():
                p.copy_(tensors[name])
