"""``--blocks_to_swap N`` and ``--cpu_offload_checkpointing``: training a transformer larger than the device.

**Block swapping** (sd-scripts' ``custom_offloading_utils.ModelOffloader``, ``FluxModel.enable_block_swap``): the
frozen weights of the last N blocks of each of the denoiser's block lists (:meth:`ModelFamily.swap_blocks`) stay on
the host; each comes onto the device just before its forward and goes back after it, and comes again for its
backward (in reverse order), with or without gradient checkpointing. Everything else (the other blocks, the
embedders, the output layer, every buffer) sits on the device as usual. N is split between the lists by the
family's rule (library/run/swap_split.py: sd-scripts' even split, FLUX ``N // 2`` double blocks and ``(N - N // 2) * 2``
single blocks, hence N <= 35 for FLUX.1; or musubi-tuner's split by the lists' ratio), each list keeping at least two
blocks on the device.

How a swapped block moves (:class:`BlockSwap`):

* **What moves**: the block's parameters that are frozen when swapping is set up (before adapters are injected):
  the base weights, in whatever dtype they are stored (float8 with ``--fp8_base``, library/device/fp8.py). Adapter tensors
  are separate modules injected later (networks/inject.py), moved to the device with the network, and never touched
  here; buffers stay on the device. Only ``param.data`` changes, so the ``nn.Parameter`` objects (what fp8's hooks,
  adapter layers and optimizers hold) stay the same.
* **Host copies** are made once and never written for frozen weights, so taking a block off the device is
  ``param.data = host copy`` with no copy back. **Trained weights** (full fine-tuning, flux_train.py: the weights
  were frozen when placed, and the trainer turned autograd on after) keep the host copy as the weight of record: when
  an optimizer step changed the device copy while the block was in (a fused step inside backward), it is copied back
  as the block leaves, and a gradient travels with its weight, so an ordinary step after backward updates the host
  copy in place (on the host). Not on the simulated meta device: moving a trained weight between the CPU and meta
  needs ``torch.utils.swap_tensors``, which poisons autograd's gradient accumulator. Where the device is CUDA the
  host copies are pinned (the simulated device pins them too, library/device/host.py ``pins_host_memory``, so that
  a plan counts them) and each block is copied in on a side stream (``non_blocking``) one block ahead of its use;
  the compute stream waits on the copy's event, and the device tensors are ``record_stream``-ed onto it so their
  memory is reused only after the kernels that read them. Elsewhere (CPU, the simulated meta device) the same steps
  run with plain synchronous ``.to()``: one block ahead too, so the simulated device counts the bytes a GPU would
  hold (at most two swapped blocks per list on the device at a time).
* **Forward**: a pre-hook on each swapped block brings it in (and fetches the next swapped block of its list; the last
  resident block fetches the first), a forward hook (also on an exception) sends it back.
* **Backward**: a hook on the block's outputs brings the block back in before any of its backward runs (and fetches
  the previous swapped block); an identity autograd node on its inputs fires once all of the block's input gradients
  are computed, and sends it back; the first of these also queues an end-of-backward callback that sends every
  swapped block back (blocks whose inputs need no gradient stay until then). Under gradient checkpointing the
  recomputed forward runs inside the backward (``torch._C._current_graph_task_id() != -1``) and keeps the block.
* **Saved weights** (without checkpointing): autograd saves the weight or a view of it (``matmul`` saves
  ``weight.t()``), which would keep the device copy alive until backward. While a swapped block runs, a saved-tensor
  hook replaces any saved tensor on one of the block's device weights by a note (the parameter and the view's
  geometry), and the backward takes the view again from the parameter, back on the device by then. The weights are
  frozen, so this is the same tensor bit for bit. fp8's own hook (which notes its compute-dtype copies the same way)
  runs inside ours; under checkpointing both stand aside for torch's.

**CPU-offloaded checkpointing** (sd-scripts' ``flux_models.py`` blocks with ``cpu_offload_checkpointing``): gradient
checkpointing of each block whose saved inputs live on the host. sd-scripts wraps each block's forward as
``to_cpu(forward(*to_cuda(inputs)))`` inside ``torch.utils.checkpoint`` and feeds the next block the host outputs;
here :func:`offloaded_checkpoint` is diffusers' ``gradient_checkpointing_func``: the block's inputs that are on the
autograd path (``requires_grad``: the residual streams) are copied to the host, the non-reentrant checkpoint keeps
those host copies, and the block (also when recomputed in backward) runs on device copies of them. The block's
outputs stay on the device for the next block (sd-scripts' host outputs are copied back at the next block's start:
the same device bytes, one copy fewer). Shared inputs that need no gradient (the rotary embedding) are not copied.

Both work with any denoiser whose blocks are ``nn.ModuleList`` entries called one after another (diffusers' FLUX,
Chroma, SD3 transformers); swapping and offloading may be combined (sd-scripts refuses the combination; here a test
shows both together give the same gradients).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from library.cli.problems import ConfigError
from library.device.host import pins_host_memory
from library.families.base import BlockList
from library.run.swap_split import max_blocks_to_swap, split_blocks_to_swap, swap_problems

logger = logging.getLogger("sdtrain")

# the split of N between the lists (library/run/swap_split.py), read from here too
__all__ = ["BlockSwap", "BlockSwapConfig", "add_block_swap_args", "enable_offloaded_checkpointing", "max_blocks_to_swap",
           "offloaded_checkpoint", "split_blocks_to_swap", "swap_problems"]  # fmt: skip


# ------------------------------------------------------------------------------------------------ flags and config
def add_block_swap_args(parser: argparse.ArgumentParser) -> None:
    """``--blocks_to_swap`` and ``--cpu_offload_checkpointing`` (sd-scripts' DiT scripts; names and defaults as
    there). Read by :meth:`BlockSwapConfig.from_args`."""
    g = parser.add_argument_group("block swap")
    g.add_argument(
        "--blocks_to_swap",
        type=int,
        default=None,
        help="keep the frozen weights of this many transformer blocks on the host and move each onto the device just "
        "before it runs (forward and backward): less device memory, slower steps. N is shared between the model's "
        "block lists as sd-scripts shares it; each list keeps two blocks on the device",
    )
    g.add_argument(
        "--cpu_offload_checkpointing",
        action="store_true",
        help="gradient checkpointing whose saved block inputs are kept on the host (turns --gradient_checkpointing on)",
    )


@dataclass(frozen=True)
class BlockSwapConfig:
    """``blocks_to_swap``: N (0 or None: none). ``cpu_offload_checkpointing``: checkpoint the denoiser's blocks with
    their saved inputs on the host (implies gradient checkpointing)."""

    blocks_to_swap: int | None = None
    cpu_offload_checkpointing: bool = False

    @property
    def swaps(self) -> bool:
        return bool(self.blocks_to_swap)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BlockSwapConfig:
        """Read :func:`add_block_swap_args`' flags (absent from a script's parser: the defaults)."""
        n = getattr(args, "blocks_to_swap", None)
        if n is not None and n < 0:
            raise ConfigError([f"--blocks_to_swap must be >= 0 (0: no swapping), got {n}"])
        cfg = cls(n, bool(getattr(args, "cpu_offload_checkpointing", False)))
        if cfg.cpu_offload_checkpointing and not getattr(args, "gradient_checkpointing", False):
            logger.warning("--cpu_offload_checkpointing: gradient checkpointing is turned on too (as sd-scripts' "
                           "scripts do); pass --gradient_checkpointing to say so")  # fmt: skip
        return cfg


# ------------------------------------------------------------------------------------------------ swapping
def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass in this thread (a checkpointed block is recomputed)."""
    return torch._C._current_graph_task_id() != -1


