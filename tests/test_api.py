"""The public surface: everything in ``mirrorax.__all__`` exists, is documented, and nothing private leaks."""

import inspect

import mirrorax as mx


def test_public_names_resolve_and_are_documented():
    assert len(mx.__all__) == len(set(mx.__all__))
    for name in mx.__all__:
        obj = getattr(mx, name)
        assert inspect.getdoc(obj), f"mirrorax.{name} has no docstring"
    assert mx.MultiWorkerMirroredStrategy is mx.MirroredStrategy


def test_trainer_contract_signature():
    fit = inspect.signature(mx.Trainer.fit).parameters
    for p in ("batch_size", "epochs", "validation_data", "shuffle", "seed", "sample_weight", "steps_per_epoch",
              "verbose", "checkpoint_dir", "checkpoint_every"):
        assert fit[p].kind is inspect.Parameter.KEYWORD_ONLY, p
    assert fit["epochs"].default == 1 and fit["shuffle"].default is True and fit["verbose"].default == "auto"
    assert "batch_size" in inspect.signature(mx.Trainer.evaluate).parameters
    assert "batch_size" in inspect.signature(mx.Trainer.predict).parameters
    params = inspect.signature(mx.MirroredStrategy).parameters
    assert list(params)[0] == "devices"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for name, p in params.items() if name != "devices")
    for method in ("replicate", "experimental_distribute_dataset", "distribute_dataset", "jit", "run", "reduce",
                   "gather", "scope"):
        assert inspect.getdoc(getattr(mx.MirroredStrategy, method)), method
