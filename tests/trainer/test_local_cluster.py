"""The simulated Ray cluster a local run trains on (`rlhf_trainer.cluster.local`): one
node per pool replica, each with its pool's label and resource, and no node of Ray's
head's own: the first pool's first node is the head, and so cannot be killed. Without
CUDA it starts whatever CUDA_VISIBLE_DEVICES says, and its workers see no device."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.api.names import POOL_LABEL, pool_resource
from tests.specs import local_job
from tests.unit.conftest import EXAMPLES, load


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


def test_on_a_cuda_machine_each_node_hands_its_workers_its_own_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray gives a node's GPU workers the ids in the CUDA_VISIBLE_DEVICES it started with
    (here ids of a machine that is not this one: Ray does not check them)."""
    import ray

    from rlhf_trainer.cluster.local import MachineGpus, local_ray_cluster

    monkeypatch.setattr(
        MachineGpus, "of_this_machine", classmethod(lambda _: MachineGpus(["5", "7", "9"]))
    )
    config = local_job(
        colocated=False, total_steps=1, checkpoint_dir=Path("/unused"), every_steps=1
    )
    first, second = (pool.name for pool in config.pools)

    @ray.remote(num_gpus=1)
    def devices() -> tuple[list[str], str | None]:
        import os

        return [str(i) for i in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")

    def on(pool: str) -> tuple[list[str], str | None]:
        return ray.get(devices.options(resources={pool_resource(pool): 1}).remote())

    with local_ray_cluster(config) as cluster:
        assert (on(first), on(second)) == ((["5"], "5"), (["7"], "7"))
        cluster.add_node(first)  # the one device left
        assert cluster.gpus.free == []
        with pytest.raises(ValueError, match=r"pools\[policy\] needs 1 GPUs for a node"):
            cluster.add_node(first)


@pytest.mark.parametrize(
    "visible",
    [None, "", "0", "5,7"],
    ids=["unset", "empty", "one id", "ids that do not exist"],
)
def test_without_cuda_the_example_starts_whatever_cuda_visible_devices_says(
    visible: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make demo`'s cluster on this CUDA-less machine: Ray refuses a node with more GPUs
    than CUDA_VISIBLE_DEVICES lists (an empty one: none), so the nodes start without it;
    their logical GPUs are the pools'; every worker is given it empty, so torch and vLLM
    in a role never take a device; and the driver's setting is as it was."""
    import ray
    import torch

    from rlhf_trainer.cluster.local import local_ray_cluster

    assert not torch.cuda.is_available(), "this test is for a machine without CUDA"
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    manifest = load(EXAMPLES[0].parent / "local-cpu.yaml")
    config = parse_job(manifest).spec.job_config()

    @ray.remote(num_gpus=1)
    def devices() -> tuple[str | None, bool]:
        import os

        import torch

        return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()

    with local_ray_cluster(config):
        assert ray.cluster_resources()["GPU"] == 2  # policy and value, one node each
        seen = ray.get(
            [
                devices.options(resources={pool_resource(pool.name): 1}).remote()
                for pool in config.pools
            ]
        )
        assert seen == [("", False), ("", False)]
    import os

    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
