"""Weight files: ``weights`` (safetensors / pickles read with ``weights_only=True``, atomic writes, streamed saves)
and ``metadata`` (sd-scripts' ``ss_*`` keys, ModelSpec, the ``sshs_*`` hashes)."""
