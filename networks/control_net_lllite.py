"""sd-scripts' module name for ControlNet-LLLite (``networks/control_net_lllite.py``): the network is
``networks.lllite`` (an ``LLLiteLayer`` holds each adapted Linear; the file keys are sd-scripts')."""

from networks.lllite import LLLiteLayer as LLLiteModule
from networks.lllite import LLLiteNetwork as ControlNetLLLite
from networks.lllite import dims_of_file, find_targets

__all__ = ["ControlNetLLLite", "LLLiteModule", "dims_of_file", "find_targets"]
