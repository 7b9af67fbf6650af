"""Scale granularity of an fp8 weight: ``PerTensor()``, ``PerChannel()``, ``PerBlock(bn, bk)``.

The strings ``"tensor"``, ``"channel"`` and ``"block"`` are aliases (``"block"`` means blocks of 128 x 128 unless a
block size is given), and each granularity compares equal to its alias, so ``layer.granularity == "channel"``
keeps working. :func:`infer_granularity` tells a scale's layout from its shape by exactly the rule of the ops'
C++ check (``check_fp8_weight`` in csrc/checks.cpp); everything in torch_lowbit that reads a scale uses it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

INT64_MAX = 2 ** 63 - 1
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config and DeepSeek-V3's block


def normalize_block_size(block_size, name="block_size") -> Tuple[int, int]:
    """(block_n, block_k) as a tuple of two positive ints, or a ValueError naming the argument."""
    try:
        bn, bk = (int(b) for b in block_size)
        ok = 0 < bn <= INT64_MAX and 0 < bk <= INT64_MAX and all(int(b) == b and not isinstance(b, bool)
                                                                  for b in block_size)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be two positive ints (block_n, block_k) of at most 2**63 - 1 (the ops' "
                         f"int64), got {block_size!r}")
    return bn, bk


class Granularity:
    """Base of the three granularities. ``kind``: the string alias. ``block_size``: (bn, bk) or None."""
    kind: str = ""

    @property
    def block_size(self) -> Optional[Tuple[int, int]]:
        return None

    def scale_shape(self, N: int, K: int, experts: Optional[int] = None) -> Tuple[int, ...]:
        """The canonical scale shape for an ``[N, K]`` weight (``[E, N, K]`` stacked experts when ``experts=E``)."""
        per_weight = self._shape(N, K)
        if experts is None:
            return per_weight
        return (experts,) + (() if self.kind == "tensor" else per_weight)

    def _shape(self, N, K):
        raise NotImplementedError

    def describe(self) -> str:
        return self.kind

    def __eq__(self, other):
        if isinstance(other, str):
            return other == self.kind
        return type(other) is type(self) and self.block_size == other.block_size

    def __hash__(self):
        return hash(self.kind)  # equal to its alias's hash, as __eq__ requires


@dataclass(frozen=True, eq=False)
class PerTensor(Granularity):
    """One scale for the whole weight: shape ``[1]`` (0-d or any one-element shape is accepted)."""
    kind = "tensor"

    def _shape(self, N, K):
        return (1,)


@dataclass(frozen=True, eq=False)
class PerChannel(Granularity):
    """One scale per output row: shape ``[N]`` (``[N, 1]`` accepted)."""
    kind = "channel"

    def _shape(self, N, K):
        return (N,)


@dataclass(frozen=True, eq=False)
class PerBlock(Granularity):
    """One scale per ``block_n x block_k`` tile: shape ``[ceil(N/block_n), ceil(K/block_k)]``; edge blocks may be
    partial."""
    block_n: int = DEFAULT_BLOCK[0]
    block_k: int = DEFAULT_BLOCK[1]
    kind = "block"

    def __post_init__(self):
        bn, bk = normalize_block_size((self.block_n, self.block_k), "PerBlock(block_n, block_k)")
        object.__setattr__(self, "block_n", bn)
        object.__setattr__(self, "block_k", bk)

    @property
    def block_size(self) -> Tuple[int, int]:
        return (self.block_n, self.block_k)

    def _shape(self, N, K):
        return (math.ceil(N / self.block_n), math.ceil(K / self.block_k))

    def describe(self) -> str:
        return f"block {self.block_n}x{self.block_k}"


GranularityLike = Union[Granularity, str]
_ALIASES = {"tensor": PerTensor, "channel": PerChannel, "block": PerBlock}


def as_granularity(granularity: GranularityLike, block_size: Optional[Sequence[int]] = None,
                   name: str = "granularity") -> Granularity:
    """A Granularity from one of the three classes or an alias string. ``block_size`` is the block of the alias
    ``"block"`` (default 128 x 128) and is ignored for the other aliases; with a ``PerBlock`` it must agree."""
    # the block size is named after the caller's granularity argument: "Fp8Experts: block_size", ...
    bs_name = name[:-len("granularity")] + "block_size" if name.endswith("granularity") else "block_size"
    if isinstance(granularity, Granularity):
        if (isinstance(granularity, PerBlock) and block_size is not None
                and normalize_block_size(block_size, bs_name) != granularity.block_size):
            raise ValueError(f"{name} is {granularity!r} but block_size is {tuple(block_size)}: give one of them")
        return granularity
    if isinstance(granularity, str) and granularity in _ALIASES:
        if granularity == "block":
            return PerBlock(*normalize_block_size(DEFAULT_BLOCK if block_size is None else block_size, bs_name))
        return _ALIASES[granularity]()
    raise ValueError(f"{name} must be one of 'tensor', 'channel', 'block' (or PerTensor(), PerChannel(), "
                     f"PerBlock(bn, bk)), got {granularity!r}")


def infer_granularity(scale_shape: Sequence[int], N: int, K: int, block_size: Optional[Sequence[int]] = None, *,
                      experts: Optional[int] = None, what: str = "scale") -> Granularity:
    """The granularity a scale of shape ``scale_shape`` has for an ``[N, K]`` weight (``[E, N, K]`` with
    ``experts=E``), by the ops' own rule (C++ ``check_fp8_weight``), or a ValueError naming ``what``:

    - with ``block_size``: the shape must be ``[ceil(N/bn), ceil(K/bk)]`` (``[E, ...]``): per block;
    - else one element (experts: ``[E]``, or one element when E == 1): per tensor;
    - else ``[N]`` or ``[N, 1]`` (experts: ``[E, N]`` or ``[E, N, 1]``): per channel;
    - anything else is refused.
    """
    shape = tuple(int(d) for d in scale_shape)
    lead = () if experts is None else (int(experts),)
    if block_size is not None:
        g = PerBlock(*normalize_block_size(block_size))
        want = g.scale_shape(N, K, experts)
        if shape != want:
            raise ValueError(f"{what}: with block_size {list(g.block_size)} the scale must have shape {list(want)} "
                             f"(ceil(N/block_n), ceil(K/block_k)), got {list(shape)}")
        return g
    numel = math.prod(shape)
    if experts is None:
        per_tensor = numel == 1
    else:
        per_tensor = shape == lead or (experts == 1 and numel == 1)
    if per_tensor:
        return PerTensor()
    if shape in (lead + (N,), lead + (N, 1)):
        return PerChannel()
    raise ValueError(_refusal(what, shape, N, K, experts, None))


def _refusal(what, shape, N, K, experts, block_hint) -> str:
    if experts is not None:
        expected = "[E] (per tensor), [E, N] (per channel)"
        dims = [experts, N, K]
    else:
        expected = "one element (per tensor), [N] or [N, 1] (per channel)"
        dims = [N, K]
    if block_hint is None:
        expected += " or [..., ceil(N/bn), ceil(K/bk)] with block_size (per block)"
        if len(shape) == len(dims):
            expected += "; block scales need block_size=(block_n, block_k)"
    else:
        g = PerBlock(*block_hint)
        expected += f" or {list(g.scale_shape(N, K, experts))} (blocks of {g.block_n}x{g.block_k})"
    return f"{what} of shape {list(shape)} fits no layout of a weight {dims}: expected {expected}"


def granularity_with_block_hint(scale_shape: Sequence[int], N: int, K: int, block_size: Optional[Sequence[int]],
                                *, experts: Optional[int] = None, what: str = "scale") -> Granularity:
    """:func:`infer_granularity` where ``block_size`` is a format's block that a scale may or may not use (a
    checkpoint mixing block and per-channel layers, stacked experts with one block for both projections): per
    block if the shape is that block's, else the rule without a block size."""
    if block_size is None:
        return infer_granularity(scale_shape, N, K, None, experts=experts, what=what)
    g = PerBlock(*normalize_block_size(block_size))
    shape = tuple(int(d) for d in scale_shape)
    if shape == g.scale_shape(N, K, experts):
        return g
    try:
        return infer_granularity(shape, N, K, None, experts=experts, what=what)
    except ValueError:
        raise ValueError(_refusal(what, shape, N, K, experts, g.block_size)) from None
