"""Elastic ``fit``: its snapshots (the local tier of its :class:`~mirrorax.fit.saving.Saving`), the job they
belong to, and the line that says a restart.

Under ``mirrorax launch --min-nprocs`` or ``mirrorax.cluster.ray_train`` (``MIRRORAX_SNAPSHOT_DIR`` set), each
``fit`` of a script takes snapshots (:mod:`mirrorax.checkpoint.snapshot`) of its state and its position in the
data (the epoch, the batch, the history so far: a checkpoint's record), named by the fit's place among the
script's fits (``fit1``, ``fit2``, ...: the same in a restarted script) and keyed by the job that takes them
(:func:`job_identity`), so two jobs sharing ``MIRRORAX_SNAPSHOT_DIR`` never take each other's. A fit that ends
takes one last snapshot: a restarted script passes through its earlier fits at once, each with its final state
and history, and continues the one that was running from its newest snapshot, or from a checkpoint when that
is newer. The data position counts global batches of the same global batch size, so the restarted fit trains
on the batches the uninterrupted one would have, on any process and device count.

Process 0 then says, on stderr, the job before and after, which processes were lost, the step resumed from
and the steps lost::

    mirrorax: elastic restart: fit 1 continues on 3 processes (6 devices) from snapshot step 40 (epoch 3,
    batch 5); the job had 4 processes (8 devices); lost: process 1 (slot 1: killed by signal SIGKILL), its
    failure 2: left out; 3 steps lost (it had reached step 43).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mirrorax.checkpoint.job import from_process_0
from mirrorax.checkpoint.snapshot import Snapshots, configured, nodes
from mirrorax.cluster import preemption
from mirrorax.cluster.restarts import restart_line
from mirrorax.inputs.arrays import ArraySource
from mirrorax.integrity import path_str

__all__ = ["next_fit", "fit_snapshots", "job_identity", "say_restart"]

_fits = itertools.count(1)  # the fits of this process, in order: the same in every process, and after a restart
_ROWS_SEEN = 16  # rows of each input array a job's identity digests (spread over the array)


def next_fit() -> int:
    """The place of the fit starting now among this process's fits (1, 2, ...)."""
    return next(_fits)


def fit_snapshots(ordinal: int, identity: Callable[[], dict[str, Any]]) -> Snapshots | None:
    """The snapshots of fit ``ordinal`` of the job ``identity()`` says (:func:`job_identity`; process 0's on every
    process: one folder for the job), or ``None`` where ``MIRRORAX_SNAPSHOT_DIR`` asks for none."""
    if not configured():
        return None
    job = identity()
    if jax.process_count() > 1:
        job = json.loads(from_process_0("snapshot_job", json.dumps(job, sort_keys=True)))
    snapshots = Snapshots(name=f"fit{ordinal}", job=job)
    snapshots.say = False  # said by the fit, with the epoch and batch (:func:`say_restart`)
    return snapshots


def job_identity(*, run: dict[str, Any], state: Any, hyperparameters: dict[str, float], model: Any, source: Any,
                 spec: dict[str, Any], checkpoint_dir: str | None) -> dict[str, Any]:
    """What makes a fit one job, as JSON: what would change its numbers if it resumed another's snapshot.

    Its checkpoint directory; its global batch, shuffle, seed and steps per epoch; the optimizer's
    hyperparameters as configured and its other settings (a Keras optimizer's ``get_config()``, its name left
    out: a per-process counter); the model's and the optimizer's variables (names, shapes, dtypes: digests);
    the data (examples, one row's shapes, a digest of rows spread over array inputs). Not the device or
    process count, which a restart may change.
    """
    def structure(tree: Any) -> str:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        text = json.dumps([[path_str(p), list(np.shape(a)), str(getattr(a, "dtype", type(a).__name__))]
                           for p, a in leaves])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    return {"checkpoint_dir": checkpoint_dir,
            **{k: run[k] for k in ("batch_size", "shuffle", "seed", "steps_per_epoch")},
            "hyperparameters": hyperparameters,
            "optimizer": _optimizer_settings(model),
            "model": structure((state.params, state.model_state)),
            "optimizer_state": structure(state.optimizer),
            "data": {"examples": getattr(source, "num_examples", None) if isinstance(source, ArraySource) else None,
                     "spec": spec, "rows": _rows_digest(source)}}


def _optimizer_settings(model: Any) -> dict[str, Any] | None:
    """A Keras optimizer's settings (``get_config()`` without its name), JSON; ``None`` for another."""
    optimizer = getattr(model, "optimizer", None)
    try:
        config = dict(optimizer.get_config())  # type: ignore[union-attr]
        config.pop("name", None)
        return json.loads(json.dumps(config, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
    except Exception:  # noqa: BLE001 - no Keras optimizer, or settings that are not JSON: its variables decide
        return None


def _rows_digest(source: Any) -> str | None:
    """A digest of ``_ROWS_SEEN`` rows spread over each array of an array input (``None``: another input, whose
    rows a restart may read in another order)."""
    if not isinstance(source, ArraySource) or not source.num_examples:
        return None
    rows = np.unique(np.linspace(0, source.num_examples - 1, _ROWS_SEEN).astype(np.int64))
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves((source.x, source.y, source.w)):
        picked = np.ascontiguousarray(np.asarray(leaf)[rows])
        digest.update(f"{picked.dtype}{picked.shape}".encode())
        digest.update(picked.tobytes())
    return digest.hexdigest()[:16]


def say_restart(snapshots: Snapshots | None, ordinal: int, step: int, epoch: int, batch: int, kind: str, done: bool,
                devices: int) -> None:
    """Says a restart of fit ``ordinal`` (resumed from ``kind`` step ``step``, at ``epoch``'s ``batch``, on
    ``devices``; ``done``: the fit had ended), from process 0: every process reaches the same conclusion. Only
    in an elastic job (``snapshots`` not ``None``)."""
    if snapshots is None:
        return
    if done:
        line = (f"mirrorax: elastic restart: fit {ordinal} had ended before it (its {kind} step {step}): its "
                "final state and history are restored.")
    else:
        held = snapshots.last_held
        facts = {"reached": held.get("reached", -1), "group": held.get("group") if kind == "snapshot" else None}
        line = restart_line(f"fit {ordinal}", f"{kind} step {step} (epoch {epoch + 1}, batch {batch})", step, facts,
                            devices, jax.process_count(), nodes())
    preemption.announce(line, jax.process_index() == 0)
