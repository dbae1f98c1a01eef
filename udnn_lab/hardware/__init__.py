"""Hardware profiles: sourced figures of a device (bandwidths, FLOP rates, memory), and measuring one.

May import: devices, units, errors and vocabulary.
"""

from udnn_lab.hardware._dispatch_probe import PassThroughMode
from udnn_lab.hardware.host_probes import (
    HOOKS_BY_PATH,
    HostFigures,
    ProbedStep,
    register_host_probe,
    register_step_probe,
)
from udnn_lab.hardware.profiles import Hardware, HardwareMismatchWarning, HardwareProfileError, UnknownHardwareError
from udnn_lab.hardware.this_machine import (
    CACHE_VARIABLE,
    CHOICES,
    HARDWARE_VARIABLE,
    PREDICTED_DEVICE,
    MachineDevice,
    ShippedProfileWarning,
    cache_dir,
    machine_hardware,
)

__all__ = ["CACHE_VARIABLE", "CHOICES", "HARDWARE_VARIABLE", "HOOKS_BY_PATH", "Hardware", "HardwareMismatchWarning",
           "HardwareProfileError", "HostFigures", "MachineDevice", "PassThroughMode", "PREDICTED_DEVICE", "ProbedStep",
           "ShippedProfileWarning", "UnknownHardwareError", "cache_dir", "machine_hardware", "register_host_probe",
           "register_step_probe"]
