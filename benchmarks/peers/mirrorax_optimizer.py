"""mirrorax ``Trainer.fit`` with ``MirroredStrategy(shard="optimizer")``: the optimizer state split over
the devices (ZeRO-1).

The same measurement as :mod:`benchmarks.peers.mirrorax_trainer`, on the sharded layout.

Run: ``python -m benchmarks.peers.mirrorax_optimizer --workload transformer --devices 8``.
"""

from __future__ import annotations

import sys

from benchmarks.peers import mirrorax_trainer


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.peers.mirrorax_optimizer --workload W --devices N ...``."""
    mirrorax_trainer.main(argv, shard="optimizer")


if __name__ == "__main__":
    main(sys.argv[1:])
