"""The non-finite guard's branch takes the kernels' gradients as the backward pass made them.

A dense kernel's gradient is ``transpose(dot(...))``; passed into the guard's ``lax.cond`` as it is,
XLA:CPU copied every kernel gradient into the default layout on every device (7% of the MLP step at 8
CPU devices). ``split_transposes`` passes the transpose's input instead and applies it in the branch.
On one device a matrix's transpose stays: XLA folds it into the dot there (the MLP's step 25% slower with
it split).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrorax as mx
from mirrorax.as_made import split_transposes
from tests import helpers
from tests.test_batch_sums import _data, _model


def _loss(params, x):
    return jnp.sum(jnp.tanh(x @ params["w"] + params["b"]) ** 2)


def _grads_and_loss(params, x):
    loss, grads = jax.value_and_grad(_loss)(params, x)
    return grads, loss


def test_transposed_gradients_come_as_made_and_restore_to_the_same_values():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    shapes = {}

    @jax.jit
    def run(params, x):
        (made, loss), restore = split_transposes(_grads_and_loss, params, x)
        shapes.update(jax.tree.map(lambda a: a.shape, made))
        return restore(made), loss

    grads, loss = run(params, x)
    want_grads, want_loss = jax.jit(_grads_and_loss)(params, x)
    # The kernel's gradient left the function as the (3, 5) product it is a transpose of; the bias's
    # (a sum, no transpose) is as it was.
    assert shapes == {"w": (3, 5), "b": (3,)}
    np.testing.assert_array_equal(np.asarray(grads["w"]), np.asarray(want_grads["w"]))
    np.testing.assert_array_equal(np.asarray(grads["b"]), np.asarray(want_grads["b"]))
    assert float(loss) == float(want_loss)


def test_on_one_device_a_matrix_transpose_stays_and_higher_ranks_are_split():
    def grads_and_loss(params, x):
        def loss(p):
            h = x @ p["w"] + jnp.einsum("bi,ihk->bhk", x, p["e"]).sum(-1)
            return jnp.sum(jnp.tanh(h) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return grads, value

    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
              "e": jnp.asarray(rng.normal(size=(5, 3, 2)), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
    for one_device, want in ((True, {"w": (5, 3), "e": (3, 2, 5)}), (False, {"w": (3, 5), "e": (3, 2, 5)})):
        shapes = {}

        @jax.jit
        def run(params, x, one_device=one_device, shapes=shapes):
            (made, loss), restore = split_transposes(grads_and_loss, params, x, one_device=one_device)
            shapes.update(jax.tree.map(lambda a: a.shape, made))
            return restore(made)

        grads = run(params, x)
        assert shapes == want, one_device
        want_grads = jax.jit(grads_and_loss)(params, x)[0]
        for name in ("w", "e"):
            np.testing.assert_array_equal(np.asarray(grads[name]), np.asarray(want_grads[name]))


def test_mixed_precision_gradients_come_before_their_cast():
    # Under mixed precision a kernel's gradient is cast(transpose(dot)): it leaves as the bf16 product.
    def grads_and_loss(params, x):
        def loss(p):
            h = x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16)
            return jnp.sum(jnp.tanh(h).astype(jnp.float32) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return grads, value

    params = {"w": jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32)}
    x = jnp.ones((4, 5), jnp.float32)
    made = {}

    @jax.jit
    def run(params, x):
        (grads, loss), restore = split_transposes(grads_and_loss, params, x)
        made["w"] = (grads["w"].shape, grads["w"].dtype)
        return restore(grads)

    grads = run(params, x)
    assert made["w"] == ((3, 5), jnp.bfloat16)
    assert grads["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(grads["w"]), np.asarray(jax.jit(grads_and_loss)(params, x)[0]["w"]))


def test_a_function_with_callbacks_is_called_as_it_is():
    def noisy(params, x):
        jax.debug.callback(lambda: None)
        return _grads_and_loss(params, x)

    params = {"w": jnp.ones((5, 3)), "b": jnp.zeros(3)}
    out = jax.jit(lambda p, x: split_transposes(noisy, p, x)[0])(params, jnp.ones((4, 5)))
    assert out[0]["w"].shape == (5, 3)


def _cond_operands_made_by(trainer, x, y) -> list[str]:
    """What made each operand of the guard's branch (``lax.cond``) in ``trainer``'s train step."""
    args = helpers.train_step_args(trainer, x, y)  # first: fit selects the step variant ``train`` names
    jaxpr = jax.make_jaxpr(trainer.steps.train._fn)(*args).jaxpr
    made_by = {v: eqn.primitive.name for eqn in jaxpr.eqns for v in eqn.outvars}
    conds = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
    assert conds, "the guarded step has no branch"
    return [made_by.get(v, "input") for eqn in conds for v in eqn.invars]


@pytest.mark.multi_device
@pytest.mark.parametrize("on_nonfinite", ["raise", pytest.param("skip", marks=pytest.mark.slow)])
def test_no_gradient_enters_the_guard_transposed(on_nonfinite):
    x, y = _data()
    made_by = _cond_operands_made_by(mx.Trainer(_model(), helpers.strategy(8), on_nonfinite=on_nonfinite), x, y)
    assert "dot_general" in made_by  # the kernels' gradients, as the backward pass's products made them
    assert "transpose" not in made_by


def test_on_one_device_the_kernels_gradients_enter_the_guard_as_the_dot_folds_them():
    x, y = _data()
    made_by = _cond_operands_made_by(mx.Trainer(_model(), helpers.strategy(1)), x, y)
    # the dense kernels' gradients: transpose(dot), which XLA turns into one dot in the branch's layout
    assert "transpose" in made_by
