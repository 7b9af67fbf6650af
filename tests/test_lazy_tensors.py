"""formats/lazy.py: code written for real tensors runs on LazyTensor stand-ins of a checkpoint, and what it made is
replayed on the real tensors (evaluate) or found to be whole rows of stored tensors (row_runs)."""
import pytest
import torch

from torch_lowbit.formats.lazy import LazyTensor, evaluate, leaves, row_runs

SHAPES = {"qkv": (12, 4), "mlp": (6, 4), "wide": (6, 8), "bias": (12,)}


@pytest.fixture
def stored():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


@pytest.fixture
def lazy():
    return {k: LazyTensor.leaf(k, torch.float32, s) for k, s in SHAPES.items()}


# (what a conversion does, the rows it takes: [(key, start, stop)]), written once for real and lazy tensors alike
ROW_SELECTIONS = [
    (lambda t: t["qkv"], [("qkv", 0, 12)]),
    (lambda t: torch.chunk(t["qkv"], 3, dim=0)[1], [("qkv", 4, 8)]),
    (lambda t: torch.cat([torch.split(t["qkv"], [4, 4, 4], dim=0)[2]]), [("qkv", 8, 12)]),
    (lambda t: torch.cat(list(reversed(t["qkv"].chunk(2, dim=0)))), [("qkv", 6, 12), ("qkv", 0, 6)]),  # swap halves
    (lambda t: torch.cat([t["mlp"][1:3], t["qkv"][5:7]], dim=0).contiguous(), [("mlp", 1, 3), ("qkv", 5, 7)]),
    (lambda t: t["qkv"].narrow(0, 2, 0), []),
    (lambda t: t["qkv"][torch.tensor([3, 1])], [("qkv", 3, 4), ("qkv", 1, 2)]),
]
NOT_ROWS = [
    lambda t: t["qkv"].T.contiguous().T,  # same shape, but made through a transpose of the rows' layout
    lambda t: t["wide"][:, :4],  # a cut along dim 1
    lambda t: torch.cat([t["mlp"], t["mlp"]], dim=1)[:, ::2],
    lambda t: t["qkv"].to(torch.bfloat16),  # a value conversion
    lambda t: t["qkv"] * 2,
    lambda t: t["qkv"].reshape(4, 12).reshape(12, 4),
    lambda t: t["bias"],  # not 2-D
]


@pytest.mark.parametrize("case", range(len(ROW_SELECTIONS)))
def test_row_selections_replay_and_name_their_rows(stored, lazy, case):
    fn, runs = ROW_SELECTIONS[case]
    out = fn(lazy)
    assert isinstance(out, LazyTensor) and out.is_meta
    want = fn(stored)
    assert torch.equal(evaluate(out, stored.__getitem__), want)
    assert row_runs(out, lambda k: SHAPES[k]) == runs
    assert torch.equal(torch.cat([stored[k][a:b] for k, a, b in runs]) if runs else want, want)


@pytest.mark.parametrize("case", range(len(NOT_ROWS)))
def test_other_ops_replay_but_are_not_rows(stored, lazy, case):
    out = NOT_ROWS[case](lazy)
    assert torch.equal(evaluate(out, stored.__getitem__), NOT_ROWS[case](stored))
    assert row_runs(out, lambda k: SHAPES[k]) is None


def test_leaves_shapes_and_no_ops(lazy):
    a, b = torch.chunk(lazy["qkv"], 2, dim=0)
    both = torch.cat([a, lazy["mlp"]])
    assert leaves(both) == {"qkv", "mlp"} and both.shape == (12, 4) and both.dtype == torch.float32
    assert lazy["qkv"].contiguous() is lazy["qkv"]  # a no-op returns the same stand-in
    assert "qkv" in repr(lazy["qkv"]) and "cat" in repr(both)


def test_in_place_ops_are_refused(lazy):
    with pytest.raises(NotImplementedError, match="in-place mul_ on a lazy checkpoint tensor"):
        lazy["qkv"].mul_(2)
