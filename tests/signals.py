"""What a test (tests/test_hostile_cpu.py) and the probe beside it (scripts/signal_loop.py) read of a child
process's signals (Note [signals from the first line] in lenet/interrupt.py)."""

from __future__ import annotations

import signal


def guarded(pid: int) -> bool:
    """Whether process ``pid`` has run our first line (interrupt.guard): SIGTERM caught or held back, which
    Python's own start never does. A process already gone (a zombie, whose caught signals read 0) counts as
    guarded: the stricter reading for a test that sends it a signal."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        held = int(fields["SigCgt"], 16) | int(fields["SigBlk"], 16)
    except (OSError, KeyError, ValueError):
        return True
    return bool(held & (1 << (signal.SIGTERM - 1))) or fields.get("State", "").strip().startswith("Z")