def _assign(param: nn.Parameter, tensor: Tensor) -> None:
    """``param.data = tensor`` (the same Parameter object, its data moved); between the CPU and the simulated meta
    device, whose tensor types torch will not exchange that way, the tensor is swapped in under the same object.
    ``swap_tensors`` leaves the parameter's post-accumulate-grad hooks (``--fused_backward_pass``'s optimizer steps,
    library/optim/fused.py) registered on the old tensor: they are set again on the new one, or a trained weight
    swapped onto the simulated device would never be stepped in backward and its gradient would stay there."""
    if torch._has_compatible_shallow_copy_type(param, tensor):
        param.data = tensor
        return
    hooks = param._post_accumulate_grad_hooks
    torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))
    if hooks:
        param._post_accumulate_grad_hooks = hooks  # (the setter registers them with the tensor's autograd data)


def _move(param: nn.Parameter, tensor: Tensor) -> None:
    """:func:`_assign`, and a trained parameter's accumulated gradient goes where its data goes (so the next backward
    accumulates into it on the device, and an optimizer step after backward finds weight and gradient together)."""
    if param.requires_grad and tensor.device.type == "cpu" and param.device.type == "meta":
        # the simulated device: a trained weight cannot leave meta by swap_tensors (it would poison its gradient
        # accumulator); it stays on meta as a stand-in without storage (no device bytes), the host copy unchanged
        tensor = torch.empty((), dtype=tensor.dtype, device=param.device).expand(tensor.shape)
    grad = param.grad
    if grad is None or grad.device == tensor.device:
        _assign(param, tensor)
        return
    param.grad = None
    _assign(param, tensor)
    with torch.no_grad():
        param.grad = grad.to(tensor.device)


