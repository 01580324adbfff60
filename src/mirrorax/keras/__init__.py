"""Keras 3 on the strategy: mirrorax's wing for Keras, a sibling of :mod:`mirrorax.nnx`.

Its modules stand on the engine's floors (``tests/test_house.py``), each beside what it serves:

** :mod:`~mirrorax.keras.env`: Keras settings a scope cannot honour (another backend, a global distribution);
* :mod:`~mirrorax.keras.callbacks`: Keras's side of a fit's callbacks (:mod:`mirrorax.hooks` drives them);
* :mod:`~mirrorax.keras.stateful`: Keras's split/merge protocol, for steps that read and assign Keras variables
  (``strategy.jit``; the package registers it), and ``mx.grad``;
* :mod:`~mirrorax.keras.order` / :mod:`~mirrorax.keras.data`: Keras's shuffle order and its data arguments;
* :mod:`~mirrorax.keras.adapter`: a Keras model as pure functions (:mod:`~mirrorax.keras.custom`: its custom
  steps, :mod:`~mirrorax.keras.metrics`: its compiled metrics, :mod:`~mirrorax.keras.targets`: its losses' targets);
* :mod:`~mirrorax.keras.checkpoint`: ``mx.Checkpoint``, a custom loop's Keras objects by name;
* :mod:`~mirrorax.keras.fit`: ``model.fit`` & co. under ``strategy.scope()`` -> a ``Trainer``.

This package imports nothing itself: the engine imports the module it stands on (``order``, ``adapter``)
without loading the wing's upper floors.
"""
