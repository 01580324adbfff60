"""Custom training loops on the strategy's own API."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrorax as mx
from helpers import strategy

pytestmark = pytest.mark.multi_device



# -- run ------------------------------------------------------------------------------------------------
def test_run_gradient_of_the_state_is_already_summed():
    """The all_reduce bug: summing the replicas' gradients again multiplied them by the replica count."""
    s = strategy(3)
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    batch = next(iter(s.experimental_distribute_dataset((x,), batch_size=6)))
    w = s.replicate(np.ones(2, np.float32))

    def grad(w, batch):
        (rows,) = batch.data
        return jax.grad(lambda w: mx.compute_average_loss(rows @ w, batch))(w)

    np.testing.assert_allclose(np.asarray(s.run(grad, args=(w, batch))), x.mean(axis=0), rtol=1e-6)
    with pytest.raises(ValueError, match="already the same on every replica"):
        s.run(lambda w, b: mx.get_replica_context().all_reduce("sum", grad(w, b)), args=(w, batch))
