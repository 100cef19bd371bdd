"""The command line every script shares: ``parse`` (argparse with ``--config_file`` TOML, flags refused or without
effect, namespace -> frozen dataclass), ``problems`` (every input problem at once, "did you mean"), ``console`` (log
lines above the progress bar, the console flags), ``main_guard`` (exit statuses: an input error is one ``error:``
line), ``deferred_imports`` (start-up: diffusers imports only the model classes a run uses)."""
