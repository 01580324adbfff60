"""Steps: a user's function compiled once per signature and dispatched over the devices (``strategy.jit``,
``strategy.run``), and the Trainer's steps built on them.

* :mod:`~mirrorax.steps.dispatch`: ``StrategyFunction`` (a step compiled per signature, its output layouts,
  ``program()`` for loops) and ``InFlight``, the strategy's dispatch window;
* :mod:`~mirrorax.steps.split_merge`: the split/merge protocol for objects a step changes in place, and its
  registry of front-ends; :mod:`~mirrorax.steps.stateful`: ``StatefulFunction``, what ``strategy.jit`` and
  ``strategy.run`` return, threading those objects' state through the protocol;
  :mod:`~mirrorax.steps.held`: objects among the arguments held between calls;
* :mod:`~mirrorax.steps.distributed_batch`: ``DistributedBatch``, one global batch as a custom loop holds it;
* :mod:`~mirrorax.steps.first_call`: a program's first call (trace and compile) run as a trace wants the host;
* :mod:`~mirrorax.fit.functions`: ``StepFunctions``, the Trainer's train / evaluate / predict steps, each a
  public ``strategy.jit`` function.

This package imports nothing itself: each module stands on its own floor (``tests/test_house.py``).
"""
