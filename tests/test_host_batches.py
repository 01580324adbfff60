"""Host-side batching of ``experimental_distribute_dataset``: which rows each process builds, the padding
mask and the real count, checked with stand-in strategies (no device, no compilation, no processes)."""

from types import SimpleNamespace

import numpy as np
import pytest

from mirrorax.inputs.distributed import DistributedDataset


def _fake(replicas: int, processes: int = 1, index: int = 0):
    return SimpleNamespace(num_replicas_in_sync=replicas, process_count=processes, process_index=index)


def _host(ds, pass_index=0):
    if ds._source is not None:
        return list(ds._array_batches(pass_index))
    # (a full item of the signature already seen comes as its leaves, for the placement's fast path)
    return [b if not isinstance(b, list) else
            SimpleNamespace(x=ds._full.treedef.unflatten(b), rows=ds._full.rows, mask=np.ones(ds._full.rows))
            for b in ds._iterable_batches()]


def test_arrays_are_cut_padded_and_masked_per_process():
    x = np.arange(10, dtype=np.float32)[:, None]
    for index in (0, 1):  # 2 processes x 2 devices, global batch 3 -> padded to 4: 2 rows per process
        ds = DistributedDataset(_fake(4, 2, index), (x, np.arange(10)), batch_size=3)
        batches = _host(ds)
        assert len(batches) == 4 and len(ds) == 4
        rows = [b.x[0][:, 0].tolist() for b in batches]
        masks = [b.mask.tolist() for b in batches]
        if index == 0:
            assert rows == [[0, 1], [3, 4], [6, 7], [9, 9]] and masks == [[1, 1], [1, 1], [1, 1], [1, 0]]
        else:  # process 1: the third row of each batch, then padding (a copy of a real row, masked)
            assert rows == [[2, 0], [5, 3], [8, 6], [9, 9]] and masks == [[1, 0], [1, 0], [1, 0], [0, 0]]
        assert [b.num_real for b in batches] == [3, 3, 3, 1]  # the global count, on every process
        assert [b.rows for b in batches] == [3, 3, 3, 1]  # and static: the global view cuts each batch to it


def test_shuffle_order_depends_on_seed_and_pass_not_on_devices():
    x = np.arange(40, dtype=np.float32)[:, None]
    orders = {}
    for replicas in (1, 8):
        ds = DistributedDataset(_fake(replicas), x, batch_size=8, shuffle=True, seed=5)
        orders[replicas] = [np.concatenate([b.x[m > 0][:, 0] for b, m in ((b, b.mask) for b in _host(ds, p))])
                            for p in (0, 1)]
    assert sorted(orders[1][0]) == list(range(40))
    np.testing.assert_array_equal(orders[1][0], orders[8][0])
    assert not np.array_equal(orders[1][0], orders[1][1])  # each pass its own order


def test_iterable_batches_padded_to_the_first_batch_size():
    items = [(np.ones((4, 2)), np.zeros(4)), (np.ones((3, 2)), np.zeros(3)), ({"a": 1},)]
    ds = DistributedDataset(_fake(4), items[:2])
    batches = _host(ds)
    assert ds.batch_size == 4 and [b.mask.tolist() for b in batches] == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert [b.num_real for b in batches] == [4, 3]
    assert [b.rows for b in batches] == [4, 3]  # an iterable of global batches: its padding at the end
    with pytest.raises(ValueError, match="more than batch_size=4"):
        _host(DistributedDataset(_fake(4), [(np.ones((4, 2)),), (np.ones((6, 2)),)]))
    with pytest.raises(ValueError, match="batch_size is required"):
        DistributedDataset(_fake(4), np.ones((4, 2)))
    with pytest.raises(ValueError, match="shuffle=True applies to arrays"):
        DistributedDataset(_fake(4), items[:2], shuffle=True)


