"""The errors descriptors/ raises. Each one reads as a plain sentence."""

from __future__ import annotations


class CudnnError(RuntimeError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS.

    Carries the status code and name, the cuDNN function, the arguments that
    matter (shapes, pads, strides, ...) and cuDNN's own explanation from
    cudnnGetLastErrorString.
    """

    def __init__(self, status: int, status_name: str, function: str,
                 info: dict | None = None, explanation: str = ""):
        self.status = int(status)
        self.status_name = status_name
        self.function = function
        self.info = dict(info or {})
        self.explanation = explanation.strip()
        args = ", ".join(f"{k}={v}" for k, v in self.info.items())
        msg = f"{status_name} ({self.status}) from {function}({args})"
        msg += f": {self.explanation}" if self.explanation else ": cuDNN gave no explanation"
        super().__init__(msg)

    @property
    def category(self) -> int:
        """The status category: 1000 init, 2000 bad param, 3000 not supported, ..."""
        return self.status // 1000 * 1000

    @property
    def is_bad_param(self) -> bool:
        return self.category == 2000

    @property
    def is_not_supported(self) -> bool:
        return self.category == 3000

    @property
    def is_execution_failure(self) -> bool:
        # CUDNN_STATUS_EXECUTION_FAILED and its sub-codes (5000-range)
        return self.category == 5000

    @property
    def is_alloc_failure(self) -> bool:
        # CUDNN_STATUS_INTERNAL_ERROR_{HOST,DEVICE}_ALLOCATION_FAILED
        return self.status in (4003, 4004)


class NoGpuError(RuntimeError):
    """No usable NVIDIA GPU: says what was checked and what failed."""


class CudnnLoadError(RuntimeError):
    """libcudnn could not be found or is too old."""
