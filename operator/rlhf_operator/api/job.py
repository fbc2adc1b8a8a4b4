"""The RLHFJob API (rlhf.dev/v1alpha1): the single source of truth.

The CRD under crds/ is generated from these models (`make crds`). The trainer-facing
part of the spec is `rlhf_trainer.config.JobConfig`; `RLHFJobSpec` extends it with what
only Kubernetes needs (image, pod placement, separation, suspend).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import ConfigDict, Field

from rlhf_operator.api.agents import AgentSpec
from rlhf_operator.api.environments import EnvironmentSpec
from rlhf_operator.api.podspec import JOB_NAME_PATTERN as JOB_NAME_PATTERN  # re-exported
from rlhf_operator.api.podspec import MAX_JOB_NAME as MAX_JOB_NAME
from rlhf_operator.api.podspec import (
    PodSettings,
    Volume,
)
from rlhf_operator.api.pools import HeadSpec, Pool
from rlhf_operator.api.status import AttemptFailure as AttemptFailure  # status, re-exported
from rlhf_operator.api.status import Condition as Condition
from rlhf_operator.api.status import Phase as Phase
from rlhf_operator.api.status import PoolStatus as PoolStatus
from rlhf_operator.api.status import RLHFJobStatus as RLHFJobStatus
from rlhf_trainer.api.config import (
    POOLS_DESCRIPTION,
    POOLS_LIST_MAP,
    JobConfig,
)
from rlhf_trainer.api.config import Device as Device  # pools[].device, re-exported
from rlhf_trainer.api.names import GROUP as GROUP  # the API's names, re-exported
from rlhf_trainer.api.names import PLURAL as PLURAL
from rlhf_trainer.api.names import VERSION as VERSION
from rlhf_trainer.api.rules import Rule, SpecModel
from rlhf_trainer.api.sections import OutputConfig

API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLHFJob"
SINGULAR = "rlhfjob"
SHORT_NAMES = ["rlhf"]

# What may change on an existing job. Everything else is fixed at creation: the CRD's
# transition rules reject other changes at admission. Replicas resize a pool's worker
# group; suspend stops and restarts the job.
MUTABLE_SPEC_FIELDS = ("suspend", "pools", "environments")
# Of a pool or an environment; name is the key the API server matches old and new items by.
MUTABLE_ITEM_FIELDS = ("name", "replicas")


class RestartPolicy(SpecModel):
    """What the operator does when an attempt (the job's RayJob) fails."""

    max_restarts: int = Field(
        0,
        ge=0,
        le=100,
        description=(
            "New attempts after a failure (a trainer crash, a lost node, a dead engine); "
            "each resumes from the newest checkpoint on checkpointClaim. 0: a failure is final."
        ),
    )
    backoff_seconds: int = Field(30, ge=0, le=3600, description="Wait before each new attempt.")


class Separation(StrEnum):
    NODE = "node"  # pools never share a node
    GPU = "gpu"  # pools may share a node, splitting its GPUs


_SHARED_NODE_CEL = (
    "self.separation != 'gpu' || self.pools.all(a, self.pools.all(b, "
    "a.gpuResource == b.gpuResource && (!has(a.nodeSelector) || !has(b.nodeSelector) || "
    "a.nodeSelector.all(k, !(k in b.nodeSelector) || a.nodeSelector[k] == b.nodeSelector[k]))))"
)


# Where checkpointClaim is mounted when trainer.checkpoint.path is unset.
CHECKPOINT_MOUNT = "/checkpoints"
_CEL_CHECKPOINT_PATH = (
    f"(has(self.trainer.checkpoint.path) ? self.trainer.checkpoint.path : '{CHECKPOINT_MOUNT}')"
)


# Where output.claim is mounted; output.path lies below it.
OUTPUT_MOUNT = "/output"
CLAIM_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class OutputSpec(OutputConfig):
    """Where the trained policy goes: a directory on a claim every pod mounts."""

    claim: str | None = Field(
        None,
        pattern=CLAIM_NAME,
        max_length=253,
        description=(
            f"A PersistentVolumeClaim of its own for the export, mounted at {OUTPUT_MOUNT} on "
            "the head and every worker (ReadWriteMany, or ReadWriteOnce on one node); "
            f"path must then lie below {OUTPUT_MOUNT}. Unset: path lies on checkpointClaim "
            "or a pods.volumes claim."
        ),
    )


def _below(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip("/") + "/")


def _holds(volume: Volume, path: str) -> bool:
    """Whether `volume` is a writable claim that `path` lies on (so every pod sees it)."""
    on_it = path == volume.mount_path or path.startswith(volume.mount_path + "/")
    return on_it and volume.persistent_volume_claim is not None and not volume.read_only


def _can_share_nodes(a: Pool, b: Pool) -> bool:
    if a.gpu_resource != b.gpu_resource:
        return False
    left, right = a.node_selector or {}, b.node_selector or {}
    return all(right.get(key, value) == value for key, value in left.items())


class RLHFJobSpec(JobConfig):
    """An RLHF (PPO) job: GPU pools, which role runs where, models, data and schedule."""

    image: str = Field(
        "rlhf-trainer:0.1.0", min_length=1, description="The trainer image (runs Ray and PPO)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy of the trainer image."
    )
    pools: list[Pool] = Field(  # type: ignore[assignment]  # narrows JobConfig's pools
        min_length=1, max_length=16, description=POOLS_DESCRIPTION, json_schema_extra=POOLS_LIST_MAP
    )
    environments: list[EnvironmentSpec] = Field(  # type: ignore[assignment]  # narrows JobConfig's
        default_factory=list,
        max_length=16,
        description=(
            "Environment servers that multi-turn episodes run in: each at its url, or run by "
            "the operator as the job's own Deployment and Service (serve, or image and "
            "command). Names must be unique."
        ),
        json_schema_extra=POOLS_LIST_MAP,
    )
    agents: list[AgentSpec] = Field(  # type: ignore[assignment]  # narrows JobConfig's
        default_factory=list,
        max_length=16,
        description=(
            "Agent services that generation.agent episodes run on: each at its url, or run "
            "by the operator as the job's own Deployment and Service (serve, or image and "
            "command), whose pods may reach only the rollout pool's gateway, the cluster's "
            "DNS and what egress allows. Names must be unique. Fixed at creation."
        ),
        json_schema_extra=POOLS_LIST_MAP,
    )
    separation: Separation = Field(
        Separation.NODE,
        description=(
            "node: pools never share a node (required pod anti-affinity); "
            "gpu: pools may share a node and split its GPUs."
        ),
    )
    head: HeadSpec = Field(default_factory=HeadSpec, description="The Ray head pod.")
    pods: PodSettings = Field(
        default_factory=PodSettings,
        description="What every pod gets: volumes, env, pull secrets, priority, labels.",
    )
    suspend: bool = Field(
        False, description="Suspend the job: its Ray cluster is deleted; resume to restart."
    )
    restart_policy: RestartPolicy = Field(
        default_factory=RestartPolicy, description="Restarts after a failed attempt."
    )
    scheduler_name: Literal["volcano", "yunikorn", "scheduler-plugins"] | None = Field(
        None,
        description=(
            "A gang scheduler for the Ray cluster's pods, so that a job's pools start "
            "together or not at all: passed to KubeRay as the ray.io/scheduler-name label "
            "(the KubeRay operator must run with that batch scheduler enabled)."
        ),
    )
    queue_name: str | None = Field(
        None,
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description=(
            "A Kueue LocalQueue in the job's namespace. The RayJob is created suspended "
            "with the kueue.x-k8s.io/queue-name label, and starts when Kueue admits it "
            "under its ClusterQueue's quota; until then the job is Queued, with Kueue's "
            "reason. Suspending a queued job deactivates its Kueue Workload."
        ),
    )
    output: OutputSpec | None = Field(
        None,
        description=(
            "Write the trained policy as a Hugging Face directory (safetensors, config, "
            "tokenizer) at the end, and every trainer.export.everySteps; status.training.output "
            "names it and its step."
        ),
    )
    checkpoint_claim: str | None = Field(
        None,
        pattern=CLAIM_NAME,
        max_length=253,
        description=(
            "A ReadWriteMany PersistentVolumeClaim mounted at trainer.checkpoint.path "
            "(default /checkpoints) on the head and every worker: every rank writes its "
            "shard of a checkpoint there, and a restarted job resumes from it. Without one "
            "(or a path on a claim of pods.volumes) the job keeps no checkpoints."
        ),
    )

    rules = (
        *JobConfig.rules,
        Rule(
            "trainer.checkpoint.path",
            "must be an absolute path outside /etc/rlhf and /dev/shm when checkpointClaim "
            "mounts a volume there",
            f"!has(self.checkpointClaim) || ({_CEL_CHECKPOINT_PATH}.startsWith('/') && "
            f"!{_CEL_CHECKPOINT_PATH}.startsWith('/etc/rlhf') && "
            f"!{_CEL_CHECKPOINT_PATH}.startsWith('/dev/shm'))",
            lambda s: (
                s.checkpoint_path is None
                or s.checkpoint_claim is None
                or (
                    s.checkpoint_path.startswith("/")
                    and not s.checkpoint_path.startswith(("/etc/rlhf", "/dev/shm"))
                )
            ),
            lambda s: f"got {s.checkpoint_path!r}",
        ),
        Rule(
            "pods.volumes",
            "no volume may be mounted at trainer.checkpoint.path when checkpointClaim is",
            "!has(self.checkpointClaim) || !has(self.pods) || !has(self.pods.volumes) || "
            f"self.pods.volumes.all(v, v.mountPath != {_CEL_CHECKPOINT_PATH})",
            lambda s: (
                s.checkpoint_claim is None
                or all(v.mount_path != s.checkpoint_path for v in s.pods.volumes or [])
            ),
        ),
        Rule(
            "trainer.checkpoint.path",
            "without checkpointClaim, must lie on a persistentVolumeClaim of pods.volumes "
            "that is not read-only: every rank writes its shard there, so every pod must "
            "see the same volume (set checkpointClaim, or leave path unset: no checkpoints)",
            "has(self.checkpointClaim) || !has(self.trainer.checkpoint.path) || "
            "(has(self.pods.volumes) && self.pods.volumes.exists(v, "
            "has(v.persistentVolumeClaim) && !(has(v.readOnly) && v.readOnly) && "
            "(self.trainer.checkpoint.path == v.mountPath || "
            "self.trainer.checkpoint.path.startsWith(v.mountPath + '/'))))",
            lambda s: (
                s.checkpoint_claim is not None
                or s.trainer.checkpoint.path is None
                or any(_holds(v, s.trainer.checkpoint.path) for v in s.pods.volumes or [])
            ),
            lambda s: f"got {s.trainer.checkpoint.path!r}",
        ),
        Rule(
            "restartPolicy.maxRestarts",
            "needs checkpointClaim when above 0: a new attempt resumes from the checkpoints "
            "on that volume, and without one it would start training over",
            "!has(self.restartPolicy) || !has(self.restartPolicy.maxRestarts) || "
            "self.restartPolicy.maxRestarts == 0 || has(self.checkpointClaim)",
            lambda s: s.restart_policy.max_restarts == 0 or s.checkpoint_claim is not None,
            lambda s: f"got maxRestarts {s.restart_policy.max_restarts} and no checkpointClaim",
        ),
        Rule(
            "output.path",
            f"must lie below {OUTPUT_MOUNT} with output.claim, else below checkpointClaim's "
            "mount or the mountPath of a pods.volumes claim that is not read-only: the export "
            "is written beside its previous one and renamed in, on a volume every pod shares",
            "!has(self.output) || (has(self.output.claim) ? "
            f"self.output.path.startsWith('{OUTPUT_MOUNT}/') : "
            f"((has(self.checkpointClaim) && self.output.path.startsWith({_CEL_CHECKPOINT_PATH} "
            "+ '/')) || (has(self.pods.volumes) && self.pods.volumes.exists(v, "
            "has(v.persistentVolumeClaim) && !(has(v.readOnly) && v.readOnly) && "
            "self.output.path.startsWith(v.mountPath + '/')))))",
            lambda s: s.output is None or _output_on_a_claim(s),
            lambda s: f"got {s.output.path!r}" if s.output is not None else "",
        ),
        Rule(
            "pods.volumes",
            f"no volume may be mounted at {OUTPUT_MOUNT} when output.claim is",
            "!has(self.output) || !has(self.output.claim) || !has(self.pods.volumes) || "
            f"self.pods.volumes.all(v, v.mountPath != '{OUTPUT_MOUNT}')",
            lambda s: (
                s.output is None
                or s.output.claim is None
                or all(v.mount_path != OUTPUT_MOUNT for v in s.pods.volumes or [])
            ),
        ),
        Rule(
            "separation",
            "'gpu' lets pools share nodes, but some pools cannot share one (different "
            "gpuResource, or nodeSelectors that disagree); use separation: node",
            _SHARED_NODE_CEL,
            lambda s: (
                s.separation != Separation.GPU
                or all(_can_share_nodes(a, b) for a in s.pools for b in s.pools)
            ),
        ),
    )

    @property
    def checkpoint_path(self) -> str | None:
        """Where every rank writes its checkpoints; None: the job keeps none."""
        path = self.trainer.checkpoint.path
        return path if path is not None or not self.checkpoint_claim else CHECKPOINT_MOUNT

    def job_config(self, job_name: str | None = None) -> JobConfig:
        """The trainer-facing part, as the trainer will read it from its ConfigMap.

        `job_name`: in a cluster, the job's: the trainer reaches each environment and agent
        the operator runs at its Service. None: a local run, which serves `serve` itself.
        """
        fields = {name: getattr(self, name) for name in JobConfig.model_fields}
        # Dumping through JobConfig keeps only its fields (a Pool dumps as a PoolConfig).
        wire = JobConfig.model_construct(**fields).model_dump(by_alias=True, exclude_none=True)
        if self.checkpoint_path is not None:
            wire["trainer"]["checkpoint"]["path"] = self.checkpoint_path
        wire["environments"] = [e.for_trainer(job_name) for e in self.environments]
        wire["agents"] = [a.for_trainer(job_name) for a in self.agents]
        return JobConfig.model_validate(wire)


def _output_on_a_claim(spec: RLHFJobSpec) -> bool:
    assert spec.output is not None
    path = spec.output.path
    if spec.output.claim is not None:
        return _below(path, OUTPUT_MOUNT)
    if spec.checkpoint_claim is not None and _below(path, spec.checkpoint_path or ""):
        return True
    return any(_holds(v, path) and _below(path, v.mount_path) for v in spec.pods.volumes or [])


class ObjectMeta(SpecModel):
    """The part of metadata the API checks; the server's own fields pass through."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(
        min_length=1,
        max_length=MAX_JOB_NAME,
        pattern=JOB_NAME_PATTERN,
        description="Job name: lowercase letters, digits and '-'.",
    )
    namespace: str | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class RLHFJob(SpecModel):
    """A whole RLHFJob manifest."""

    api_version: Literal["rlhf.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["RLHFJob"]
    metadata: ObjectMeta
    spec: RLHFJobSpec
    status: RLHFJobStatus | None = None

    # At the root, the only place CEL sees metadata.name (crd.root_schema emits it).
    rules = (
        Rule(
            "",
            "metadata.name must start with a letter when the operator runs environments or "
            "agents: their Services, <job>-env-<name> and <job>-agent-<name>, are DNS-1035 "
            "labels",
            "self.metadata.name.matches('^[a-z]') || "
            "(!has(self.spec.environments) || self.spec.environments.all(e, has(e.url))) && "
            "(!has(self.spec.agents) || self.spec.agents.all(a, has(a.url)))",
            lambda j: (
                j.metadata.name[:1].isalpha()
                or all(not s.operator_run for s in [*j.spec.environments, *j.spec.agents])
            ),
            lambda j: f"got {j.metadata.name!r}",
        ),
    )
