"""sdtrain's shared library: flags, configs, families, data, noise, losses, optimizers, sampling, weight files.

Importing it changes nothing in the process (no import hooks, no logging or allocator settings): what a run sets,
its setup sets (library/run/setup.py, library/run/runtime.py)."""
