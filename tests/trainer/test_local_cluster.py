"""The simulated Ray cluster a local run trains on (`rlhf_trainer.cluster.local`): one
node per pool replica, each with its pool's label and resource, and no node of Ray's
head's own: the first pool's first node is the head, and so cannot be killed."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_trainer.api.names import POOL_LABEL, pool_resource
from tests.specs import local_job


def test_every_node_is_a_pool_replica_and_the_head_is_the_first_pools_first() -> None:
    import ray

    from rlhf_trainer.cluster.local import local_ray_cluster

    # The local example split: two pools, then one more node of the second.
    config = local_job(
        colocated=False, total_steps=1, checkpoint_dir=Path("/unused"), every_steps=1
    )
    first, second = (pool.name for pool in config.pools)
    with local_ray_cluster(config) as cluster:
        cluster.add_node(second)
        nodes = {node["NodeID"]: node for node in ray.nodes() if node["Alive"]}
        assert sorted(node["Labels"][POOL_LABEL] for node in nodes.values()) == sorted(
            [first, second, second]
        )
        for node in nodes.values():
            pool = node["Labels"][POOL_LABEL]
            assert node["Resources"][pool_resource(pool)] == node["Resources"]["GPU"] == 1
        head = cluster.cluster.head_node.node_id
        assert nodes[head]["Labels"][POOL_LABEL] == first
        with pytest.raises(ValueError, match=r"holds Ray's head \(its GCS\)"):
            cluster.kill_node(head)
        assert all(node["Alive"] for node in ray.nodes() if node["NodeID"] in nodes)
