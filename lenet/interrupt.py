"""A program's signals from its first line to its last: SIGINT or SIGTERM gives one line and exit status
130 or 143, never a traceback and never a hang.

Note [signals from the first line]: Python's own SIGINT handler raises KeyboardInterrupt wherever the
main thread happens to be: inside an import (a traceback of 10 to 60 lines), or nowhere at all when the
main thread waits on a lock another thread holds (a start-up thread inside an import, a reader in
np.load): a Ctrl-C 0.35-0.5 s into a run hung it 3 times in about 110, once for 657 s, and further
SIGINTs did nothing. So a program ``guard()``s itself first: the signals' Python handler does nothing,
and Python's C-level handler writes each signal's number to a pipe (signal.set_wakeup_fd) that a thread
of ours reads; that thread acts, whatever the main thread is doing. It prints one line and leaves through
os._exit with 128 + the signal's number, once the writes in flight have ended or been removed (Note
[atomic writes] in lenet/files.py): no temporary file stays behind. A program that stops gracefully
(lenet.train finishes its step and writes a checkpoint: Note [stopping] there) ``hand_over()``s the first
signal to its own handler; the second still ends the process at once, from here. The thread imports
nothing once started, so it cannot wait on an import lock itself.

Note [a signal while guarding]: a SIGINT that came between set_wakeup_fd and the Python handler's
replacement met Python's own handler: a KeyboardInterrupt traceback from guard() and exit status -2
(tests/test_hostile_cpu.py, a SIGINT 0.1 s in, once in a CI run). So guard() blocks SIGINT and SIGTERM
while it sets up (pthread_sigmask; the main thread is the process's only one then) and restores the mask
once the pipe, the handlers and the thread are in place: a signal that came meanwhile is delivered then,
to the pipe, and handled as any later one. The package's first line holds them back already, before any
import of ours (Note [a signal before the handlers] in lenet/__init__.py), and guard() restores the mask
that line found. Before that line (the interpreter's start, site, runpy finding the module), Python's own
handling stays.

Note [one last line]: a run says one last line, its own (an error, through ``last_line``) or a signal's,
never both: a SIGINT that came while a run without a GPU printed its error, and waited for its cache
writes, added "interrupted by SIGINT" under it. Once the program's line is out, a signal cuts the writes
short (their temporaries removed) and leaves with the program's status, silently.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

GRACE_S = 2.0   # a program that stops gracefully gets this long to leave by itself on a second signal

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
_state = {"installed": False, "handed": False, "seen": 0, "prog": "", "leaving": None}
_before_exit = []   # callables run (briefly) before leaving: what is being written finishes or goes


def _ignore(signum, frame) -> None:
    """The Python-level handler: the thread below acts (Note [signals from the first line])."""


def guard(prog: str = "", restore=None) -> None:
    """Install the handling above, once per process (``prog``: the program's name in its line; ``restore``:
    the signal mask to restore once it is in place, where the package's first line held the signals back
    already: Note [a signal before the handlers] in lenet/__init__.py)."""
    if prog:
        _state["prog"] = prog
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        if restore is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, restore)
        return
    # Held back while the handling is put in place (Note [a signal while guarding]): one that comes now
    # is delivered when the mask is restored, to the pipe and the thread.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(NAMES)) if hasattr(signal, "pthread_sigmask") else None
    if restore is not None:
        mask = restore
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            for s in NAMES:
                signal.signal(s, _ignore)
        except (ValueError, OSError):   # not the main interpreter, or no signals here: Python's defaults stay
            os.close(r)
            os.close(w)
            return
        _state["installed"] = True
        threading.Thread(target=_watch, args=(r,), name="lenet-signals", daemon=True).start()
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def installed() -> bool:
    return _state["installed"]


def hand_over(on: bool = True) -> None:
    """Let the program's own handler take the first SIGINT or SIGTERM (on), or take them back (off)."""
    _state["handed"], _state["seen"] = bool(on), 0


_exit_lock = threading.Lock()   # one last line: the program's own, or a signal's


def last_line(text: str | None, code: int) -> None:
    """The program's last line (``text`` to stderr, if any), and from now on it leaves with ``code`` once its
    writes in flight end (lenet.cli.leave): a signal meanwhile cuts them short (their temporaries removed)
    and leaves with that status, without a second line. Where a signal's line came first, nothing is printed
    and this waits for that thread to end the process: one line either way."""
    with _exit_lock:
        if not _state.get("signalled"):
            if _state["leaving"] is not None:   # this program's own last line was said already
                return
            if text:
                try:
                    sys.stderr.write(text if text.endswith("\n") else text + "\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
            _state["leaving"] = code
            return
    if not _state["installed"]:
        return
    while True:   # the signal's thread is leaving the process (os._exit)
        time.sleep(1.0)


def before_exit(fn) -> None:
    """Run ``fn()`` before leaving on a signal (each at most once; exceptions ignored)."""
    _before_exit.append(fn)


def _watch(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signum not in NAMES:
                continue
            _state["seen"] += 1
            if _state["handed"] and _state["seen"] < 2:
                continue   # the program's handler stops it gracefully (lenet.train: Note [stopping])
            if _state["handed"]:
                time.sleep(GRACE_S)   # its handler leaves at once on the second: with its own line, if it can
            leave(signum)


def leave(signum: int) -> None:
    """One line, the writes in flight finished or removed, then exit 128 + signum without teardown (or, where
    the program was leaving already, with its own status and no line: ``leaving``)."""
    prog = _state["prog"] or _program_name()
    what = "a second " if _state["handed"] else ""
    line = f"{prog}: interrupted by {what}{NAMES.get(signum, signum)}\n"
    with _exit_lock:   # the program's own last line, or this one (last_line)
        code = _state["leaving"]
        _state["signalled"] = True
        if code is None:
            _state["leaving"] = 128 + signum
            try:
                os.write(2, line.encode())
            except OSError:
                pass
    while _before_exit:
        try:
            _before_exit.pop()()
        except BaseException:   # noqa: BLE001 - leaving regardless
            pass
    os._exit(128 + signum if code is None else code)


def _program_name() -> str:
    orig = getattr(sys, "orig_argv", [])
    if len(orig) > 2 and orig[1] == "-m" and orig[2].startswith("lenet"):   # python -m lenet.PROGRAM, however early
        return f"python -m {orig[2]}"
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    parent, base = os.path.split(argv0)
    if base.endswith(".py") and os.path.basename(parent) == "lenet":
        return f"python -m lenet.{base[:-3]}"
    return base if base.startswith("lenet") else "lenet"
