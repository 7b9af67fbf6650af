"""Progress lines of the model-level calls: at most one a second, silent when stderr is no terminal."""
import io

import pytest

from torch_lowbit._progress import ENV, Progress, progress_enabled


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_prints_at_most_one_line_a_second_and_a_last_one():
    clock, out = FakeClock(), Tty()
    with Progress("loading", total=10, unit="tensors", stream=out, clock=clock) as p:
        for _ in range(10):
            clock.t += 0.3
            p.update()
    lines = out.getvalue().splitlines()
    # 3.0 s of work: lines at 1.2 s, 2.4 s (one a second at most) and the last at 3.0 s
    assert len(lines) == 3
    assert lines[0].startswith("torch_lowbit loading: 4/10 tensors")
    assert lines[-1].startswith("torch_lowbit loading: 10/10 tensors")


def test_quick_work_prints_nothing():
    clock, out = FakeClock(), Tty()
    with Progress("saving", total=3, stream=out, clock=clock) as p:
        for _ in range(3):
            clock.t += 0.1
            p.update()
    assert out.getvalue() == ""


def test_no_terminal_no_lines(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    clock, out = FakeClock(), io.StringIO()  # not a terminal
    with Progress("quantize_", total=5, stream=out, clock=clock) as p:
        for _ in range(5):
            clock.t += 2
            p.update()
    assert out.getvalue() == ""


@pytest.mark.parametrize("value, tty, expected", [("0", True, False), ("1", False, True), ("", True, True),
                                                  ("", False, False)])
def test_environment_overrides_the_terminal_test(monkeypatch, value, tty, expected):
    monkeypatch.setenv(ENV, value)
    assert progress_enabled(Tty() if tty else io.StringIO()) is expected


def test_a_closed_stream_never_raises():
    clock, out = FakeClock(), Tty()
    p = Progress("loading", total=2, stream=out, clock=clock)
    out.close()
    clock.t += 5
    p.update()
    p.close()
    assert p.lines == 0
