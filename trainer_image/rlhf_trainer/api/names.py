"""The names the operator and the trainer share: the API group, the pool label and
the pool's Ray resource."""

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
