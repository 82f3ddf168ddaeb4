"""One lifetime idiom for every cuDNN object: create in __init__, destroy exactly
once through ``weakref.finalize`` (on ``close()``, on leaving a ``with`` block, or
when the object is collected)."""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import Counter

from . import _lib

# Every live cuDNN object, by kind: lets a test (or a leak hunt) see that each
# object is destroyed exactly once.
_live: dict[str, set[int]] = {}
_live_lock = threading.Lock()


def live_objects() -> Counter:
    """How many cuDNN objects of each kind are alive now."""
    with _live_lock:
        return Counter({k: len(v) for k, v in _live.items() if v})


def _destroy(kind: str, destroy_fn: str, ptr: int) -> None:
    with _live_lock:
        ptrs = _live.get(kind, set())
        if ptr not in ptrs:
            raise RuntimeError(f"cuDNN {kind} at {ptr:#x} destroyed twice")
        ptrs.remove(ptr)
    _lib.call(destroy_fn, ptr)


class CudnnObject:
    """Owns one cuDNN object. Subclasses name the create/destroy functions."""

    _kind: str = ""          # e.g. "Tensor": cudnnCreateTensorDescriptor / cudnnDestroy...
    _create_fn: str = ""     # defaults to cudnnCreate{kind}Descriptor
    _destroy_fn: str = ""

    def __init__(self) -> None:
        create = self._create_fn or f"cudnnCreate{self._kind}Descriptor"
        destroy = self._destroy_fn or f"cudnnDestroy{self._kind}Descriptor"
        out = ctypes.c_void_p()
        _lib.call(create, ctypes.byref(out))
        ptr = int(out.value)
        with _live_lock:
            _live.setdefault(self._kind, set()).add(ptr)
        self._ptr = ptr
        self._finalizer = weakref.finalize(self, _destroy, self._kind, destroy, ptr)

    @property
    def ptr(self) -> int:
        """The raw cuDNN pointer; raises once the object is closed."""
        if not self._finalizer.alive:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Destroy the cuDNN object now (later calls do nothing)."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