def _others_hook_saved_tensors() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


class _WeightNote(NamedTuple):
    """A saved tensor that was (a view of) a swapped block's device weight: taken again from the parameter."""

    param: nn.Parameter
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _NotePack:
    """The pack hook of a swapped block's forward. ``weight_notes`` tells library/device/fp8.py that these hooks only note
    weights, so its own (inner) hooks still note its float8 copies."""

    weight_notes = True

    def __init__(self, swapped: _Swapped) -> None:
        self.swapped = swapped

    def __call__(self, tensor: Tensor) -> Any:
        param = self.swapped.storages.get(tensor.untyped_storage()._cdata)
        if param is None or tensor.dtype != param.dtype:
            return tensor
        return _WeightNote(param, tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset())


def _unpack(saved: Any) -> Any:
    if isinstance(saved, _WeightNote):
        return saved.param.data.as_strided(saved.size, saved.stride, saved.offset)
    return saved


class _BlockDone(torch.autograd.Function):
    """Identity on a swapped block's inputs; its backward runs once every input gradient of the block is computed,
    i.e. after the block's whole backward: the block goes back to the host."""

    @staticmethod
    def forward(ctx: Any, swapped: _Swapped, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.swapped = swapped
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        ctx.swapped.swap.queue_settle()
        ctx.swapped.evict()
        return (None, *grads)


class _Swapped:
    """One swapped block: its parameters, their host copies, and where they are.

    The parameters are the block's weights frozen when swapping is set up (adapters injected later are not among
    them; full fine-tuning turns autograd on for the weights after they are placed). Those that are trained later
    (``requires_grad``) keep their host copy as the weight of record: an
    optimizer step that changed the device copy while the block was on the device (a fused step in backward) is
    copied back into the host copy when the block leaves, and the gradient travels with the weight (:func:`_move`),
    so an ordinary optimizer step after backward updates the host copy in place."""

    def __init__(self, swap: BlockSwap, block: nn.Module, name: str) -> None:
        self.swap, self.block, self.name = swap, block, name
        self.params = [p for p in block.parameters() if not p.requires_grad]  # frozen when swapping is set up
        self.host: list[Tensor] = []
        self.versions: list[int] = []  # the device copies' version counters when they came in (trained weights)
        self.pending: list[Tensor] | None = None  # device copies on their way (fetched ahead of use)
        self.event: Any = None
        self.resident = False
        self.storages: dict[int, nn.Parameter] = {}  # device storage -> parameter, while resident
        self.saving: torch.autograd.graph.saved_tensors_hooks | None = None
        self.next: _Swapped | None = None
        self.prev: _Swapped | None = None

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)

    def take_host(self) -> None:
        """Put the weights on the host (pinned where the device is CUDA) and keep those copies."""
        self.host = []
        for p in self.params:
            host = p.data if p.device.type == "cpu" else p.data.to("cpu")
            if self.swap.pinned and not host.is_pinned():
                host = host.pin_memory()
            _assign(p, host)
            self.host.append(host)

    def fetch(self) -> None:
        """Start the copy onto the device (done at once where the device is not CUDA)."""
        if self.resident or self.pending is not None:
            return
        device = self.swap.device
        with torch.inference_mode(False), torch.no_grad():  # plain tensors even when sampling fetches them
            if self.swap.stream is not None:
                with torch.cuda.stream(self.swap.stream):
                    self.pending = [h.to(device, non_blocking=True, copy=True) for h in self.host]
                    self.event = torch.cuda.Event()
                    self.event.record(self.swap.stream)
            else:
                self.pending = [h.to(device, copy=True) for h in self.host]  # a copy on the CPU too: the same steps

    def bring_in(self) -> None:
        if self.resident:
            return
        self.fetch()
        if self.event is not None:
            current = torch.cuda.current_stream(self.swap.device)
            current.wait_event(self.event)
            for t in self.pending:
                t.record_stream(current)
        for p, t in zip(self.params, self.pending):
            _move(p, t)
        self.versions = [p._version for p in self.params]  # an optimizer step in place bumps these
        self.storages = {t.untyped_storage()._cdata: p for p, t in zip(self.params, self.pending)}
        self.pending, self.event, self.resident = None, None, True
        self.swap.moves_in += 1

    def evict(self) -> None:
        """Back to the host copies (a frozen weight: nothing to copy back; a trained one: copied back when a step
        changed it on the device); a fetch not used is dropped."""
        self.pending = self.event = None
        if not self.resident and all(p.device.type == "cpu" for p in self.params):
            return
        changed = [self.resident and p.requires_grad and p._version != v for p, v in zip(self.params, self.versions)]
        with torch.no_grad():
            for p, h, c in zip(self.params, self.host, changed):
                if c and p.device.type != "meta":  # (the simulated device holds no values)
                    h.copy_(p.data)
                _move(p, h)
        self.storages = {}
        if self.resident:
            self.swap.moves_out += 1
        self.resident = False

    # hooks
    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        in_backward = _in_backward()
        self.bring_in()
        if in_backward:
            return None  # a checkpointed block recomputed for its backward: the output hook fetched the previous
        if self.next is not None:
            self.next.fetch()
        if not torch.is_grad_enabled():
            return None
        if not _others_hook_saved_tensors():  # not under checkpointing: saved weights become notes
            self.saving = torch.autograd.graph.saved_tensors_hooks(_NotePack(self), _unpack)
            self.saving.__enter__()
        leaves, spec = tree_flatten((args, kwargs))
        slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor) and x.requires_grad]
        if not slots:
            return None
        for i, t in zip(slots, _BlockDone.apply(self, *[leaves[i] for i in slots])):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.saving is not None:
            self.saving.__exit__(None, None, None)
            self.saving = None
        if _in_backward():
            return  # recomputed for the backward that follows: the weights stay until the block's backward is done
        needing = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        if needing and torch.is_grad_enabled():
            for t in needing:  # fires before the node that made t runs backward, i.e. before the block's backward
                t.register_hook(self._backward_starts)
        self.evict()

    def _backward_starts(self, grad: Tensor) -> None:
        self.swap.queue_settle()
        self.bring_in()
        if self.prev is not None:
            self.prev.fetch()


