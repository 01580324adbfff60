"""Bad inputs and set-ups fail early, before any compilation, with a message that says how to fix them."""

import ast
import os
import pathlib
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest
from helpers import dense, flat_digits, strategy

import mirrorax as mx


@pytest.fixture
def trainer():
    return mx.Trainer(dense(), strategy(2))


def _assert_nothing_compiled(t):
    assert t.compile_counts() == {"train": 0, "train_many": 0, "evaluate": 0, "predict": 0}


def test_x_and_y_lengths_differ(trainer):
    x, y, _, _ = flat_digits(50)
    with pytest.raises(ValueError, match=r"same number of examples.*x: 50.*y: 49"):
        trainer.fit(x, y[:49], batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="sample_weight: 10"):
        trainer.fit(x, y, sample_weight=np.ones(10), batch_size=8, verbose=0)
    _assert_nothing_compiled(trainer)


def test_empty_input(trainer):
    with pytest.raises(ValueError, match="empty"):
        trainer.fit(np.zeros((0, 64), np.float32), np.zeros((0,), np.int32), batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="yielded no batch"):
        trainer.fit(iter([]), batch_size=8, verbose=0)
    _assert_nothing_compiled(trainer)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64", True])
def test_bad_batch_size(trainer, bad):
    x, y, _, _ = flat_digits(20)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        trainer.fit(x, y, batch_size=bad, verbose=0)
    _assert_nothing_compiled(trainer)


def test_non_numeric_arrays(trainer):
    x = np.array([["a"] * 64] * 4)
    with pytest.raises(TypeError, match=r"x must hold numbers; received an array of dtype <U1"):
        trainer.fit(x, np.zeros(4, np.int32), batch_size=2, verbose=0)
    with pytest.raises(TypeError, match="y must hold numbers"):
        trainer.fit(np.zeros((4, 64), np.float32), np.array([object()] * 4), batch_size=2, verbose=0)
    _assert_nothing_compiled(trainer)


def test_not_compiled_and_no_loss():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"not compiled and no loss was given.*model.compile"):
        mx.Trainer(model, strategy(1))


def test_devices_duplicates_and_empty():
    d = jax.devices()
    with pytest.raises(ValueError, match=r"more than once \(received ids \[0, 1, 0\]\)"):
        mx.MirroredStrategy(devices=[d[0], d[1], d[0]])
    with pytest.raises(ValueError, match="has no device"):
        mx.MirroredStrategy(devices=[])
    with pytest.raises(ValueError, match="which JAX does not have"):
        mx.MirroredStrategy(devices=[0, 99])
    assert mx.MirroredStrategy(devices=[0, 3]).num_replicas_in_sync == 2


def test_devices_mixed_platforms(monkeypatch):
    from mirrorax import mesh as mesh_mod

    class FakeDevice:
        def __init__(self, i, platform):
            self.id, self.platform = i, platform

    fakes = [FakeDevice(0, "cpu"), FakeDevice(1, "gpu")]
    monkeypatch.setattr(mesh_mod.jax, "devices", lambda *a: fakes)
    monkeypatch.setattr(mesh_mod.jax, "Device", FakeDevice)
    with pytest.raises(ValueError, match=r"mixes platforms \['cpu', 'gpu'\]"):
        mesh_mod.validate_devices(fakes)


@pytest.mark.slow  # starts a process
def test_wrong_keras_backend_names_the_fix():
    code = ("import os; os.environ['KERAS_BACKEND']='numpy'\n"
            "import keras, mirrorax as mx\n"
            "m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
            "m.compile(loss='mse')\n"
            "try:\n    mx.Trainer(m)\nexcept RuntimeError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, KERAS_BACKEND="numpy", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "ERR" in out.stdout and "KERAS_BACKEND=jax" in out.stdout, out.stdout + out.stderr


def test_bad_trainer_options():
    with pytest.raises(ValueError, match="steps_per_execution must be an integer >= 1; received 0"):
        mx.Trainer(dense(), strategy(1), steps_per_execution=0)
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        mx.Trainer(dense(), strategy(1), on_nonfinite="explode")
    with pytest.raises(TypeError, match="Keras 3 model, a Flax NNX module or a mirrorax.FunctionalModel"):
        mx.Trainer(object(), strategy(1))


# -- one error shape (STYLE.md rule 6): what is expected, what was received, how to fix it ----------------

SRC = pathlib.Path(mx.__file__).parent
SHAPED = ("ValueError", "TypeError", "RuntimeError")
# Raises whose message shows no value, each with the reason it has none to show. Keyed by file and
# enclosing function (not line numbers, which move with every edit).
NO_VALUE_TO_SHOW = {
    ("trainer.py", "Trainer.host_state", "RuntimeError"): "no state yet: the fault is a call order, not a value",
    ("fit/device_state.py", "DeviceState.live", "RuntimeError"): "no state yet: the fault is a call order, not a value",
}
# Functions that build a message for a raise; their returns are held to the same shape.
MESSAGE_BUILDERS = {"label_message", "_label_message"}


def _interpolates(node: ast.expr | None) -> bool:
    """An f-string with a ``{...}`` field, ``%``-formatting, ``.format(...)``, or a message builder's call."""
    if isinstance(node, ast.JoinedStr):
        return any(isinstance(v, ast.FormattedValue) for v in node.values)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, ast.Mod) or _interpolates(node.left) or _interpolates(node.right)
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return name == "format" or name in MESSAGE_BUILDERS
    return False


