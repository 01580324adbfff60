"""A long run that saves often: what stays resident (``tests/test_object_checkpoints.py``).

``python save_often.py DIR OUT SAVES WARMUP``: a jitted step updates a small state and a
:class:`mirrorax.Checkpointer` (keep 3) saves it after every step, ``SAVES`` times. Once ``WARMUP`` saves are
done, and then every 25, it waits for the pending save and records the process's threads by name
(``/proc/self/task/*/comm``), its Python threads and its resident memory, to ``OUT`` (JSON). Run in a fresh
interpreter with ``MALLOC_ARENA_MAX=1``: glibc then keeps one malloc arena instead of one per thread (up to 8
a core), which the threads of each save fill to a plateau, megabytes that say nothing about a leak.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading

import jax
import jax.numpy as jnp


def _thread_name(task: str) -> str | None:
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:  # the thread left between the listing and the read
        return None


def _sample() -> dict:
    names = collections.Counter(n for n in map(_thread_name, os.listdir("/proc/self/task")) if n is not None)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {"threads": dict(names), "python": sorted(t.name for t in threading.enumerate()),
            "rss_mb": int(status["VmRSS"].split()[0]) / 1024}


def main(directory: str, out: str, saves: int, warmup: int) -> None:
    from mirrorax.checkpoint.checkpointer import Checkpointer

    state = {"params": {"w": jnp.ones((256, 64)), "b": jnp.zeros(64)}, "step": jnp.int32(0)}
    step = jax.jit(lambda s: {"params": jax.tree.map(lambda a: a * 0.999 + 0.001, s["params"]), "step": s["step"] + 1})
    samples = []
    with Checkpointer(directory, keep=3) as ckpt:
        for n in range(1, saves + 1):
            state = step(state)
            ckpt.save(n, state, {"epoch": n})
            if n >= warmup and (n - warmup) % 25 == 0:
                ckpt.wait()
                samples.append({"save": n, **_sample()})
    with open(out, "w") as f:
        json.dump(samples, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
