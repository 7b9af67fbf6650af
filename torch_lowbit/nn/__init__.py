"""torch_lowbit.nn: drop-in modules backed by torch_lowbit's ops."""
from .experts import Fp8Experts  # noqa: F401
