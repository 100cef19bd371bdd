"""sdtrain's shared library: flags, configs, families, data, noise, losses, optimizers, sampling, weight files."""

import logging

# bitsandbytes warns at import, on CPUs with AVX512-BF16, that an optional 4-bit CPU kernel package is missing; sdtrain
# never uses 4-bit CPU matmuls, so the advice ("pip install kernels") would only mislead.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from library import deferred_imports  # noqa: E402
from library.logs import quiet_libraries  # noqa: E402

deferred_imports.install()  # diffusers' model subpackages import only the classes a run uses

quiet_libraries()  # transformers' torchvision notices, diffusers' float32 note: nothing a user can act on
