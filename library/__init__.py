"""sdtrain's shared library: flags, configs, families, data, noise, losses, optimizers, sampling, weight files."""

from library import deferred_imports

deferred_imports.install()  # diffusers' model subpackages import only the classes a run uses
