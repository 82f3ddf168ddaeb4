"""Eager or CUDA graph, per batch size: the one place a step is captured and replayed.

Note [re-capture]: a CUDA graph holds the device pointers it was captured with. Every buffer
of the model is allocated once, at construction, except the convolution workspace, which
planning a new batch size may grow (descriptors.Workspace frees the old buffer and counts a
new generation). A graph captured with an older generation would read freed memory, so it
is captured again before its next replay.
"""

from __future__ import annotations


class Runner:
    """Runs ``fn`` (a whole step) eagerly, or replays the CUDA graph captured for ``key``.

    ``save``/``restore`` snapshot the state a step changes: the graph is captured after one
    eager warm-up run (kernel compilation and lazy library initialization must stay out of
    the capture), whose effect is then undone.
    """

    def __init__(self, stream, workspace, save, restore):
        self.stream, self.workspace = stream, workspace
        self._save, self._restore = save, restore
        self._graphs: dict = {}   # key -> (graph, workspace generation)
        self.captures = 0

    def run(self, key, fn, graph: bool) -> None:
        if not graph:
            fn()
            return
        entry = self._graphs.get(key)
        if entry is None or entry[1] != self.workspace.generation:   # see Note [re-capture]
            entry = self._graphs[key] = (self._capture(fn), self.workspace.generation)
        entry[0].launch(stream=self.stream)

    def _capture(self, fn):
        state = self._save()
        fn()
        self._restore(state)
        self.stream.synchronize()
        self.stream.begin_capture()
        try:
            fn()
        finally:
            graph = self.stream.end_capture()
        self.captures += 1
        return graph

    def clear(self) -> None:
        self._graphs.clear()
