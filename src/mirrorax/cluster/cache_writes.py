"""JAX's persistent compilation cache written by every process of an elastic job on CPU devices."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax

from mirrorax.cluster.discovery import private_jax

__all__ = ["cache_every_process"]


def cache_every_process() -> bool:
    """Every process of a job on CPU devices writes what it compiled to JAX's persistent cache, not process 0 alone.

    JAX writes from process 0 only (one writer per program on a shared file system), which suits accelerators,
    where every process compiles a program to the same executable under the same key. On CPU devices the key and
    the executable name the process (its collectives do), so the other processes never find process 0's entries:
    a restarted group of an elastic job compiled again in every process but the first, and it waits for the
    slowest (13 s of its 18 on the benchmark's CNN, 4 processes on a loaded 2-core host). Each CPU process writes
    its own entries here (their keys differ: no two processes write one file). Called when an elastic job joins
    (``MIRRORAX_SNAPSHOT_DIR`` set: under ``mirrorax launch`` with restarts, on Ray Train), whose cache is its
    own (:func:`mirrorax.cluster.restarts.compile_cache`).

    Returns:
      Whether the writes are on: ``False`` on a JAX whose private compiler module no longer has what this
      wraps (``jax._src.compiler._cache_write``, ``jax._src.compilation_cache.put_executable_and_time``).
    """
    compiler, cache, distributed = (private_jax(name) for name in ("compiler", "compilation_cache", "distributed"))
    original = getattr(compiler, "_cache_write", None)
    put = getattr(cache, "put_executable_and_time", None)
    state = getattr(distributed, "global_state", None)
    if original is None or put is None or state is None:
        return False
    if getattr(original, "mirrorax_every_process", False):
        return True

    @functools.wraps(original)
    def cache_write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any, executable: Any,
                    host_callbacks: Any) -> None:
        original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        least = float(jax.config.jax_persistent_cache_min_compile_time_secs)  # type: ignore[attr-defined]
        if (getattr(state, "process_id", 0) or 0) == 0 or getattr(backend, "platform", "") != "cpu" \
                or host_callbacks or compile_time_secs < least:
            return  # (process 0's own write is JAX's, above)
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # noqa: BLE001 - as JAX does for its own write: the program runs, uncached
            warnings.warn(f"Could not write {module_name!r} to the persistent compilation cache: "
                          f"{type(e).__name__}: {e}", stacklevel=2)

    cache_write.mirrorax_every_process = True  # type: ignore[attr-defined]
    compiler._cache_write = cache_write  # type: ignore[union-attr]
    return True
