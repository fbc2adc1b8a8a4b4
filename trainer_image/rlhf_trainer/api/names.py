"""The names the operator and the trainer share: the API group, the pool label, the
pool's Ray resource and where a reward's files are mounted."""

from __future__ import annotations

# The RLHFJob API both sides speak: the operator serves it, the driver reports into it.
GROUP = "rlhf.dev"
VERSION = "v1alpha1"
PLURAL = "rlhfjobs"

# The Ray node label (and pod label) the operator puts on every node of a pool.
POOL_LABEL = "rlhf.dev/pool"


def pool_resource(pool: str) -> str:
    """The Ray logical resource a pool's nodes carry, for placing roles onto the pool."""
    return f"rlhf-pool-{pool}"


# Where the operator mounts models.reward.configMap in the Ray pods: the directory a
# `file:NAME.py:FUNCTION` reward is read from (RLHF_REWARD_FILES overrides it). Beside the
# spec's ConfigMap mount (/etc/rlhf), not in it: a mount point inside a read-only
# ConfigMap volume cannot be made.
REWARD_FILES_MOUNT = "/etc/rlhf-reward"
REWARD_FILES_ENV = "RLHF_REWARD_FILES"
