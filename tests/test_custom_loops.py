"""Custom training loops on the strategy's own API."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mirrorax as mx
from helpers import strategy

pytestmark = pytest.mark.multi_device


def _batches(dist):
    """Every batch of one pass as host values: (data, mask, num_real)."""
    return [(jax.tree.map(np.asarray, b.data), np.asarray(b.mask), float(b.num_real)) for b in dist]



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


# -- DistributedBatch ---------------------------------------------------------------------------------
def test_iterable_of_ragged_batches():
    s = strategy(3)
    rng = np.random.default_rng(0)
    items = [(rng.normal(size=(n, 3)).astype(np.float32), np.arange(n)) for n in (5, 5, 2)]
    host = _batches(s.experimental_distribute_dataset(items))
    assert [n for _, _, n in host] == [5, 5, 2]
    for (xb, yb), mask, n in host:
        assert xb.shape == (6, 3) and yb.shape == (6,)  # 5 rows rounded up to the device count
        assert mask.sum() == n
    np.testing.assert_array_equal(host[2][0][0][host[2][1] > 0], items[2][0])
    # dict-structured items keep their structure
    dicts = [{"image": np.ones((n, 2, 2), np.float32), "label": np.zeros((n,), np.int32)} for n in (4, 1)]
    batches = list(s.experimental_distribute_dataset(dicts))
    assert set(batches[1].data) == {"image", "label"}
    assert batches[1].data["image"].shape == (6, 2, 2) and float(batches[1].num_real) == 1
    # a later item larger than the first (the batch size) is refused, with the fix in the message
    with pytest.raises(ValueError, match="batch_size"):
        list(s.experimental_distribute_dataset([(np.ones((3, 1)),), (np.ones((4, 1)),)]))
