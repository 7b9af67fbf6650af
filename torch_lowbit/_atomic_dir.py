"""Atomic directory writes: a checkpoint is written into a temporary directory beside its target, then swapped in.

After :func:`atomic_directory` returns, the target holds exactly the new checkpoint plus the files of the old
directory that are not part of a model checkpoint (see :func:`is_checkpoint_file`); if the writer raises, or the
process dies at any point, the target holds the old directory untouched or the complete new one, never a mix.

How the swap is done: Linux ``renameat2(RENAME_EXCHANGE)``, macOS ``renamex_np(RENAME_SWAP)`` exchange the two
directories in one step. Where neither exists (or the filesystem refuses it) two renames are used -- target aside,
new in place -- and a crash between them leaves no directory at the target, the old one beside it under
``.<name>.torch_lowbit-old.*`` and the new one under ``.<name>.torch_lowbit-tmp.*``; never a mix.

Links: nothing is ever written through a link. Links inside the target (``config.json`` pointing elsewhere) are
checkpoint files or carried entries: a checkpoint file is replaced by the new real file, a carried link is carried
as a link. A target that is itself a symlink to a directory: the directory it points to is replaced and the link
keeps pointing at it (the temporary directory is created beside that directory, on its filesystem).

Temporary directories are named ``.<name>.torch_lowbit-tmp.<host>.<pid>.<random>``; a save removes them after
success or an exception, and removes those a killed process (same host, pid no longer running) left behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fnmatch
import os
import shutil
import socket
import sys
import tempfile
from typing import Callable, Iterator, Optional

# Names that belong to a model checkpoint: weights in any format transformers / PEFT / torch_lowbit write, their
# indexes, and the configs that say how to read them. They are replaced as a set; everything else in the target
# (tokenizer files, chat templates, README.md, a user's notes, sub-directories) is carried into the new directory.
# Adapter files count: a leftover adapter_config.json would make transformers load the old adapter onto the new model.
CHECKPOINT_PATTERNS = (
    "config.json", "generation_config.json", "hf_quant_config.json", "quantization_config.json",
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json",
    "tf_model*.h5", "tf_model*.h5.index.json", "flax_model*.msgpack", "flax_model*.msgpack.index.json",
    "adapter_config.json", "adapter_model.bin", "adapter_model.safetensors",
)

_TMP_TAG = "torch_lowbit-tmp"
_OLD_TAG = "torch_lowbit-old"


def is_checkpoint_file(name: str) -> bool:
    """Is `name` (an entry of a checkpoint directory) part of the model checkpoint, i.e. replaced by a save?"""
    return any(fnmatch.fnmatchcase(name, p) for p in CHECKPOINT_PATTERNS)


def _resolve_target(path: str) -> str:
    """The directory a save replaces: `path`, or the directory a symlink at `path` points to."""
    if os.path.islink(path):
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            raise NotADirectoryError(f"save path {path!r} is a symlink to {real!r}, which is not a directory")
        return real
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"save path {path!r} is a file; expected a directory (or a path to create)")
    return os.path.abspath(path)


def _exchange_function() -> Optional[Callable[[str, str], None]]:
    """A function swapping two paths atomically, or None where the platform has none."""
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
    except OSError:
        return None
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        at_fdcwd, rename_exchange = -100, 2

        def exchange(a: str, b: str):
            if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e), a, None, b)
        return exchange
    if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rename_swap = 2

        def exchange(a: str, b: str):
            if libc.renamex_np(os.fsencode(a), os.fsencode(b), rename_swap) != 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e), a, None, b)
        return exchange
    return None


_exchange = _exchange_function()
# errors saying "this filesystem / kernel cannot exchange": fall back to two renames
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM}


def _swap_in(new: str, target: str) -> str:
    """Put directory `new` at `target`, which exists; returns where the old directory now is (to be removed)."""
    if _exchange is not None:
        try:
            _exchange(new, target)
            return new
        except OSError as e:
            if e.errno not in _NO_EXCHANGE:
                raise
    parent, base = os.path.split(target)
    old = tempfile.mkdtemp(prefix=f".{base}.{_OLD_TAG}.", dir=parent)
    os.rmdir(old)  # only the unique name: rename needs it free
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)  # put the old checkpoint back
        raise
    return old


def _link_or_copy(src: str, dst: str):
    """A hard link (no data copied; nothing writes to carried files) where the filesystem allows it, else a copy."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _carry_over(old: str, new: str):
    """Entries of the old directory that are not checkpoint files, into the new one (the new files win)."""
    for entry in os.scandir(old):
        if is_checkpoint_file(entry.name) or os.path.lexists(os.path.join(new, entry.name)):
            continue
        dst = os.path.join(new, entry.name)
        if entry.is_dir(follow_symlinks=False):
            shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry.path, dst)


def _fsync_tree(path: str):
    """Flush the new files and the directory entries to disk before the swap makes them the checkpoint."""
    for root, _, files in os.walk(path):
        for name in files:
            f = os.path.join(root, name)
            if os.path.islink(f):
                continue
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(root)


def _fsync_dir(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a directory: nothing more to do there
        pass
    finally:
        os.close(fd)


def _remove_tree(path: str):
    shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_leftovers(parent: str, base: str):
    """Temporary directories of earlier saves to this target from processes of this host that no longer run."""
    host = socket.gethostname()
    for tag in (_TMP_TAG, _OLD_TAG):
        prefix = f".{base}.{tag}."
        for name in os.listdir(parent):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].split(".")
            if tag == _TMP_TAG and (len(parts) < 3 or parts[0] != host or not parts[1].isdigit()
                                    or _pid_alive(int(parts[1]))):
                continue
            if tag == _OLD_TAG and not os.path.lexists(os.path.join(parent, base)):
                continue  # the two-rename fallback died between its renames: this is the only copy of the old one
            _remove_tree(os.path.join(parent, name))


@contextlib.contextmanager
def atomic_directory(path) -> Iterator[str]:
    """Write a directory atomically: yields a fresh temporary directory beside `path` to write into; on a normal
    exit the old directory's non-checkpoint entries are carried in and it replaces `path` in one step; on an
    exception it is removed and `path` is left as it was. See the module docstring for links and the fallback."""
    target = _resolve_target(os.fspath(path))
    parent, base = os.path.split(target)
    if not base:
        raise ValueError(f"save path {os.fspath(path)!r} names no directory")
    os.makedirs(parent, exist_ok=True)
    _remove_leftovers(parent, base)
    tmp = tempfile.mkdtemp(prefix=f".{base}.{_TMP_TAG}.{socket.gethostname()}.{os.getpid()}.", dir=parent)
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; a saved directory gets the usual mode
        if os.path.isdir(target):
            _carry_over(target, tmp)
        _fsync_tree(tmp)
        if os.path.isdir(target):
            old = _swap_in(tmp, target)
            _remove_tree(old)
        else:
            os.rename(tmp, target)
        _fsync_dir(parent)
    except BaseException:
        _remove_tree(tmp)
        raise


def _umask() -> int:
    """The process umask, read without setting it (os.umask would change it for every thread for a moment)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