def test_per_process_pipelines_on_several_processes_leave_the_count_to_the_devices():
    from mirrorax.inputs.iterables import PerProcessDataset
    from mirrorax.inputs.source import InputContext

    items = [(np.ones((2, 2)),), (np.ones((1, 2)),)]  # this process's share of global batches of 4
    ds = DistributedDataset(_fake(4, 2, 0), PerProcessDataset(items, InputContext(2, 0, 4)))
    batches = list(ds._iterable_batches())
    # each process pads its own share: the global count, and where the padding sits, only the devices know
    assert [b.mask.tolist() for b in batches] == [[1, 1], [1, 0]]
    assert [b.num_real for b in batches] == [None, None] and [b.rows for b in batches] == [None, None]


def _pipeline(rows: int, ctx, size: str, global_batch: int = 8):
    """TF's ``dataset_fn``: this pipeline's shard of ``rows`` numbered rows, batched by the size ``size`` asks."""
    ask = ctx.get_per_replica_batch_size if size == "replica" else ctx.get_per_pipeline_batch_size
    batch = ask(global_batch)
    mine = np.arange(rows, dtype=np.float32)[ctx.input_pipeline_id::ctx.num_input_pipelines]
    return [(mine[lo:lo + batch, None],) for lo in range(0, len(mine), batch)]


@pytest.mark.parametrize("size", ["replica", "pipeline"])
def test_per_replica_batches_make_tfs_global_batch_on_2_processes_x_2_devices(size):
    # TF's tutorial batches each pipeline by get_per_replica_batch_size(global): each replica takes its
    # own batch, so a global batch of 8 is 4 replicas' batches of 2 (each process's two consecutive
    # ones). Batched by the per-pipeline size, each item is already the process's share of 4.
    from mirrorax.inputs.iterables import PerProcessDataset
    from mirrorax.inputs.source import InputContext

    per_process = []
    for index in (0, 1):
        ctx = InputContext(2, index, 4)
        ds = DistributedDataset(_fake(4, 2, index), PerProcessDataset(_pipeline(21, ctx, size), ctx))
        batches = _host(ds)
        per_process.append([b.x[0][:, 0][b.mask > 0].tolist() for b in batches])
        assert [len(b.mask) for b in batches] == [4, 4, 4] and ds.batch_size == 8
    # process 0 holds the even rows, process 1 the odd ones: each global batch is 8 consecutive rows
    assert per_process[0] == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18, 20]]
    assert per_process[1] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19]]


def test_per_replica_batches_on_one_process_make_the_global_batch_with_its_count():
    from mirrorax.inputs.iterables import PerProcessDataset
    from mirrorax.inputs.source import InputContext

    ctx = InputContext(1, 0, 4)
    ds = DistributedDataset(_fake(4), PerProcessDataset(_pipeline(21, ctx, "replica"), ctx))
    batches = _host(ds)
    assert [b.rows for b in batches] == [8, 8, 5] and len(ds) == 3  # 11 items of 2 rows (the last 1), 4 a step
    assert batches[2].x[0][:5, 0].tolist() == [16, 17, 18, 19, 20]


def test_a_pipeline_that_asks_no_size_is_read_by_process_and_refused_when_it_looks_per_replica():
    # Items of one replica's rows (2 of a global 8 on 4 replicas) read as the process's share would
    # train on global batches 4 times smaller: with the global batch known, that is refused.
    from mirrorax.inputs.iterables import PerProcessDataset
    from mirrorax.inputs.source import InputContext

    items = [(np.ones((2, 1), np.float32),)] * 3
    with pytest.raises(ValueError, match=r"get_per_replica_batch_size\(8\)"):
        _host(DistributedDataset(_fake(4), PerProcessDataset(items, InputContext(1, 0, 4)), batch_size=8))
    batches = _host(DistributedDataset(_fake(4), PerProcessDataset(items, InputContext(1, 0, 4))))
    assert [b.rows for b in batches] == [2, 2, 2]  # no global batch given: each item is the process's share
