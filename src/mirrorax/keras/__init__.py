"""Keras 3 on the strategy: mirrorax's wing for Keras, a sibling of :mod:`mirrorax.nnx`.

Its modules stand on the engine's floors (``tests/test_house.py``), each beside what it serves:

** :mod:`~mirrorax.keras.env`: Keras settings a scope cannot honour (another backend, a global distribution);
* :mod:`~mirrorax.keras.front_end`: the Keras front-end's record (the engine reaches the wing through it);
* :mod:`~mirrorax.keras.callbacks`: the driver of a Keras model's callbacks (Keras's ``CallbackList``);
* :mod:`~mirrorax.keras.masking`: Keras metrics given a step's padding mask;
* :mod:`~mirrorax.keras.stateful`: Keras's split/merge protocol, for steps that read and assign Keras variables
  (``strategy.jit``; the package registers it), and ``mx.grad``;
* :mod:`~mirrorax.keras.order` / :mod:`~mirrorax.keras.data`: Keras's shuffle order (``KERAS_FIT``: Keras's reading
  of fit's data) and its data arguments;
* :mod:`~mirrorax.keras.adapter`: a Keras model as pure functions (:mod:`~mirrorax.keras.custom`: its custom
  steps, :mod:`~mirrorax.keras.metrics`: its compiled metrics, :mod:`~mirrorax.keras.targets`: its losses' targets);
* :mod:`~mirrorax.keras.checkpoint`: ``mx.Checkpoint``, a custom loop's Keras objects by name;
* :mod:`~mirrorax.keras.fit`: ``model.fit`` & co. under ``strategy.scope()`` -> a ``Trainer``.

This package imports nothing itself, and no engine module imports the wing: the package registers its
records lazily (``front_end.register_lazy``: its record and its split/merge protocol, in one load).
"""