def _walk(node: ast.AST, rel: str, scope: str):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.FunctionDef) and child.name in MESSAGE_BUILDERS:
                for r in ast.walk(child):
                    if isinstance(r, ast.Return):
                        yield rel, inner, "return", r.lineno, r.value
            yield from _walk(child, rel, inner)
            continue
        exc = child.exc if isinstance(child, ast.Raise) else None
        if isinstance(exc, ast.Call) and getattr(exc.func, "id", None) in SHAPED:
            yield rel, scope, exc.func.id, child.lineno, exc.args[0] if exc.args else None
        yield from _walk(child, rel, scope)


def _shaped_raises():
    """(file, enclosing function, exception, line, message node) of every ``raise ValueError/TypeError/
    RuntimeError(...)`` in the package, and of every return of a message builder."""
    for path in sorted(SRC.rglob("*.py")):
        yield from _walk(ast.parse(path.read_text()), path.relative_to(SRC).as_posix(), "")


def test_every_error_message_shows_the_received_value():
    found = list(_shaped_raises())
    assert len(found) > 100, "the scan found too few raises: is SRC the package?"
    lacking = [f"{rel}:{line} in {scope or '<module>'}: {kind}" for rel, scope, kind, line, msg in found
               if not _interpolates(msg) and (rel, scope, kind) not in NO_VALUE_TO_SHOW]
    assert not lacking, (
        "These raises do not show what was received. Put the value in the message (STYLE.md rule 6: "
        "'Expected X. Received: x=3 (of type int). Fix: ...'), or, if there truly is no value, list the raise "
        "in NO_VALUE_TO_SHOW with the reason:\n" + "\n".join(lacking))
    keys = {(rel, scope, kind) for rel, scope, kind, _, msg in found if not _interpolates(msg)}
    stale = sorted(set(NO_VALUE_TO_SHOW) - keys)
    assert not stale, f"NO_VALUE_TO_SHOW lists raises that are gone or now show a value: {stale}"


def test_typical_wrong_uses_show_the_value_and_the_fix(trainer):
    x, y, _, _ = flat_digits(16)
    with pytest.raises(TypeError, match=r"received 3 \(of type int\).*np\.asarray"):
        trainer.fit(3, batch_size=8, verbose=0)
    with pytest.raises(TypeError, match=r"received \[0\.5, 2\.0\] \(of type list\).*class_weight=\{0: 1\.0"):
        trainer.train_on_batch(x, y, class_weight=[0.5, 2.0])
    with pytest.raises(ValueError, match=r"received both: class_weight=\{0: 2\.0\}.*Multiply"):
        trainer.train_on_batch(x, y, class_weight={0: 2.0}, sample_weight=np.ones(16))
    with pytest.raises(ValueError, match=r"received an empty list.*non-empty dataset"):
        trainer.fit([], batch_size=8, verbose=0)
    with pytest.raises(ValueError, match=r"0 examples \(x: 0 rows, y: 0 rows\).*at least one example"):
        trainer.fit(x[:0], y[:0], batch_size=8, verbose=0)
    _assert_nothing_compiled(trainer)


def test_strategy_api_errors_show_the_value_and_the_fix():
    s = strategy(2)
    x = np.zeros((8, 3), np.float32)
    with pytest.raises(ValueError, match=r"Received: batch_size=None.*batch_size=256"):
        s.experimental_distribute_dataset((x,))
    with pytest.raises(ValueError, match=r"received shuffle=True with data of type list_iterator.*shuffle=False"):
        s.experimental_distribute_dataset(iter([x]), shuffle=True)
    with pytest.raises(TypeError, match=r"received 5 \(of type int\).*tf\.data\.Dataset"):
        s.experimental_distribute_dataset(5)
    with pytest.raises(ValueError, match=r"batch 0 must hold at least one array; received \{\}.*\(x, y\)"):
        list(s.experimental_distribute_dataset(iter([{}])))
    with pytest.raises(ValueError, match=r"devices=\(\) has no device.*jax\.devices\(\)\[:2\]"):
        mx.MirroredStrategy(devices=())


def test_functional_model_errors_show_the_value_and_the_fix():
    import optax

    with pytest.raises(TypeError, match=r"received 'relu' \(of type str\).*apply_fn\(params, x\)"):
        mx.FunctionalModel("relu", {}, loss="mse", optimizer=optax.sgd(0.1))  # type: ignore[arg-type]
    fm = mx.FunctionalModel(lambda p, x: x @ p["w"], {"w": np.zeros((3, 2), np.float32)}, loss="mse",
                            optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"received mixed_precision='bfloat16' with a FunctionalModel.*Drop"):
        mx.Trainer(fm, strategy(1), mixed_precision="bfloat16")
