"""The run layer: what every training script shares, whatever the family and the method.

``train_setup`` reads the flags into a run and places the parts, ``trainer`` is the loop, ``train_step`` one step's
loss (asking the family's objective), ``trainable`` / ``model_trainable`` the methods' seam (adapter, embedding,
whole model), ``run_files`` / ``run_metadata`` / ``resume`` what a run writes and reads back.
"""
