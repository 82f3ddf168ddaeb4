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
# object is destroyed exactly once. The lock is reentrant: the garbage collector can run a
# finalizer (which releases an object) inside the registering thread's critical section.
_live: dict[str, set[int]] = {}
_live_lock = threading.RLock()


def live_objects() -> Counter:
    """How many cuDNN objects of each kind are alive now."""
    with _live_lock:
        return Counter({k: len(v) for k, v in _live.items() if v})


def _register(kind: str, key: int) -> None:
    with _live_lock:
        _live.setdefault(kind, set()).add(key)


def _release(kind: str, key: int, destroy=None) -> None:
    with _live_lock:
        keys = _live.get(kind, set())
        if key not in keys:
            raise RuntimeError(f"cuDNN {kind} at {key:#x} destroyed twice")
        keys.remove(key)
    if destroy is not None:
        destroy()


class Owned:
    """The shared lifetime idiom: ``close()``, ``with``, ``closed``, and the live-object count.

    Subclasses call ``_own(kind, key, destroy)`` once their object exists; ``destroy`` (a
    callable holding no reference to ``self``) runs exactly once.
    """

    _kind: str = ""

    def _own(self, key: int, destroy=None) -> None:
        _register(self._kind, key)
        self._key = key
        self._finalizer = weakref.finalize(self, _release, self._kind, key, destroy)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ValueError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Destroy the object now (later calls do nothing)."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CudnnObject(Owned):
    """Owns one cuDNN descriptor-API object. Subclasses name the create/destroy functions."""

    _create_fn: str = ""     # defaults to cudnnCreate{kind}Descriptor
    _destroy_fn: str = ""

    def __init__(self) -> None:
        create = self._create_fn or f"cudnnCreate{self._kind}Descriptor"
        destroy = self._destroy_fn or f"cudnnDestroy{self._kind}Descriptor"
        out = ctypes.c_void_p()
        _lib.call(create, ctypes.byref(out))
        ptr = int(out.value)
        self._ptr = ptr
        self._own(ptr, lambda: _lib.call(destroy, ptr))

    @property
    def ptr(self) -> int:
        """The raw cuDNN pointer; raises once the object is closed."""
        self._check_open()
        return self._ptr
