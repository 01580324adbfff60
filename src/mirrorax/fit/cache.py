"""JAX's persistent compilation cache: a second run of the same program skips XLA compilation."""

from __future__ import annotations

import os

import jax

__all__ = ["enable_compilation_cache", "default_cache_dir"]


def default_cache_dir() -> str:
    """``$MIRRORAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/mirrorax/xla`` (``~/.cache/mirrorax/xla``)."""
    if os.environ.get("MIRRORAX_CACHE_DIR"):
        return os.environ["MIRRORAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mirrorax", "xla")


def enable_compilation_cache(path: str | os.PathLike[str] | None = None, *, min_compile_seconds: float = 0.5
                             ) -> str:
    """Turns on JAX's persistent compilation cache in ``path`` (default :func:`default_cache_dir`).

    Programs that took at least ``min_compile_seconds`` to compile are stored; a later process that
    builds the same program (same model, shapes, shardings, jax version) loads it instead.

    Returns:
      The cache directory.

    Example:
      >>> enable_compilation_cache("/tmp/xla-cache")
      '/tmp/xla-cache'
    """
    path = os.fspath(path) if path is not None else default_cache_dir()
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
