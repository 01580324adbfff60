"""Inputs: what users pass as data, as fixed-shape global batches on the devices.

Every input is a :class:`~mirrorax.inputs.source.Source` (one protocol: the batch size it implies, a
sample batch, its epoch stream, its resumable position), so the trainer never asks which kind it holds:

* :mod:`~mirrorax.inputs.make`: what the user passed -> a source (arrays, iterables, validation data);
* :mod:`~mirrorax.inputs.arrays` / :mod:`~mirrorax.inputs.iterables`: the sources, each process
  building only its own rows of every global batch (:mod:`~mirrorax.inputs.batch`: padded, masked);
* :mod:`~mirrorax.inputs.streams`: which batches an epoch takes, from which position;
  :mod:`~mirrorax.inputs.position`: an iterable's own position within an epoch, for checkpoints;
* :mod:`~mirrorax.inputs.placement` / :mod:`~mirrorax.inputs.prefetch`: the batches on the devices;
* :mod:`~mirrorax.inputs.distributed`: the same path for custom loops
  (``strategy.experimental_distribute_dataset``).
"""
