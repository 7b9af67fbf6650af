"""How much resident memory a load adds at its peak, measured in a fresh Python process (Linux: /proc/self).

The peak is the process's own high-water mark, VmHWM, reset to the current size just before the load by writing "5"
to /proc/self/clear_refs (Linux >= 4.0). Not ru_maxrss: a child started by vfork + exec inherits its parent's peak
there, so under a large pytest process it reported 2.7x for a load that peaks at 0.97x. The same load of a small
checkpoint runs first (`warmup`): imports, the ops' first calls and the libraries' own caches are paid before the
baseline, so what is measured grows with the checkpoint."""
import os
import subprocess
import sys
import textwrap

import pytest

import torch_lowbit

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and clear_refs")

_SCRIPT = """
import gc, sys
def status(field):  # bytes
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024
{warmup}
gc.collect()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
{load}
peak = status("VmHWM")
print("PEAK", peak - before, {report})
"""


def peak_growth(cwd, warmup: str, load: str, report=(), args=(), timeout: int = 180):
    """(peak growth in bytes, [the ints the expressions `report` evaluate to after the load]) of running `load`
    (Python source; the files it reads are sys.argv[1:] = `args`) after `warmup`, in a minimal environment and
    directory of its own."""
    script = _SCRIPT.format(warmup=textwrap.dedent(warmup), load=textwrap.dedent(load), report=", ".join(report))
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in os.environ}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(torch_lowbit.__file__))
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith("PEAK "))
    values = [int(v) for v in line.split()[1:]]
    return values[0], values[1:]
