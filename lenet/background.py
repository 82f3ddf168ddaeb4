"""Writing files off the training loop's critical path: one worker thread, jobs in order.

Note [background writes]: a checkpoint (fsync of the file and its folder) and a (then matplotlib)
plot take tens to hundreds of milliseconds; written after every epoch on the loop's thread
they cost more than an epoch of LeNet on a fast GPU. The loop now takes the host copy of the
state (a device-to-host copy of ~250 KB, which must see the step's results) and hands the
writing to this thread. A job of a kind still waiting when a newer one of the same kind
arrives is replaced by it (only the newest checkpoint matters). ``wait()`` runs at the end
of a run and before the loop writes anything itself (a stop by a signal), so the files are
complete when the program says it wrote them; the first error a job raised is raised there,
on the caller's thread. Each job is atomic (lenet/files.py), so a run killed while a job runs
leaves the previous file whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class Background:
    """Runs ``submit(kind, fn)`` jobs on one daemon thread, in order, newest of a kind winning."""

    def __init__(self, name: str = "lenet-writer"):
        self._jobs: OrderedDict = OrderedDict()   # kind -> fn, in submission order
        self._cv = threading.Condition()
        self._busy = False
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, kind: str, fn) -> None:
        self._raise()
        with self._cv:
            if self._closed:
                raise RuntimeError("the background writer is closed")
            self._jobs.pop(kind, None)   # a newer job of the same kind replaces a waiting one
            self._jobs[kind] = fn
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every submitted job has run (True), or ``timeout`` seconds (False); then raises
        the first error a job raised."""
        with self._cv:
            done = self._cv.wait_for(lambda: not self._jobs and not self._busy, timeout)
        self._raise()
        return done

    def close(self, timeout: float | None = None) -> bool:
        """Run what is queued, then stop the thread; False if it did not finish within ``timeout``."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        alive = self._thread.is_alive()
        if not alive:
            self._raise()
        return not alive

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return   # closed and drained
                _, fn = self._jobs.popitem(last=False)
                self._busy = True
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                if self._error is None:
                    self._error = e
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
