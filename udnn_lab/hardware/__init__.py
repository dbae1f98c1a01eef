"""Hardware profiles: sourced figures of a device (bandwidths, FLOP rates, memory), and measuring one.

May import: devices, units and errors.
"""

from udnn_lab.hardware.profiles import Hardware, HardwareMismatchWarning, HardwareProfileError, UnknownHardwareError

__all__ = ["Hardware", "HardwareMismatchWarning", "HardwareProfileError", "UnknownHardwareError"]
