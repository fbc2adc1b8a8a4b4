"""What every Ray pod of a job shares, rendered: the restricted security context,
resources, the operator's own mounts and variables, and the job's pod settings
(`spec.pods`: volumes, env, pull secrets, priority, labels and annotations).

Pure, like children.py. Secrets appear only as references (secretKeyRef, secretRef, a
secret volume): the operator never reads one, and nothing here copies a value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_operator.api.job import OUTPUT_MOUNT, RLHFJobSpec
from rlhf_operator.api.podspec import (
    CHAT_TEMPLATE_VOLUME,
    REWARD_FILES_VOLUME,
    PodResources,
    Quantity,
    Toleration,
)
from rlhf_trainer.api.agentic import CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_MOUNT, ConfigMapKeyRef
from rlhf_trainer.api.names import REWARD_FILES_MOUNT

Obj = dict[str, Any]

SPEC_MOUNT = "/etc/rlhf"
RUN_AS_USER = 1000  # the trainer image's non-root user
READ_ONLY_FILES = 0o444  # a reward's file: read by the driver, written by no one


def pod_metadata(spec: RLHFJobSpec, labels: Obj, annotations: Obj | None = None) -> Obj:
    """The job's extra labels and annotations, under the operator's own (which win)."""
    meta: Obj = {"labels": {**(spec.pods.labels or {}), **labels}}
    merged = {**(spec.pods.annotations or {}), **(annotations or {})}
    if merged:
        meta["annotations"] = merged
    return meta


def pod_settings(spec: RLHFJobSpec) -> Obj:
    """Pull secrets and priority: every pod of the job, the submitter's too."""
    out: Obj = {}
    if spec.pods.image_pull_secrets:
        out["imagePullSecrets"] = [s.to_dict() for s in spec.pods.image_pull_secrets]
    if spec.pods.priority_class_name:
        out["priorityClassName"] = spec.pods.priority_class_name
    return out


def ray_environment(job_name: str, spec: RLHFJobSpec) -> Obj:
    """env and envFrom of a Ray container (head and workers)."""
    env: list[Obj] = [
        # The driver reports progress to its RLHFJob; the namespace comes from the pod.
        {"name": "RLHF_JOB_NAME", "value": job_name},
        {
            "name": "RLHF_JOB_NAMESPACE",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        },
        *(e.to_dict() for e in spec.pods.env or []),
    ]
    out: Obj = {"env": env}
    if spec.pods.env_from:
        out["envFrom"] = [e.to_dict() for e in spec.pods.env_from]
    return out


def container_resources(
    resources: PodResources, extra: Mapping[str, Quantity] | None = None
) -> Obj:
    """Requests equal limits: GPU pods should be Guaranteed QoS."""
    amounts = {
        k: str(v)
        for k, v in (("cpu", resources.cpu), ("memory", resources.memory), *(extra or {}).items())
        if v is not None
    }
    return {"requests": dict(amounts), "limits": dict(amounts)}


def pod_security() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def placement(
    node_selector: dict[str, str] | None, tolerations: list[Toleration] | None, affinity: Obj | None
) -> Obj:
    out: Obj = {}
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = [t.to_dict() for t in tolerations]
    if affinity:
        out["affinity"] = affinity
    return out


def mounts(spec: RLHFJobSpec) -> list[Obj]:
    found: list[Obj] = [
        {"name": "spec", "mountPath": SPEC_MOUNT, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.checkpoint_claim:
        found.append({"name": "checkpoints", "mountPath": spec.checkpoint_path})
    if spec.output is not None and spec.output.claim:
        found.append({"name": "output", "mountPath": OUTPUT_MOUNT})
    if spec.models.reward.config_map is not None:
        found.append(
            {"name": REWARD_FILES_VOLUME, "mountPath": REWARD_FILES_MOUNT, "readOnly": True}
        )
    if _chat_template(spec) is not None:
        found.append(
            {"name": CHAT_TEMPLATE_VOLUME, "mountPath": CHAT_TEMPLATE_MOUNT, "readOnly": True}
        )
    for volume in spec.pods.volumes or []:
        mount = {"name": volume.name, "mountPath": volume.mount_path}
        found.append(mount | ({"readOnly": True} if volume.read_only else {}))
    return found


def volumes(spec_configmap: str, spec: RLHFJobSpec, shm_size: Quantity | None) -> list[Obj]:
    # NCCL and Ray's object store need a large /dev/shm (the default is 64 MiB).
    # Memory-backed, it counts against the pod's memory limit, which bounds it.
    shm: Obj = {"medium": "Memory"} | ({"sizeLimit": str(shm_size)} if shm_size else {})
    found: list[Obj] = [
        {"name": "spec", "configMap": {"name": spec_configmap}},
        {"name": "dshm", "emptyDir": shm},
    ]
    if spec.checkpoint_claim:
        # Shared by every pod: each rank writes its shard, the driver commits.
        claim = {"claimName": spec.checkpoint_claim}
        found.append({"name": "checkpoints", "persistentVolumeClaim": claim})
    if spec.output is not None and spec.output.claim:
        # The actor's rank 0 writes the export; every pod mounts it, as the checkpoints.
        found.append({"name": "output", "persistentVolumeClaim": {"claimName": spec.output.claim}})
    if spec.models.reward.config_map is not None:
        # The file of a `file:` reward: the driver (on the head) imports it; the workers
        # mount it too, so every Ray pod of the job sees the same files.
        files = {"name": spec.models.reward.config_map, "defaultMode": READ_ONLY_FILES}
        found.append({"name": REWARD_FILES_VOLUME, "configMap": files})
    if (template := _chat_template(spec)) is not None:
        # multiTurn.chatTemplateFrom: every rollout rank renders with it, the driver
        # checks it; one file of a fixed name, whatever the key.
        item = {"key": template.key, "path": CHAT_TEMPLATE_FILE}
        source = {"name": template.name, "items": [item], "defaultMode": READ_ONLY_FILES}
        found.append({"name": CHAT_TEMPLATE_VOLUME, "configMap": source})
    for volume in spec.pods.volumes or []:  # the name and its source, not where it mounts
        wire = volume.to_dict()
        found.append({k: v for k, v in wire.items() if k not in ("mountPath", "readOnly")})
    return found


def _chat_template(spec: RLHFJobSpec) -> ConfigMapKeyRef | None:
    """The ConfigMap key of multiTurn.chatTemplateFrom, if the job has one."""
    multi_turn = spec.multi_turn
    if multi_turn is None or multi_turn.chat_template_from is None:
        return None
    return multi_turn.chat_template_from.config_map_key_ref
