from .arch import SUPPORTED_ARCHS, UnsupportedDeviceError, device_arch, import_cutlass, target_arch

__all__ = ["SUPPORTED_ARCHS", "UnsupportedDeviceError", "device_arch", "import_cutlass", "target_arch"]
