"""Dataset preparation for fine-tuning with a metadata JSON: sd-scripts' finetune/ scripts."""
