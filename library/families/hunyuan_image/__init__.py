"""HunyuanImage 2.1 (Tencent): building blocks, not yet a registered family.

Modules: ``keys`` (Tencent <-> diffusers transformer names, the fused modules), ``objective`` (sd-scripts'
HunyuanImage rectified flow), ``tiny`` (test models). ``FAMILIES`` is not defined yet, so the registry does not list
the family: loading, text encoders (Qwen2.5-VL from ``library/families/encoders``, byT5 Glyph), the VAE's key map and
the entry scripts are still to come (see docs/hunyuan_image.md).
"""
