"""sdtrain's shared library: argument groups, configs, model families, data, noise, losses, optimizers, sampling,
checkpoints and the training session."""

import logging

# bitsandbytes warns at import, on CPUs with AVX512-BF16, that an optional 4-bit CPU kernel package is missing; sdtrain
# never uses 4-bit CPU matmuls, so the advice ("pip install kernels") would only mislead.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
