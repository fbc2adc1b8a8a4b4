"""What a role's process imports when its worker's module loads (cluster.rank_host
imports it in the rank's process, `WorkerPath.load`): each library where it runs, and
no other. Every rank pays its own imports at the run's start, all at once on the same
cores (bench/overhead/startup.py: `python -m bench.overhead.startup imports` shows what
each process of a run imports and what it costs).

Each check imports in a fresh interpreter, since this one has imported everything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]

VLLM = ["vllm"]
# transformers' model machinery, which brings torch's compiler (~2 CPU-s a process)
MODELS = ["transformers.modeling_utils", "torch._dynamo", "torch._inductor"]
LORA = ["peft"]

# module -> what its process must not hold once it is imported
CONTRACTS = {
    # Every rank's actor class: the process's first import, before any role's.
    "rlhf_trainer.cluster.rank_host": [*VLLM, *MODELS, *LORA, "transformers"],
    # The rollout's rank: vLLM once its engine is built, after the placement's
    # environment is set (vLLM reads it as it imports).
    "rlhf_trainer.rollout.worker": [*VLLM, *MODELS, *LORA],
    # The ref's and the critic's ranks run no engine; the actor imports vLLM's
    # weight-transfer API when it opens the transfer, not with its module.
    "rlhf_trainer.roles.policy": VLLM,
    "rlhf_trainer.roles.critic": VLLM,
    # fully async's queue actor moves samples: no model, no engine
    "rlhf_trainer.cluster.queue": [*VLLM, *MODELS, *LORA, "transformers"],
}

PROBE = """
import json, sys
__import__({module!r})
print(json.dumps(sorted(m for m in {forbidden!r} if m in sys.modules)))
"""


@pytest.mark.parametrize("module", CONTRACTS)
def test_a_roles_module_imports_only_what_its_process_runs(module: str) -> None:
    code = PROBE.format(module=module, forbidden=CONTRACTS[module])
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_the_probe_sees_an_import() -> None:
    """The same probe finds what a module does import: the actor's model machinery."""
    code = PROBE.format(module="rlhf_trainer.roles.policy", forbidden=MODELS)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert json.loads(done.stdout.splitlines()[-1]) == sorted(MODELS)
