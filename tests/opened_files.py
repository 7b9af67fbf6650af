"""``opened_files()``: every file the Python side of this process opens inside the ``with`` (resolved paths), seen
by an audit hook. An audit hook cannot be removed, so it is installed once, on import, and records only while
asked to. Files opened by native code (safetensors' Rust reader) are not seen: tests that need those check the
values read instead."""
import contextlib
import os
import sys

_opened = None


def _audit(event, args):
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


@contextlib.contextmanager
def opened_files():
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None
