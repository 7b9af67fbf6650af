"""Lazy checkpoint tensors: meta tensors that remember where they come from, so that code written for real tensors
-- diffusers' single-file conversion functions, which rename, split and concatenate a checkpoint's tensors -- runs
unmodified on them, and each tensor it made is read afterwards, when it is needed, from the checkpoint.

A :class:`LazyTensor` is either a leaf (a checkpoint key) or the result of an op on lazy tensors (the op, its
arguments and, for ops returning several tensors, which one). :func:`evaluate` replays the ops on real tensors;
:func:`row_runs` tells whether a tensor's rows are rows of checkpoint tensors (what renames, ``split`` /
``chunk`` / slicing along dim 0 and ``cat`` along dim 0 make), and which, so that they can be read as stored.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import tree_map

_ROW_ID_SHIFT = 40  # row index tensors carry (leaf number << 40) + row: rows up to 2**40 per tensor


class LazyTensor(torch.Tensor):
    """A meta tensor (shape and dtype of what it stands for) with a recipe: ``("leaf", key)`` or
    ``("op", func, args, kwargs, index)``."""
    _recipe: tuple

    @staticmethod
    def leaf(key: str, dtype: torch.dtype, shape) -> "LazyTensor":
        t = torch.empty(tuple(shape), dtype=dtype, device="meta").as_subclass(LazyTensor)
        t._recipe = ("leaf", key)
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        inputs = [a for a in _flat(args, kwargs) if isinstance(a, LazyTensor)]
        if any(out is a for a in inputs):
            name = getattr(func, "__name__", "")
            if name.endswith("_") and not name.endswith("__"):
                raise NotImplementedError(f"in-place {name} on a lazy checkpoint tensor: it would change the "
                                          f"checkpoint's tensor, which is read later")
            return out  # a no-op (contiguous() of a contiguous tensor, to() its own dtype): the same tensor
        if isinstance(out, torch.Tensor):
            return _made(out, func, args, kwargs, None)
        if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
            return type(out)(_made(o, func, args, kwargs, i) if isinstance(o, torch.Tensor) else o
                             for i, o in enumerate(out))
        return out  # shapes, dtypes, numbers

    def __repr__(self):
        made = self._recipe[1] if self._recipe[0] == "leaf" else getattr(self._recipe[1], "__name__", "op")
        return f"LazyTensor({made}, {self.dtype}, {list(self.shape)})"


def _made(out: torch.Tensor, func, args, kwargs, index) -> LazyTensor:
    t = out.as_subclass(LazyTensor)
    t._recipe = ("op", func, args, kwargs, index)
    return t


def _flat(args, kwargs):
    from torch.utils._pytree import tree_leaves

    return tree_leaves((args, kwargs))


def leaves(t: LazyTensor) -> Set[str]:
    """The checkpoint keys `t` is made of."""
    if t._recipe[0] == "leaf":
        return {t._recipe[1]}
    _, _, args, kwargs, _ = t._recipe
    return set().union(*[leaves(a) for a in _flat(args, kwargs) if isinstance(a, LazyTensor)])


def evaluate(t: LazyTensor, leaf_value: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """`t` computed on real tensors: each leaf is ``leaf_value(key)``, each op replayed."""
    if t._recipe[0] == "leaf":
        return leaf_value(t._recipe[1])
    _, func, args, kwargs, index = t._recipe
    real = (lambda x: evaluate(x, leaf_value) if isinstance(x, LazyTensor) else x)
    out = func(*tree_map(real, args), **tree_map(real, kwargs))
    return out if index is None else out[index]


# the ops that take whole rows (along dim 0) of 2-D tensors: func -> (position of its dim argument, its default)
_DIM_ARG = {torch.chunk: (2, 0), torch.Tensor.chunk: (2, 0), torch.split: (2, 0), torch.Tensor.split: (2, 0),
            torch.narrow: (1, None), torch.Tensor.narrow: (1, None), torch.cat: (1, 0), torch.concat: (1, 0),
            torch.concatenate: (1, 0)}
_NO_DIM = (torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.detach)


def _takes_rows(func, args, kwargs) -> bool:
    """Does this op (on 2-D tensors) only take or reorder whole rows?"""
    if func in _NO_DIM:
        return not kwargs or set(kwargs) <= {"memory_format"}
    if func is torch.Tensor.__getitem__:
        index = args[1]
        rest = index[1:] if isinstance(index, tuple) else ()
        first = index[0] if isinstance(index, tuple) and index else index
        return (first is not Ellipsis and first is not None and not isinstance(first, bool)
                and all(isinstance(r, slice) and r == slice(None) for r in rest))
    if func not in _DIM_ARG:
        return False
    pos, default = _DIM_ARG[func]
    dim = kwargs.get("dim", kwargs.get("axis", args[pos] if len(args) > pos else default))
    return dim in (0, -2)


def _only_rows(t: LazyTensor) -> bool:
    if t._recipe[0] == "leaf":
        return True
    _, func, args, kwargs, _ = t._recipe
    return _takes_rows(func, args, kwargs) and all(_only_rows(a) for a in _flat(args, kwargs)
                                                   if isinstance(a, LazyTensor))


def row_runs(t: LazyTensor, leaf_shape: Callable[[str], Tuple[int, ...]]) -> Optional[List[Tuple[str, int, int]]]:
    """If `t` (2-D) is made of whole rows of 2-D checkpoint tensors of its width -- by renames, ``chunk`` /
    ``split`` / ``narrow`` / indexing along dim 0 and ``cat`` along dim 0 --, the runs ``(key, start, stop)`` of
    consecutive rows it takes, in its order; else None (a transpose, a reshape, a dtype conversion, a cut along
    dim 1, arithmetic, ...).

    Every op must be one of those (checked by name and dim), and which rows it takes is found by replaying them on
    tensors of row numbers (``[rows, 1]`` int64 per leaf)."""
    keys = sorted(leaves(t))
    if t.dim() != 2 or any(len(leaf_shape(k)) != 2 or leaf_shape(k)[1] != t.shape[1] for k in keys):
        return None
    if not _only_rows(t):
        return None
    number = {k: i for i, k in enumerate(keys)}

    def row_ids(key):
        return (torch.arange(leaf_shape(key)[0], dtype=torch.int64) + (number[key] << _ROW_ID_SHIFT)).unsqueeze(1)

    try:
        ids = evaluate(t, row_ids)
    except Exception:  # an op that has no meaning on row numbers: not a row selection
        return None
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != (t.shape[0], 1):
        return None
    ids = ids.reshape(-1).tolist()
    runs: List[Tuple[str, int, int]] = []
    for v in ids:
        key, row = keys[v >> _ROW_ID_SHIFT], v & ((1 << _ROW_ID_SHIFT) - 1)
        if runs and runs[-1][0] == key and runs[-1][2] == row:
            runs[-1] = (key, runs[-1][1], row + 1)
        else:
            runs.append((key, row, row + 1))
    return runs
