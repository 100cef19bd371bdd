"""Text encoders several families share: ``clip`` (CLIP-L, CLIP-G) and ``t5`` (T5-XXL): their configs, single files,
tokenizers and outputs. A family folder uses these, never another family's encoder code."""
