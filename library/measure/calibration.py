"""From the simulated device's count to what a CUDA card holds: named terms, each documented, applied per phase.

The simulated device counts the bytes of the tensors a run keeps on the device (``max_memory_allocated`` without the
allocator's rounding). A CUDA run holds more, and each term below is one cause, applied to a phase by what ran in it
(``PhaseFacts``: the kernel families the phase ran, its largest convolution output, how many storages were alive at
its peak):

``round_bytes``
    the caching allocator rounds every allocation up to a multiple of 512 B: on average half of it per live storage
    (``max_memory_allocated`` includes it).
``cublas_workspace_mib``
    cuBLAS / cuBLASLt keep a workspace per stream and handle once a matmul ran (allocated through the caching
    allocator since torch 1.11; 32 MiB on Hopper with torch's default ``CUBLAS_WORKSPACE_CONFIG``).
``cudnn_workspace_per_output``
    cuDNN's convolution algorithms take a workspace that grows with the convolution: modelled as a multiple of the
    largest convolution output of the phase. Set from the one real-GPU run of issue 38 (an H200): the sampling round's
    VAE decode held 0.56 GB (SD1.5, 512 px) and 2.0 GB (SDXL, 1024 px) more than the count, 4.2 and 3.7 times the
    decoder's largest float32 activation (128 x 512 x 512 and 128 x 1024 x 1024).
``attention_workspace_mib``
    the fused attention kernels' temporaries (softmax statistics, the flash / memory-efficient kernels' scratch).
``fragmentation``
    reserved but unused blocks of the caching allocator (2 MiB segments for small tensors, 20 MiB for 1-10 MiB ones,
    split large blocks): a share of the allocated peak. The same run read the simulated SD1.5 / SDXL step 3-7 % low
    and the caching phases 4-18 % low against ``max_memory_reserved``.
``context_mib``
    the CUDA context (driver, loaded kernel modules): outside ``max_memory_reserved``, but on the card
    (``nvidia-smi`` shows it; 300-500 MiB on recent drivers).

The constants are placeholders set from that one run: ``benchmarks/gpu_check.sh`` measures planned against
``max_memory_allocated`` / ``max_memory_reserved`` per phase on any lent GPU and writes
``benchmarks/results/gpu_memory.json``; :func:`from_measurements` reads the terms from there when it exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

MIB = 2**20
MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_memory.json"


@dataclass(frozen=True)
class Calibration:
    """The terms (module docstring). PLACEHOLDERS until benchmarks/results/gpu_memory.json gives measured values."""

    round_bytes: int = 512
    cublas_workspace_mib: float = 32.0
    cudnn_workspace_per_output: float = 4.0
    attention_workspace_mib: float = 16.0
    fragmentation: float = 0.05
    context_mib: float = 400.0


@dataclass
class PhaseFacts:
    """What the calibration needs to know of a phase, kept by the plan's simulated device."""

    kernels: set[str] = field(default_factory=set)  # "matmul", "convolution", "attention"
    largest_conv_output: int = 0  # bytes
    storages_at_peak: int = 0


def reserved_bytes(counted: int, facts: PhaseFacts, cal: Calibration) -> dict[str, int]:
    """The terms for one phase (bytes), ``allocated`` (what ``max_memory_allocated`` would read) and ``reserved``
    (``max_memory_reserved``); ``card`` adds the context."""
    terms = {"counted": counted, "rounding": facts.storages_at_peak * cal.round_bytes // 2}
    if "matmul" in facts.kernels:
        terms["cublas workspace"] = int(cal.cublas_workspace_mib * MIB)
    if "convolution" in facts.kernels:
        terms["cudnn workspace"] = int(cal.cudnn_workspace_per_output * facts.largest_conv_output)
    if "attention" in facts.kernels:
        terms["attention workspace"] = int(cal.attention_workspace_mib * MIB)
    allocated = sum(terms.values())
    terms["allocated"] = allocated
    terms["fragmentation"] = int(allocated * cal.fragmentation)
    terms["reserved"] = allocated + terms["fragmentation"]
    terms["card"] = terms["reserved"] + int(cal.context_mib * MIB)
    return terms


def from_measurements(path: Path = MEASURED) -> Calibration:
    """The terms measured on a GPU (``{"calibration": {term: value}}`` in ``path``), else the placeholders."""
    if not path.is_file():
        return Calibration()
    known = {f.name for f in fields(Calibration)}
    measured = json.loads(path.read_text()).get("calibration", {})
    return replace(Calibration(), **{k: v for k, v in measured.items() if k in known})
