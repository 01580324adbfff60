"""``strategy.cluster_resolver``: the task type, id and cluster spec TF's resolver reports, from ``TF_CONFIG``
or one process. A job of 2 processes under ``mirrorax launch`` and under ``TF_CONFIG``:
``tests/test_tf_multi_worker.py``."""

from __future__ import annotations

import pytest
from helpers import strategy


def test_cluster_resolver_on_one_process_is_tfs_single_worker():
    resolver = strategy(2).cluster_resolver
    assert (resolver.task_type, resolver.task_id, resolver.cluster_spec().as_dict()) == (None, 0, {})
    assert resolver.master() == "" and not resolver.cluster_spec()


def test_cluster_resolver_reads_tf_config(monkeypatch):
    from mirrorax.cluster.resolver import ClusterResolver

    config = '{"cluster": {"chief": ["h0:1"], "worker": ["h1:2", "h2:3"]}, "task": {"type": "worker", "index": 1}}'
    monkeypatch.setenv("TF_CONFIG", config)
    resolver = ClusterResolver.for_this_process()
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    spec = resolver.cluster_spec()
    assert spec.as_dict() == {"chief": ["h0:1"], "worker": ["h1:2", "h2:3"]} and "chief" in spec.as_dict()
    assert spec.num_tasks("worker") == 2 and spec.task_address("chief", 0) == "h0:1"
    assert resolver.master() == "grpc://h2:3"
    with pytest.raises(ValueError, match="No task of type 'ps'"):
        spec.num_tasks("ps")