def _fetch_in_forward(swapped: _Swapped) -> None:
    if not _in_backward():  # (a recompute of the resident block in backward: the swapped one is done by then)
        swapped.fetch()


class BlockSwap:
    """Keep the last ``counts[i]`` blocks of each block list on the host; see the module docstring (trained
    weights: :class:`_Swapped`).

    ``lists``: the denoiser's block lists in forward order (:meth:`ModelFamily.swap_blocks`); ``blocks_to_swap``: N,
    split by :func:`split_blocks_to_swap` with the family's rule ``split``; ``device``: the accelerator's device. :meth:`place` puts the model there.
    ``moves_in`` / ``moves_out``: how many times a block came onto / left the device (for tests and logs).
    """

    def __init__(self, lists: Sequence[BlockList], blocks_to_swap: int, device: torch.device | str,
                 split: str = "even") -> None:  # fmt: skip
        self.device = torch.device(device)
        self.counts = split_blocks_to_swap(blocks_to_swap, lists, split)
        self.asynchronous = self.device.type == "cuda"
        self.pinned = pins_host_memory(self.device)  # CUDA's (and the simulated device's, which counts them)
        self.stream = torch.cuda.Stream(self.device) if self.asynchronous else None
        self.moves_in = self.moves_out = 0
        self.swapped: list[_Swapped] = []
        self._handles: list[Any] = []
        self._settle_queued = False
        for li, (bl, count) in enumerate(zip(lists, self.counts)):
            blocks = list(bl.blocks)
            chain = [
                _Swapped(self, b, f"list {li} block {i}") for i, b in enumerate(blocks) if i >= len(blocks) - count
            ]
            for a, b in zip(chain, chain[1:]):
                a.next, b.prev = b, a
            for s in chain:
                self._handles.append(s.block.register_forward_pre_hook(s.before, with_kwargs=True))
                self._handles.append(s.block.register_forward_hook(s.after, with_kwargs=True, always_call=True))
            if chain:  # the last resident block fetches the first swapped one
                first = chain[0]
                resident = blocks[len(blocks) - count - 1]
                self._handles.append(resident.register_forward_pre_hook(lambda m, a, f=first: _fetch_in_forward(f)))
            self.swapped += chain

    @property
    def host_bytes(self) -> int:
        """Bytes of weights kept on the host."""
        return sum(s.nbytes for s in self.swapped)

    def place(self, model: nn.Module) -> None:
        """``model.to(device)`` except the swapped blocks' frozen weights, which go to (or stay on) the host: the
        device never holds the whole model (sd-scripts' ``move_to_device_except_swap_blocks``). Also hooks the model
        so that every forward starts with the swapped blocks on the host (``prepare_block_swap_before_forward``)."""
        on_host = {id(p) for s in self.swapped for p in s.params}
        with torch.no_grad():
            for module in model.modules():
                for p in module._parameters.values():
                    if p is not None and id(p) not in on_host and p.device != self.device:
                        _assign(p, p.data.to(self.device))
                for name, b in module._buffers.items():
                    if b is not None:
                        module._buffers[name] = b.to(self.device)
        for s in self.swapped:
            s.take_host()
        self._handles.append(model.register_forward_pre_hook(lambda m, a: self.settle()))
        self._handles.append(model.register_forward_hook(lambda m, a, o: self._drop_fetches(), always_call=True))
        logger.info("block swap: %d blocks (%s) kept on the host, %.2f GiB; the rest of the %s on %s",
                    len(self.swapped), " + ".join(map(str, self.counts)), self.host_bytes / 2**30,
                    type(model).__name__, self.device)  # fmt: skip

    def settle(self) -> None:
        """Every swapped block back on the host, fetches dropped (before each forward, at the end of each backward)."""
        for s in self.swapped:
            s.evict()
        self._settle_queued = False

    def _drop_fetches(self) -> None:
        for s in self.swapped:
            if not s.resident:
                s.pending = s.event = None

    def queue_settle(self) -> None:
        """Inside a backward pass: settle when it ends (blocks whose inputs need no gradient are sent back then)."""
        if not self._settle_queued:
            self._settle_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.settle)

    def remove(self) -> None:
        """Take the hooks off and put every weight back on the device."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for s in self.swapped:
            for p in s.params:
                _assign(p, p.data.to(self.device))
            s.resident, s.pending, s.event, s.storages = True, None, None, {}
        self.swapped = []


# ------------------------------------------------------------------------------------------------ offloaded checkpoints
def offloaded_checkpoint(module: nn.Module, *args: Any) -> Any:
    """diffusers' ``gradient_checkpointing_func`` for ``--cpu_offload_checkpointing``: torch's non-reentrant checkpoint
    of ``module(*args)`` that keeps host copies of the inputs on the autograd path (device tensors with
    ``requires_grad``) and runs the block, in forward and in its recompute, on device copies of them."""
    devices = [a.device if isinstance(a, Tensor) and a.requires_grad and a.device.type != "cpu" else None for a in args]
    kept = [a.to("cpu") if d is not None else a for a, d in zip(args, devices)]

    def run(*inputs: Any) -> Any:
        return module(*(x.to(d) if d is not None else x for x, d in zip(inputs, devices)))

    return torch.utils.checkpoint.checkpoint(run, *kept, use_reentrant=False)


def enable_offloaded_checkpointing(denoiser: nn.Module) -> None:
    """Gradient checkpointing of the denoiser's blocks with their saved inputs on the host (a diffusers model)."""
    enable = getattr(denoiser, "enable_gradient_checkpointing", None)
    if enable is None or not getattr(denoiser, "_supports_gradient_checkpointing", False):
        raise ValueError(f"--cpu_offload_checkpointing: {type(denoiser).__name__} does not support diffusers' "
                         "gradient checkpointing; remove the flag")  # fmt: skip
    enable(gradient_checkpointing_func=offloaded_checkpoint)
