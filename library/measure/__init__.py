"""Measuring memory: ``phases`` (device peaks per phase of a run), ``simulated_device`` (the meta device standing in
for a GPU, CUDA's device rule enforced, device bytes counted), ``tensor_memory`` (what tensors are alive). No run
imports these; tests and benchmarks do."""
