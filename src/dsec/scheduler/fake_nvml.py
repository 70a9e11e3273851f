"""A faithful stand-in for the ``pynvml`` calls DSec makes, for machines without a GPU (tests, CI, the simulator).

It stands in for NVML: same function names, same argument order, same return shapes (objects with ``total``,
``busId`` bytes), NVMLError-like exceptions for unsupported queries and for calls before ``nvmlInit``. Build it from
a list of GPU specs; change ``throttle_reasons`` / ``ecc_uncorrected`` on a spec to simulate a sick device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_NVLINK_MAX_LINKS = 18
NVML_FEATURE_ENABLED = 1
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_Uninitialized(NVMLError):
    pass


@dataclass
class FakeGpu:
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_gb: float = 80.0
    numa_node: int | None = 0  # None: the driver does not report it (NotSupported)
    nvlink_to: list[int] = field(default_factory=list)  # indexes of NVLink peers, one link each
    throttle_reasons: int = 0
    ecc_uncorrected: int | None = 0  # None: ECC not supported


class FakeNvml:
    # The module-level constants of pynvml, as attributes (DSec reads them from the module object it is given).
    NVML_NVLINK_MAX_LINKS = NVML_NVLINK_MAX_LINKS
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_VOLATILE_ECC = NVML_VOLATILE_ECC

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self._init = 0

    def nvmlInit(self) -> None:
        self._init += 1

    def nvmlShutdown(self) -> None:
        if self._init == 0:
            raise NVMLError_Uninitialized("nvmlShutdown without nvmlInit")
        self._init -= 1

    def _check(self) -> None:
        if self._init == 0:
            raise NVMLError_Uninitialized("NVML is not initialized")

    def _gpu(self, handle: Any) -> FakeGpu:
        self._check()
        return self.gpus[int(handle.index)]

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(f"invalid device index {index}")
        return SimpleNamespace(index=index)

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        return self._gpu(handle).name.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        total = int(self._gpu(handle).memory_gb * 2**30)
        return SimpleNamespace(total=total, free=total, used=0)

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        numa = self._gpu(handle).numa_node
        if numa is None:
            raise NVMLError_NotSupported("NUMA node id not supported")
        return numa

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        self._gpu(handle)
        return SimpleNamespace(busId=f"00000000:{0x10 + int(handle.index):02X}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        gpu = self._gpu(handle)
        if not 0 <= link < NVML_NVLINK_MAX_LINKS:
            raise NVMLError(f"invalid link {link}")
        return NVML_FEATURE_ENABLED if link < len(gpu.nvlink_to) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any:
        gpu = self._gpu(handle)
        if link >= len(gpu.nvlink_to):
            raise NVMLError_NotSupported(f"link {link} is not active")
        return self.nvmlDeviceGetPciInfo(SimpleNamespace(index=gpu.nvlink_to[link]))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle).throttle_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int:
        ecc = self._gpu(handle).ecc_uncorrected
        if ecc is None:
            raise NVMLError_NotSupported("ECC not supported")
        return ecc
