"""spec.pools[] and spec.head as the operator sees them: what each pool's KubeRay worker
group and the head pod get besides the trainer's view of a pool (api/config.PoolConfig).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

from rlhf_operator.api.podspec import (
    Affinity,
    NodeSelector,
    PodResources,
    Quantity,
    Toleration,
)
from rlhf_trainer.api.config import Device, PoolConfig
from rlhf_trainer.api.rules import Rule, SpecModel

# A resource name, qualified (rdma/hca_shared_devices_a) or not (hugepages-2Mi).
ResourceName = Annotated[
    str,
    StringConstraints(
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        max_length=253,
    ),
]
SHM_SIZE_DESCRIPTION = (
    "Size limit of the pod's /dev/shm (memory-backed: NCCL and Ray's object store use it, "
    "and on CPU pools the weight transfer: two buckets on the actor's pod and on each "
    "engine's from another pod, and a copy of the policy per engine that may restart; "
    "it counts against the pod's memory). Unset: bounded by the memory limit only."
)


# What each GPU (or CPU slot) of a pool gets when the pool sets no resources: without cpu
# and memory a pod is Burstable with no memory request (the first evicted), and Ray counts
# the whole node's. Modest for GPU nodes, so that they fit; raise them in pools[].resources.
RESOURCES_PER_DEVICE = {Device.GPU: (4, 32), Device.CPU: (1, 4)}  # (CPUs, GiB) each


class Pool(PoolConfig):
    """A GPU pool: one KubeRay worker group, pinned to its own node group."""

    gpu_resource: str = Field(
        "nvidia.com/gpu",
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)"
        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description="Extended resource name of the GPUs, e.g. nvidia.com/gpu or amd.com/gpu.",
    )
    node_selector: NodeSelector | None = None
    affinity: Affinity | None = None
    tolerations: list[Toleration] | None = Field(
        None, max_length=32, description="Tolerations of this pool's pods (e.g. the GPU taint)."
    )
    resources: PodResources | None = Field(
        None,
        description=(
            "CPU and memory of each node's pod. Unset (either of them): 4 CPUs and 32Gi per "
            "GPU, or 1 CPU and 4Gi per CPU slot."
        ),
    )
    extra_resources: dict[ResourceName, Quantity] | None = Field(
        None,
        max_length=8,
        description="More resources each node's pod requests, e.g. {rdma/hca_shared_devices_a: 1}.",
    )
    shm_size: Quantity | None = Field(None, description=SHM_SIZE_DESCRIPTION)

    def pod_resources(self) -> PodResources:
        """CPU and memory of each of the pool's pods: the spec's, else the defaults."""
        cpus, gib = RESOURCES_PER_DEVICE[self.device]
        defaults = PodResources(
            cpu=cpus * self.gpus_per_node, memory=f"{gib * self.gpus_per_node}Gi"
        )
        return (self.resources or PodResources()).filled(defaults)

    rules = (
        *PoolConfig.rules,
        Rule(
            "extraResources",
            "cpu, memory and the pool's gpuResource are set elsewhere (resources, gpusPerNode)",
            "!has(self.extraResources) || self.extraResources.all(k, "
            "!(k in ['cpu', 'memory', self.gpuResource]))",
            lambda p: not {"cpu", "memory", p.gpu_resource} & set(p.extra_resources or {}),
            lambda p: f"got {sorted(p.extra_resources or {})}",
        ),
    )


class HeadSpec(SpecModel):
    """The Ray head pod: CPU only; it runs the training driver."""

    node_selector: NodeSelector | None = None
    tolerations: list[Toleration] | None = Field(
        None, max_length=32, description="Tolerations of the head pod."
    )
    resources: PodResources | None = Field(None, description="CPU and memory of the head pod.")
    shm_size: Quantity | None = Field(None, description=SHM_SIZE_DESCRIPTION)
