"""The ``integrity`` item of a checkpoint: its checksum record, summed while the state is written.

The record is ``{"format": 2, "step": s, "checksums": {path: [sum, weighted_sum]}, "meta_sha256": h}``:
the checksums are what :func:`mirrorax.integrity.digest` gives, ``h`` is :func:`meta_digest` of the
checkpoint's ``meta`` record (format 1, written before, has no ``meta_sha256``). A save hands this
item a :class:`~mirrorax.integrity.HostDigest` (host arrays of the state, taken when the save
started) and the sums are done in Orbax's background commit, beside the array writes: the loop never
waits for a reduction over the whole state. A state
holding NaN or Inf fails its commit with :class:`NonFiniteState`, so Orbax never finalises that step
(no checkpoint appears, none is deleted to make room for it); the checkpointer reports it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from mirrorax.checkpoint.record import meta_digest
from mirrorax.integrity import HostDigest

__all__ = ["FORMAT_VERSION", "IntegrityHandler", "IntegrityRestore", "IntegritySave", "NonFiniteState",
           "meta_digest"]  # (meta_digest: mirrorax.checkpoint.record's, the digest both tiers write)

# 1: checksums of the arrays. 2: also the SHA-256 of the meta record. A reader takes every format up to
# its own and refuses a newer one (written by a newer mirrorax) rather than calling it damaged.
FORMAT_VERSION = 2


class NonFiniteState(Exception):
    """The state of checkpoint ``step`` holds NaN or Inf in ``paths``; the save was abandoned."""

    def __init__(self, step: int, paths: list[str]) -> None:
        super().__init__(f"checkpoint step {step}: variables {paths} hold NaN or Inf")
        self.step, self.paths = step, paths


class IntegrityHandler(ocp.JsonCheckpointHandler):
    """Writes the record once its checksums are known; restores it as ``JsonCheckpointHandler`` does."""

    async def async_save(self, directory: epath.Path, item: Any = None,
                         args: IntegritySave | None = None) -> list[ocp.future.Future]:
        if args is None:
            raise ValueError(f"Expected args=IntegritySave(...). Received item={item!r}, args=None.")
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._commit(directory, args),
                                                                   name="mirrorax_integrity")]

    async def _commit(self, directory: epath.Path, args: IntegritySave) -> None:
        checksums = args.checksums
        if args.pending is not None:
            checksums, non_finite = args.pending.result()
            if non_finite:
                raise NonFiniteState(args.step, non_finite)
        if jax.process_index() == 0:  # the primary host writes the shared files, as Orbax's own items
            record = {"format": FORMAT_VERSION, "step": args.step, "checksums": checksums,
                      "meta_sha256": args.meta_sha256}
            (directory / "metadata").write_text(json.dumps(record))


@ocp.args.register_with_handler(IntegrityHandler, for_save=True)
@dataclasses.dataclass
class IntegritySave(ocp.args.CheckpointArgs):
    """The record of checkpoint ``step``: ``checksums`` already computed, or ``pending`` ones.

    Attributes:
      step: the checkpoint's step.
      checksums: ``{path: [sum, weighted_sum]}`` (a multi-process save computes them on the devices).
      pending: a :class:`HostDigest` of the state, summed in the background; its NaN/Inf finding
        abandons the save.
      meta_sha256: :func:`meta_digest` of the checkpoint's ``meta`` record.
    """

    step: int
    checksums: dict[str, list[int]] | None = None
    pending: HostDigest | None = None
    meta_sha256: str | None = None


@ocp.args.register_with_handler(IntegrityHandler, for_restore=True)
@dataclasses.dataclass
class IntegrityRestore(ocp.args.CheckpointArgs):
    """Reads the record back (a JSON dict)."""
