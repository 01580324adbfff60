"""Inputs: what users pass as data, as fixed-shape global batches on the devices.

Data flows one way: a source (:mod:`~mirrorax.inputs.arrays`, :mod:`~mirrorax.inputs.iterables`) cuts
the data into this process's rows of each global batch (:mod:`~mirrorax.inputs.batch`: padded to one
shape, masked); a stream (:mod:`~mirrorax.inputs.streams`) says which batches an epoch takes;
placement (:mod:`~mirrorax.inputs.placement`, :mod:`~mirrorax.inputs.prefetch`) puts them on the
devices. :mod:`~mirrorax.inputs.distributed` is the same path for custom loops
(``strategy.experimental_distribute_dataset``).
"""
