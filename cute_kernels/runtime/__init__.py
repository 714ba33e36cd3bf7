from .arch import (SUPPORTED_ARCHS, UnsupportedDeviceError, device_arch, device_kind, import_cutlass, sm_count,
                   target_arch)

__all__ = ["SUPPORTED_ARCHS", "UnsupportedDeviceError", "device_arch", "device_kind", "import_cutlass", "sm_count",
           "target_arch"]
