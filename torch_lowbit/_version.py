"""The one version number of torch_lowbit (pyproject.toml reads it; torch_lowbit.__version__ re-exports it)."""
__version__ = "0.1.0"
