"""Where tensors live and in what form: ``placement`` (parts on and off the accelerator for a phase), ``fp8``
(frozen weights stored in float8), ``rng`` (every random state a step reads, captured and restored), ``host`` (the
process's heap settings and CPU threads)."""
