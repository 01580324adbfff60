"""mirrorax.packed: small leaves travel as one vector per dtype, large ones as they are."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mirrorax.packed import MAX_PACKED_SIZE, Packed, pack, unpacked


def tree() -> dict:
    return {"loss": {"total": np.float32(2.5), "count": np.float32(4.0)},
            "auc": {"thresholds": np.arange(8, dtype=np.float32), "hits": np.zeros(3, np.int32)},
            "big": np.ones(MAX_PACKED_SIZE + 1, np.float32), "half": np.ones((2, 2), ml_dtypes.bfloat16),
            "seed": jax.random.key(0)}


def assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.shape(x) == np.shape(y) and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_one_vector_per_dtype_and_large_or_key_leaves_as_they_are():
    p = pack(tree())
    # (groups in the order of their first leaf, in the tree's order: auc/hits, auc/thresholds, half)
    assert p.names == ("int32", "float32", "bfloat16", "big", "seed")
    assert [np.shape(a) for a in jax.tree.leaves(p)] == [(3,), (10,), (4,), (MAX_PACKED_SIZE + 1,), ()]
    assert isinstance(p.arrays[0], np.ndarray)  # host values pack on the host
    assert_same(p.unpack(), tree())
    assert unpacked(p) is not p and unpacked(tree()["loss"]) == tree()["loss"]


def test_traced_round_trip_and_tree_maps_keep_the_layout():
    @jax.jit
    def add(p: Packed) -> Packed:
        t = p.unpack()
        return pack(dict(t, loss={"total": t["loss"]["total"] + 1, "count": t["loss"]["count"] * 2}))

    out = add(pack(tree()))
    assert jax.tree.structure(out) == jax.tree.structure(pack(tree()))
    assert float(out.unpack()["loss"]["total"]) == 3.5 and float(out.unpack()["loss"]["count"]) == 8.0
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out)
    assert jax.tree.map(np.shape, abstract.unpack())["auc"] == {"thresholds": (8,), "hits": (3,)}
    host = jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else np.asarray(a), out)
    assert_same(host.unpack(), dict(tree(), loss={"total": np.float32(3.5), "count": np.float32(8.0)}))


def test_stored_form_is_a_plain_dict_that_restores_into_the_layout():
    p = pack(tree())
    stored = p.stored()
    assert list(stored) == list(p.names)
    again = p.from_stored(stored)
    assert jax.tree.structure(again) == jax.tree.structure(p)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(p)[0]]
    assert paths == ["['int32']", "['float32']", "['bfloat16']", "['big']", "['seed']"]


def test_an_empty_tree_packs_to_no_leaves():
    p = pack({})
    assert jax.tree.leaves(p) == [] and p.unpack() == {}
