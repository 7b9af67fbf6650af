"""Progress lines for long model-level calls (``from_pretrained``, ``quantize_``, ``save_quantized``): what a user of
transformers' loading bar expects to see, without a bar library.

A line is ``torch_lowbit <what>: <done>/<total> <unit>`` on stderr, at most one a second plus a last one when the work
ends, and only where stderr is a terminal (logs and CI stay clean). ``TORCH_LOWBIT_PROGRESS=0`` silences it,
``=1`` prints even when stderr is not a terminal (the bench suites set it for their own runs).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

ENV = "TORCH_LOWBIT_PROGRESS"


def progress_enabled(stream: Optional[TextIO] = None) -> bool:
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting in ("1", "true", "yes", "on"):
        return True
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


class Progress:
    """Counts units of work and prints where it stands at most once per ``interval`` seconds.

    Use as a context manager (the last line is printed on exit, also after an error, so the user sees where it
    stopped) or call :meth:`close`. ``total`` may be None when unknown; ``update(n)`` adds n done units.
    """

    def __init__(self, what: str, total: Optional[int] = None, unit: str = "", *, stream: Optional[TextIO] = None,
                 interval: float = 1.0, enabled: Optional[bool] = None, clock=time.monotonic):
        self.what, self.total, self.unit = what, total, unit
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self.stream) if enabled is None else bool(enabled)
        self.interval = float(interval)
        self.done = 0
        self.lines = 0
        self._clock = clock
        self._start = clock()
        self._last: Optional[float] = None
        self._closed = False

    def line(self) -> str:
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        unit = f" {self.unit}" if self.unit else ""
        return f"torch_lowbit {self.what}: {count}{unit} ({self._clock() - self._start:.1f} s)"

    def _emit(self):
        try:
            print(self.line(), file=self.stream, flush=True)
        except (ValueError, OSError):  # the stream went away: progress is never worth an exception
            self.enabled = False
            return
        self.lines += 1
        self._last = self._clock()

    def update(self, n: int = 1):
        self.done += n
        if not self.enabled or self._closed:
            return
        now = self._clock()
        if self._last is None and now - self._start < self.interval:
            return  # quick work prints only its last line
        if self._last is None or now - self._last >= self.interval:
            self._emit()

    def close(self):
        if self._closed:
            return
        self._closed = True
        # a final line only where the work took long enough to be worth one (quick calls stay silent)
        if self.enabled and (self._last is not None or self._clock() - self._start >= self.interval):
            self._emit()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
