"""SD3 medium, SD3.5 medium and SD3.5 large: see ``family.py``.

Modules: ``keys`` (SAI <-> diffusers names, fused modules), ``configs`` (the released models' configs).
"""
