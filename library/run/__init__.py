"""The run layer: what every training script shares, whatever the family and the method.

``config`` reads the flags into a run, ``setup`` sets it up and places the parts, ``loop`` / ``trainer`` are the
loop, ``train_step`` one step's loss (asking the family's objective), ``trainable`` / ``model_trainable`` the
methods' seam (adapter, embedding, whole model), ``run_files`` / ``run_metadata`` / ``resume`` what a run writes and
reads back; ``runtime``, ``args``, ``trackers``, ``ema``, ``engines`` and ``block_swap`` what they use.
"""
