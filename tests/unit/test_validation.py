"""Every mistake a user can make is rejected with an error naming the field at fault.

Each case breaks the small local example in one place. Where the rule is a cross-field
rule, the same manifest must also fail the CRD's CEL rule at the same path (what the API
server will say at admission).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rlhf_operator.api.validation import InvalidJob, parse_job, parse_spec
from tests.unit.celcheck import assert_refused, cel_errors

Job = dict[str, Any]


def _multi_turn(job: Job) -> None:
    """Make `job` a valid multi-turn job, for the cases that then break one of its rules."""
    job["spec"]["environments"] = [{"name": "tools", "url": "http://tools.team.svc:8000"}]
    job["spec"].setdefault("generation", {})["multiTurn"] = {"environment": "tools", "maxTurns": 4}
    job["spec"]["models"]["reward"] = {"environment": True}


def _agent(job: Job) -> None:
    """Make `job` a valid job of agent episodes, for the cases that then break one of its rules."""
    job["spec"]["agents"] = [{"name": "coder", "url": "http://coder.team.svc:8000"}]
    job["spec"].setdefault("generation", {})["agent"] = {"agent": "coder"}


def _set(path: str, value: Any) -> Callable[[Job], None]:
    """A mutation that sets a dotted path ("spec.pools.0.gpusPerNode") in a manifest."""

    def apply(job: Job) -> None:
        *parents, last = path.split(".")
        node: Any = job
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[last]
        else:
            node[int(last) if last.isdigit() else last] = value

    return apply


_DELETE = object()

# (case id, mutation, field path the error must name, words the message must contain,
#  whether the CRD's CEL rules must reject it at the same path too)
CASES: list[tuple[str, Callable[[Job], None], str, str, bool]] = [
    ("role-undeclared-pool", _set("spec.roles.critic", "gpus"), "spec.roles.critic",
     "must name a pool declared in spec.pools (got 'gpus'; declared: policy, value)", True),
    ("duplicate-pool-names", _set("spec.pools.1.name", "policy"), "spec.pools",
     "pool names must be unique", True),
    ("zero-gpus", _set("spec.pools.0.gpusPerNode", 0), "spec.pools[0].gpusPerNode",
     "greater than or equal to 1", False),
    ("negative-gpus", _set("spec.pools.1.gpusPerNode", -2), "spec.pools[1].gpusPerNode",
     "greater than or equal to 1", False),
    ("zero-replicas", _set("spec.pools.0.replicas", 0), "spec.pools[0].replicas",
     "greater than or equal to 1", False),
    ("no-pools", _set("spec.pools", []), "spec.pools", "at least 1 item", False),
    ("missing-actor-role", _set("spec.roles.actor", _DELETE), "spec.roles.actor",
     "required field is missing", False),
    ("missing-critic-role", _set("spec.roles.critic", _DELETE), "spec.roles.critic",
     "is required when algorithm.advantageEstimator is gae", True),
    ("unknown-estimator", _set("spec.algorithm.advantageEstimator", "ppo2"),
     "spec.algorithm.advantageEstimator", "'gae', 'grpo', 'rloo', 'reinforce++' or", False),
    ("grpo-one-sample", _set("spec.algorithm.advantageEstimator", "grpo"),
     "spec.generation.samplesPerPrompt", "must be at least 2 for the estimators", True),
    ("rloo-one-sample", _set("spec.algorithm.advantageEstimator", "rloo"),
     "spec.generation.samplesPerPrompt", "must be at least 2 for the estimators", True),
    ("critic-mapped-in-grpo",
     lambda j: (_set("spec.algorithm.advantageEstimator", "grpo")(j),
                _set("spec.generation.samplesPerPrompt", 4)(j)),
     "spec.roles.critic", "must be unset otherwise (the critic-free estimators", True),
    ("critic-model-in-grpo",
     lambda j: (_set("spec.algorithm.advantageEstimator", "grpo")(j),
                _set("spec.generation.samplesPerPrompt", 4)(j),
                _set("spec.models.critic", {"path": "/models/critic"})(j)),
     "spec.models.critic", "must be unset unless algorithm.advantageEstimator is gae", True),
    ("clip-high-below-low",
     lambda j: (_set("spec.algorithm.clipRatioLow", 0.3)(j),
                _set("spec.algorithm.clipRatioHigh", 0.2)(j)),
     "spec.algorithm.clipRatioHigh", "must be at least clipRatioLow (each defaults to clipRatio) "
     "(low 0.3, high 0.2)", True),
    ("clip-high-below-shorthand", _set("spec.algorithm.clipRatioHigh", 0.1),
     "spec.algorithm.clipRatioHigh", "must be at least clipRatioLow", True),
    ("dynamic-sampling-one-sample", _set("spec.algorithm.dynamicSampling", {}),
     "spec.algorithm.dynamicSampling", "needs generation.samplesPerPrompt >= 2", True),
    ("zero-samples-per-prompt", _set("spec.generation.samplesPerPrompt", 0),
     "spec.generation.samplesPerPrompt", "greater than or equal to 1", False),
    ("ref-needed-for-kl", _set("spec.roles.ref", _DELETE), "spec.roles.ref",
     "required when algorithm.klCoef > 0", True),
    ("reward-model-needs-pool", _set("spec.models.reward", {"path": "/models/rm"}),
     "spec.roles.reward", "required when models.reward is a model path", True),
    ("unused-pool", _set("spec.roles.critic", "policy"), "spec.pools",
     "every pool must host at least one role (an unused pool wastes its GPUs) (unused: value)",
     True),
    ("async-rollout-on-actor-pool", _set("spec.async", {"stalenessThreshold": 0.5}),
     "spec.roles.rollout", "fully async needs the rollout on a pool of its own", True),
    ("minibatch-not-dividing-batch", _set("spec.trainer.miniBatchSize", 12),
     "spec.trainer.miniBatchSize", "must divide trainer.batchSize", True),
    ("minibatch-not-multiple-of-dp", _set("spec.pools.0.gpusPerNode", 3),
     "spec.trainer.miniBatchSize", "multiple of the actor pool's GPUs", True),
    ("microbatch-not-dividing", _set("spec.trainer.microBatchSize", 5),
     "spec.trainer.miniBatchSize", "a multiple of microBatchSize", True),
    ("tp-not-dividing-gpus", _set("spec.generation.tensorParallelSize", 2),
     "spec.generation.tensorParallelSize", "must divide the rollout pool's gpusPerNode", True),
    ("negative-staleness", _set("spec.async", {"stalenessThreshold": -0.5}),
     "spec.async.stalenessThreshold", "greater than or equal to 0", False),
    ("zero-sync-step", _set("spec.async", {"triggerParameterSyncStep": 0}),
     "spec.async.triggerParameterSyncStep", "greater than or equal to 1", False),
    ("unknown-field-typo", _set("spec.pools.0.gpus", 4), "spec.pools[0].gpus",
     "unknown field", False),
    ("unknown-top-field", _set("spec.learningRate", 1), "spec.learningRate", "unknown field",
     False),
    ("wrong-type-int", _set("spec.pools.0.gpusPerNode", "four"), "spec.pools[0].gpusPerNode",
     "valid integer", False),
    ("wrong-type-list", _set("spec.pools", {"name": "a"}), "spec.pools", "valid", False),
    ("wrong-type-bool", _set("spec.suspend", "maybe"), "spec.suspend", "valid boolean", False),
    ("bad-enum", _set("spec.separation", "rack"), "spec.separation", "'node' or 'gpu'", False),
    ("bad-kl-mode", _set("spec.algorithm.klMode", "both"), "spec.algorithm.klMode",
     "'reward' or 'loss'", False),
    ("adaptive-kl-without-target", _set("spec.algorithm.klController", {"type": "adaptive"}),
     "spec.algorithm.klController.targetKL", "is required when type is adaptive", True),
    ("adaptive-kl-in-the-loss",
     lambda j: (_set("spec.algorithm.klController", {"type": "adaptive", "targetKL": 1})(j),
                _set("spec.algorithm.klMode", "loss")(j)),
     "spec.algorithm.klController.type", "(klMode loss, klCoef 0.01)", True),
    ("adaptive-kl-from-zero",
     lambda j: (_set("spec.algorithm.klController", {"type": "adaptive", "targetKL": 1})(j),
                _set("spec.algorithm.klCoef", 0)(j), _set("spec.roles.ref", _DELETE)(j)),
     "spec.algorithm.klController.type", "adaptive needs klMode: reward and klCoef > 0", True),
    ("eval-every-without-eval-data", _set("spec.data.eval", _DELETE),
     "spec.trainer.evalEverySteps", "needs data.eval (the held-out prompts it scores)", True),
    ("eval-every-zero",
     lambda j: (_set("spec.trainer.evalEverySteps", 0)(j), _set("spec.data.eval", "e.jsonl")(j)),
     "spec.trainer.evalEverySteps", "greater than or equal to 1", False),
    ("empty-eval-source", _set("spec.data.eval", ""), "spec.data.eval", "at least 1 character",
     False),
    ("greedy-pass-at-k", _set("spec.generation.eval", {"samplesPerPrompt": 4}),
     "spec.generation.eval.samplesPerPrompt", "above 1 needs temperature > 0", True),
    ("negative-eval-temperature", _set("spec.generation.eval", {"temperature": -1}),
     "spec.generation.eval.temperature", "greater than or equal to 0", False),
    ("bad-pool-name", _set("spec.pools.0.name", "Policy_A"), "spec.pools[0].name",
     "should match pattern", False),
    ("tiny-head-dim-too-small", _set("spec.models.actor.tiny.numHeads", 8),
     "spec.models.actor.tiny.hiddenSize", "head dim", True),
    ("model-path-and-tiny", _set("spec.models.actor.path", "org/model"), "spec.models.actor",
     "set exactly one of path or tiny", True),
    ("reward-neither", _set("spec.models.reward", {}), "spec.models.reward",
     "set exactly one of path, function, environment or url", True),
    ("multi-turn-zero-turns", _set("spec.generation.multiTurn", {"environment": "t", "maxTurns": 0}),
     "spec.generation.multiTurn.maxTurns", "greater than or equal to 1", False),
    ("multi-turn-budget-below-prompt",
     lambda j: (_multi_turn(j), _set("spec.generation.multiTurn.maxTokens", 16)(j),
                _set("spec.data.maxPromptLength", 16)(j)),
     "spec.generation.multiTurn.maxTokens", "must exceed data.maxPromptLength", True),
    ("multi-turn-undeclared-environment",
     lambda j: (_multi_turn(j), _set("spec.generation.multiTurn.environment", "calc")(j)),
     "spec.generation.multiTurn.environment", "must name one of environments", True),
    ("environment-url-without-scheme",
     lambda j: (_multi_turn(j), _set("spec.environments.0.url", "tools.team.svc:8000")(j)),
     "spec.environments[0].url", "should match pattern", False),
    ("environment-url-and-serve",
     lambda j: (_multi_turn(j), _set("spec.environments.0.serve", "rlhf_env.toys:Lookup")(j)),
     "spec.environments[0]", "set exactly one of url (an environment that runs already) or serve or command", True),
    ("environment-url-and-command",
     lambda j: (_multi_turn(j), _set("spec.environments.0.command", ["serve-it"])(j)),
     "spec.environments[0]", "set exactly one of url", True),
    ("environment-neither-url-nor-serve-nor-command",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools"})(j)),
     "spec.environments[0]", "set exactly one of url", True),
    ("environment-url-with-image",
     lambda j: (_multi_turn(j), _set("spec.environments.0.image", "envs:1")(j)),
     "spec.environments[0].url", "with url, leave image, port, replicas, resources, env, egress, egressTo, "
     "runtimeClassName, nodeSelector, tolerations, maxSessions, "
     "callTimeoutSeconds, sessionIdleSeconds unset: they are for an environment the operator runs (got image)", True),
    ("environment-url-with-a-session-limit",
     lambda j: (_multi_turn(j), _set("spec.environments.0.maxSessions", 8)(j)),
     "spec.environments[0].url", "(got maxSessions)", True),
    ("environment-command-with-server-settings",
     lambda j: (_multi_turn(j),
                _set("spec.environments.0", {"name": "tools", "command": ["serve"], "sessionIdleSeconds": 60})(j)),
     "spec.environments[0].command", "with command, leave maxSessions, callTimeoutSeconds, sessionIdleSeconds "
     "unset: they are settings of python -m rlhf_env serve, for the command to pass itself", True),
    ("environment-url-with-egress-and-replicas",
     lambda j: (_multi_turn(j), _set("spec.environments.0.egress", False)(j),
                _set("spec.environments.0.replicas", 2)(j)),
     "spec.environments[0].url", "(got replicas, egress)", True),
    ("environment-name-too-long-for-its-service",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "a-long-tool-server1", "serve": "a:B"})(j),
                _set("spec.generation.multiTurn.environment", "a-long-tool-server1")(j)),
     "spec.environments[0].name", "must be at most 18 characters when the operator runs the environment: "
     "its Service, <job>-env-<name>, must fit in 63 with a job name of up to 40 (got 19)", True),
    ("environment-zero-replicas",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools", "serve": "a:B", "replicas": 0})(j)),
     "spec.environments[0].replicas", "greater than or equal to 1", False),
    ("environment-too-many-replicas",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools", "serve": "a:B", "replicas": 65})(j)),
     "spec.environments[0].replicas", "less than or equal to 64", False),
    ("environment-bad-port",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools", "serve": "a:B", "port": 0})(j)),
     "spec.environments[0].port", "greater than or equal to 1", False),
    ("environment-empty-command",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools", "command": []})(j)),
     "spec.environments[0].command", "at least 1 item", False),
    ("environment-env-twice",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools", "serve": "a:B", "env": [
         {"name": "A", "value": "1"}, {"name": "A", "value": "2"}]})(j)),
     "spec.environments[0].env", "env names must be unique", True),
    ("environment-bad-memory",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools", "serve": "a:B",
                                                             "resources": {"memory": "lots"}})(j)),
     "spec.environments[0].resources.memory", "must be a quantity", False),
    ("environment-job-name-starts-with-a-digit",
     lambda j: (_multi_turn(j), _set("spec.environments.0", {"name": "tools", "serve": "a:B"})(j),
                _set("metadata.name", "1st-job")(j)),
     "", "metadata.name must start with a letter when the operator runs environments or agents: "
     "their Services, <job>-env-<name> and <job>-agent-<name>, are DNS-1035 labels (got '1st-job')", True),
    ("agent-job-name-starts-with-a-digit",
     lambda j: (_agent(j), _set("spec.agents.0", {"name": "coder", "serve": "a:run"})(j),
                _set("metadata.name", "1st-job")(j)),
     "", "metadata.name must start with a letter when the operator runs environments or agents", True),
    ("agent-neither-url-nor-serve-nor-command",
     lambda j: (_agent(j), _set("spec.agents.0", {"name": "coder"})(j)),
     "spec.agents[0]", "set exactly one of url (an agent that runs already) or serve or command (one "
     "the operator runs)", True),
    ("agent-url-and-command",
     lambda j: (_agent(j), _set("spec.agents.0.command", ["run-agent"])(j)),
     "spec.agents[0]", "set exactly one of url", True),
    ("agent-url-with-replicas-and-egress",
     lambda j: (_agent(j), _set("spec.agents.0.replicas", 2)(j), _set("spec.agents.0.egress", True)(j)),
     "spec.agents[0].url", "with url, leave image, port, replicas, resources, env, egress, egressTo, "
     "runtimeClassName, nodeSelector, tolerations unset: they are for an agent the operator runs "
     "(got replicas, egress)", True),
    ("agent-name-too-long-for-its-service",
     lambda j: (_agent(j), _set("spec.agents.0", {"name": "a-long-coder-bot1", "serve": "a:run"})(j),
                _set("spec.generation.agent.agent", "a-long-coder-bot1")(j)),
     "spec.agents[0].name", "must be at most 16 characters when the operator runs the agent: its Service, "
     "<job>-agent-<name>, must fit in 63 with a job name of up to 40 (got 17)", True),
    ("agent-env-twice",
     lambda j: (_agent(j), _set("spec.agents.0", {"name": "coder", "serve": "a:run", "env": [
         {"name": "A", "value": "1"}, {"name": "A", "value": "2"}]})(j)),
     "spec.agents[0].env", "env names must be unique", True),
    ("agent-serve-not-a-function",
     lambda j: (_agent(j), _set("spec.agents.0", {"name": "coder", "serve": "agents.py"})(j)),
     "spec.agents[0].serve", "should match pattern", False),
    ("agent-zero-replicas",
     lambda j: (_agent(j), _set("spec.agents.0", {"name": "coder", "serve": "a:run", "replicas": 0})(j)),
     "spec.agents[0].replicas", "greater than or equal to 1", False),
    ("agent-names-twice",
     lambda j: (_agent(j), _set("spec.agents", [{"name": "coder", "serve": "a:run"},
                                                {"name": "coder", "url": "http://c.team.svc:8000"}])(j)),
     "spec.agents", "agent names must be unique", True),
    ("agent-undeclared",
     lambda j: (_agent(j), _set("spec.generation.agent.agent", "writer")(j)),
     "spec.generation.agent.agent", "must name one of agents (got 'writer'; declared: coder)", True),
    ("agent-and-multi-turn",
     lambda j: (_agent(j), _set("spec.environments", [{"name": "tools", "url": "http://t.team.svc:8000"}])(j),
                _set("spec.generation.multiTurn", {"environment": "tools"})(j)),
     "spec.generation.agent", "and generation.multiTurn are two ways to run episodes: set one", True),
    ("multi-turn-reward-function",
     lambda j: (_multi_turn(j), _set("spec.models.reward", {"function": "toy_copy"})(j)),
     "spec.models.reward.environment", "is required with generation.multiTurn", True),
    ("environment-reward-single-turn", _set("spec.models.reward", {"environment": True}),
     "spec.models.reward.environment", "is required with generation.multiTurn", True),
    ("reward-function-bad-name", _set("spec.models.reward.function", "rm --all"),
     "spec.models.reward.function", "should match pattern", False),
    ("reward-file-without-its-configmap", _set("spec.models.reward", {"function": "file:score.py:score"}),
     "spec.models.reward.configMap", "a file: reward needs the ConfigMap that holds the file", True),
    ("reward-configmap-without-a-file", _set("spec.models.reward", {"function": "toy_copy", "configMap": "rw"}),
     "spec.models.reward.configMap", "only with a file: function", True),
    ("reward-file-not-python", _set("spec.models.reward", {"function": "file:score.txt:score", "configMap": "rw"}),
     "spec.models.reward.function", "NAME.py a ConfigMap key (letters, digits, '-', '_' and '.') and "
     "FUNCTION a Python identifier (got 'file:score.txt:score')", True),
    ("reward-file-not-a-configmap-key", _set("spec.models.reward", {"function": "file:my score.py:f", "configMap": "rw"}),
     "spec.models.reward.function", "NAME.py a ConfigMap key", True),
    ("reward-file-function-not-an-identifier", _set("spec.models.reward", {"function": "file:s.py:2x", "configMap": "rw"}),
     "spec.models.reward.function", "FUNCTION a Python identifier", True),
    ("reward-file-without-a-function", _set("spec.models.reward", {"function": "file:score.py", "configMap": "rw"}),
     "spec.models.reward.function", "a file: reward is 'file:NAME.py:FUNCTION'", True),
    ("reward-configmap-bad-name", _set("spec.models.reward", {"function": "file:s.py:f", "configMap": "My_Reward"}),
     "spec.models.reward.configMap", "should match pattern", False),
    ("gpu-separation-disjoint-nodes",
     lambda j: (_set("spec.separation", "gpu")(j), _set("spec.pools.0.nodeSelector", {"pool": "a"})(j),
                _set("spec.pools.1.nodeSelector", {"pool": "b"})(j)),
     "spec.separation", "some pools cannot share one", True),
    ("checkpoint-claim-over-the-spec",
     lambda j: (_set("spec.checkpointClaim", "ckpt")(j), _set("spec.trainer.checkpoint.path", "/etc/rlhf/c")(j)),
     "spec.trainer.checkpoint.path", "outside /etc/rlhf and /dev/shm when checkpointClaim", True),
    ("checkpoint-default-over-a-volume",
     lambda j: (_set("spec.checkpointClaim", "ckpt")(j),
                _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "/checkpoints", "emptyDir": {}}]})(j)),
     "spec.pods.volumes", "no volume may be mounted at trainer.checkpoint.path", True),
    ("checkpoint-path-on-no-volume", _set("spec.trainer.checkpoint.path", "/checkpoints"),
     "spec.trainer.checkpoint.path", "without checkpointClaim, must lie on a persistentVolumeClaim", True),
    ("checkpoint-path-on-a-pod-scratch",
     lambda j: (_set("spec.trainer.checkpoint.path", "/cache/ckpt")(j),
                _set("spec.pods", {"volumes": [{"name": "c", "mountPath": "/cache", "emptyDir": {}}]})(j)),
     "spec.trainer.checkpoint.path", "every pod must see the same volume", True),
    ("checkpoint-path-on-a-read-only-claim",
     lambda j: (_set("spec.trainer.checkpoint.path", "/shared/ckpt")(j),
                _set("spec.pods", {"volumes": [{"name": "s", "mountPath": "/shared", "readOnly": True,
                                                "persistentVolumeClaim": {"claimName": "s"}}]})(j)),
     "spec.trainer.checkpoint.path", "that is not read-only", True),
    ("output-on-no-volume", _set("spec.output", {"path": "/model"}),
     "spec.output.path", "must lie below /output with output.claim, else below checkpointClaim", True),
    ("output-beside-its-claim", _set("spec.output", {"path": "/models/policy", "claim": "models"}),
     "spec.output.path", "must lie below /output with output.claim", True),
    ("output-is-the-checkpoint-mount",
     lambda j: (_set("spec.checkpointClaim", "ckpt")(j), _set("spec.output", {"path": "/checkpoints"})(j)),
     "spec.output.path", "is written beside its previous one", True),
    ("output-on-a-read-only-claim",
     lambda j: (_set("spec.output", {"path": "/shared/policy"})(j),
                _set("spec.pods", {"volumes": [{"name": "s", "mountPath": "/shared", "readOnly": True,
                                                "persistentVolumeClaim": {"claimName": "s"}}]})(j)),
     "spec.output.path", "that is not read-only", True),
    ("output-relative", _set("spec.output", {"path": "model"}), "spec.output.path",
     "should match pattern", False),
    ("output-dtype", _set("spec.output", {"path": "/output/m", "claim": "m", "dtype": "int8"}),
     "spec.output.dtype", "'bf16' or 'fp32'", False),
    ("output-claim-over-a-volume",
     lambda j: (_set("spec.output", {"path": "/output/m", "claim": "m"})(j),
                _set("spec.pods", {"volumes": [{"name": "o", "mountPath": "/output", "emptyDir": {}}]})(j)),
     "spec.pods.volumes", "no volume may be mounted at /output when output.claim is", True),
    ("export-every-without-output", _set("spec.trainer.export", {"everySteps": 10}),
     "spec.trainer.export.everySteps", "needs output", True),
    ("checkpoint-claim-bad-name", _set("spec.checkpointClaim", "My_Claim"), "spec.checkpointClaim",
     "should match pattern", False),
    ("restarts-without-checkpoints", _set("spec.restartPolicy", {"maxRestarts": 2}),
     "spec.restartPolicy.maxRestarts", "needs checkpointClaim when above 0", True),
    ("restarts-too-many", _set("spec.restartPolicy", {"maxRestarts": 1000}),
     "spec.restartPolicy.maxRestarts", "less than or equal to 100", False),
    ("bad-toleration", _set("spec.pools.0.tolerations", [{"key": "gpu", "operator": "Maybe"}]),
     "spec.pools[0].tolerations[0].operator", "'Exists' or 'Equal'", False),
    ("bad-quantity", _set("spec.pools.0.resources", {"memory": "64 gigs"}),
     "spec.pools[0].resources.memory", "must be a quantity such as 8, '500m' or '64Gi' (got '64 gigs')", False),
    ("bad-node-selector-key", _set("spec.pools.0.nodeSelector", {"bad key!": "x"}),
     "spec.pools[0].nodeSelector.bad key!", "should match pattern", False),
    ("bad-affinity",
     _set("spec.pools.0.affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}),
     "spec.pools[0].affinity", "requiredDuringSchedulingIgnoredDuringExecution", False),
    # spec.pods and the per-pool pod settings
    ("volume-two-sources", _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "/models", "emptyDir": {}, "secret": {"secretName": "s"}}]}),
     "spec.pods.volumes[0]", "a volume needs exactly one source", True),
    ("volume-no-source", _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "/models"}]}),
     "spec.pods.volumes[0]", "a volume needs exactly one source", True),
    ("volume-reserved-name", _set("spec.pods", {"volumes": [{"name": "dshm", "mountPath": "/x", "emptyDir": {}}]}),
     "spec.pods.volumes[0].name", "the operator's own (got 'dshm')", True),
    ("volume-named-as-the-reward-files", _set("spec.pods", {"volumes": [{"name": "reward-files", "mountPath": "/x", "emptyDir": {}}]}),
     "spec.pods.volumes[0].name", "the operator's own (got 'reward-files')", True),
    ("volume-over-the-reward-files", _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "/etc/rlhf-reward", "emptyDir": {}}]}),
     "spec.pods.volumes[0].mountPath", "must be outside /etc/rlhf, /etc/rlhf-reward, /dev/shm", True),
    ("volume-over-the-spec", _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "/etc/rlhf/m", "emptyDir": {}}]}),
     "spec.pods.volumes[0].mountPath", "must be outside /etc/rlhf, /etc/rlhf-reward, /dev/shm", True),
    ("volume-relative-path", _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "models", "emptyDir": {}}]}),
     "spec.pods.volumes[0].mountPath", "should match pattern", False),
    ("volumes-same-path", _set("spec.pods", {"volumes": [{"name": "a", "mountPath": "/m", "emptyDir": {}}, {"name": "b", "mountPath": "/m", "emptyDir": {}}]}),
     "spec.pods.volumes", "volume mountPaths must be unique", True),
    ("volumes-same-name", _set("spec.pods", {"volumes": [{"name": "a", "mountPath": "/m", "emptyDir": {}}, {"name": "a", "mountPath": "/n", "emptyDir": {}}]}),
     "spec.pods.volumes", "volume names must be unique", True),
    ("env-twice", _set("spec.pods", {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
     "spec.pods.env", "env names must be unique", True),
    ("volume-bad-claim", _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "/m", "persistentVolumeClaim": {"claimName": "My_Claim"}}]}),
     "spec.pods.volumes[0].persistentVolumeClaim.claimName", "should match pattern", False),
    ("volume-at-checkpoints",
     lambda j: (_set("spec.checkpointClaim", "ckpt")(j), _set("spec.trainer.checkpoint.path", "/ckpt")(j),
                _set("spec.pods", {"volumes": [{"name": "m", "mountPath": "/ckpt", "emptyDir": {}}]})(j)),
     "spec.pods.volumes", "no volume may be mounted at trainer.checkpoint.path", True),
    ("env-value-and-secret", _set("spec.pods", {"env": [{"name": "HF_TOKEN", "value": "x", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]}),
     "spec.pods.env[0]", "exactly one of value, valueFrom", True),
    ("env-from-nothing", _set("spec.pods", {"env": [{"name": "HF_TOKEN", "valueFrom": {}}]}),
     "spec.pods.env[0].valueFrom", "exactly one of secretKeyRef, configMapKeyRef", True),
    ("env-reserved", _set("spec.pods", {"env": [{"name": "RLHF_JOB_NAME", "value": "x"}]}),
     "spec.pods.env[0].name", "set by the operator (got 'RLHF_JOB_NAME')", True),
    ("env-bad-name", _set("spec.pods", {"env": [{"name": "1TOKEN", "value": "x"}]}),
     "spec.pods.env[0].name", "should match pattern", False),
    ("env-from-two", _set("spec.pods", {"envFrom": [{"secretRef": {"name": "s3"}, "configMapRef": {"name": "c"}}]}),
     "spec.pods.envFrom[0]", "exactly one of secretRef, configMapRef", True),
    ("label-reserved", _set("spec.pods", {"labels": {"rlhf.dev/pool": "x"}}),
     "spec.pods.labels", "are the operator's (got ['rlhf.dev/pool'])", True),
    ("pull-secret-bad-name", _set("spec.pods", {"imagePullSecrets": [{"name": "Registry Key"}]}),
     "spec.pods.imagePullSecrets[0].name", "should match pattern", False),
    ("extra-resource-cpu", _set("spec.pools.0.extraResources", {"cpu": 4}),
     "spec.pools[0].extraResources", "set elsewhere (resources, gpusPerNode) (got ['cpu'])", True),
    ("extra-resource-bad-amount", _set("spec.pools.0.extraResources", {"rdma/hca": "lots"}),
     "spec.pools[0].extraResources.rdma/hca", "must be a quantity", False),
    ("shm-bad-size", _set("spec.pools.0.shmSize", "big"),
     "spec.pools[0].shmSize", "must be a quantity", False),
    ("job-name-too-long", _set("metadata.name", "a" * 41), "metadata.name", "at most 40", False),
    ("job-name-bad-chars", _set("metadata.name", "My.Job"), "metadata.name",
     "should match pattern", False),
    ("wrong-api-version", _set("apiVersion", "rlhf.dev/v1"), "apiVersion", "rlhf.dev/v1alpha1",
     False),
    ("unknown-scheduler", _set("spec.schedulerName", "kube-batch"), "spec.schedulerName",
     "'volcano', 'yunikorn' or 'scheduler-plugins'", False),
    ("queue-name-not-a-label-value", _set("spec.queueName", "team queue"), "spec.queueName",
     "should match pattern", False),
    ("queue-name-too-long", _set("spec.queueName", "q" * 64), "spec.queueName", "at most 63", False),
    ("weight-sync-timeout-too-short", _set("spec.trainer.weightSyncTimeoutSeconds", 1),
     "spec.trainer.weightSyncTimeoutSeconds", "greater than or equal to 10", False),
    ("wrong-kind", _set("kind", "RayJob"), "kind", "'RLHFJob'", False),
    ("missing-spec", _set("spec", _DELETE), "spec", "required field is missing", False),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "path", "words", "cel_too"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_input_is_rejected_naming_the_field(
    local_job: Job, mutate: Callable[[Job], None], path: str, words: str, cel_too: bool
) -> None:
    parse_job(local_job)  # the starting point is valid
    mutate(local_job)
    assert_refused(local_job, path, words, cel_too)


def test_the_starting_point_passes_cel(local_job: Job) -> None:
    assert cel_errors(local_job) == []


def test_every_error_is_reported_not_just_the_first(local_job: Job) -> None:
    local_job["spec"]["roles"]["critic"] = "nope"
    local_job["spec"]["trainer"]["miniBatchSize"] = 12
    with pytest.raises(InvalidJob) as caught:
        parse_job(local_job)
    paths = {e.path for e in caught.value.errors}
    assert {"spec.roles.critic", "spec.trainer.miniBatchSize"} <= paths


def test_parse_spec_prefixes_paths_with_spec(local_job: Job) -> None:
    local_job["spec"]["pools"][0]["gpusPerNode"] = 0
    with pytest.raises(InvalidJob) as caught:
        parse_spec(local_job["spec"])
    assert [e.path for e in caught.value.errors] == ["spec.pools[0].gpusPerNode"]


@pytest.mark.parametrize("manifest", [None, [], "RLHFJob", 3])
def test_a_non_mapping_is_rejected(manifest: Any) -> None:
    with pytest.raises(InvalidJob, match="expected a mapping"):
        parse_job(manifest)


def test_a_checkpoint_path_on_a_writable_claim_of_the_pods_is_accepted(local_job: Job) -> None:
    _set("spec.trainer.checkpoint.path", "/shared/ckpt")(local_job)
    claim = {"name": "s", "mountPath": "/shared", "persistentVolumeClaim": {"claimName": "s"}}
    _set("spec.pods", {"volumes": [claim]})(local_job)
    spec = parse_job(local_job).spec
    assert cel_errors(local_job) == []
    assert spec.job_config().trainer.checkpoint.path == "/shared/ckpt"


def test_checkpoints_go_to_the_claim_by_default_and_nowhere_without_one(local_job: Job) -> None:
    assert parse_job(local_job).spec.job_config().trainer.checkpoint.path is None
    _set("spec.checkpointClaim", "ckpt")(local_job)
    assert parse_job(local_job).spec.job_config().trainer.checkpoint.path == "/checkpoints"


@pytest.mark.parametrize(
    ("settings", "output"),
    [
        ({"checkpointClaim": "ckpt"}, {"path": "/checkpoints/model"}),
        ({}, {"path": "/output/policy", "claim": "models", "dtype": "fp32"}),
        (
            {
                "pods": {
                    "volumes": [
                        {
                            "name": "s",
                            "mountPath": "/shared",
                            "persistentVolumeClaim": {"claimName": "s"},
                        }
                    ]
                }
            },
            {"path": "/shared/run-1/policy"},
        ),
    ],
    ids=["on-the-checkpoint-claim", "on-a-claim-of-its-own", "on-a-claim-of-the-pods"],
)
def test_an_output_on_a_claim_every_pod_mounts_is_accepted_and_handed_to_the_trainer(
    local_job: Job, settings: dict[str, Any], output: dict[str, str]
) -> None:
    local_job["spec"] |= settings | {"output": output}
    _set("spec.trainer.export", {"everySteps": 5})(local_job)
    config = parse_job(local_job).spec.job_config()
    assert cel_errors(local_job) == []
    assert config.output is not None and config.output.path == output["path"]
    assert config.output.dtype == output.get("dtype")  # unset: the export's default
    assert config.trainer.export.every_steps == 5
    assert "claim" not in config.model_dump(by_alias=True)["output"]  # the operator's part


def test_a_file_reward_in_a_configmap_passes_both_validators(local_job: Job) -> None:
    reward = {"function": "file:score-v2.py:score_answer", "configMap": "team.rewards"}
    _set("spec.models.reward", reward)(local_job)
    config = parse_job(local_job).spec.job_config()
    assert cel_errors(local_job) == []
    assert config.models.reward.function == "file:score-v2.py:score_answer"


def test_an_environment_the_operator_runs_passes_both_validators(local_job: Job) -> None:
    _multi_turn(local_job)
    local_job["spec"]["environments"] = [
        {"name": "tools", "serve": "rlhf_env.toys:LetterLookup", "replicas": 2, "egress": True},
        {"name": "sandbox", "image": "sandbox:1", "command": ["sandbox-serve"], "port": 9000,
         "resources": {"cpu": 2}, "env": [{"name": "MODE", "value": "strict"}]},
        {"name": "external-tools-of-another-team", "url": "http://x.team.svc:8000"},
    ]  # fmt: skip
    spec = parse_job(local_job).spec
    assert cel_errors(local_job) == []
    # A job whose environments all run elsewhere keeps any valid name.
    _multi_turn(local_job)
    local_job["metadata"]["name"] = "1st-job"
    assert parse_job(local_job).metadata.name == "1st-job" and cel_errors(local_job) == []
    # The trainer gets each one's URL, the Services' by their short names.
    urls = {e.name: e.url for e in spec.job_config("local-cpu").environments}
    assert urls == {
        "tools": "http://local-cpu-env-tools:8000",
        "sandbox": "http://local-cpu-env-sandbox:9000",
        "external-tools-of-another-team": "http://x.team.svc:8000",
    }
    assert all(e.serve is None for e in spec.job_config("local-cpu").environments)


def test_an_agent_the_operator_runs_passes_both_validators_and_the_trainer_gets_its_url(
    local_job: Job,
) -> None:
    _agent(local_job)
    local_job["spec"]["agents"] = [
        {"name": "coder", "serve": "agents.coder:run", "replicas": 2, "egress": True,
         "maxConcurrentEpisodes": 8},
        {"name": "bash", "image": "bash-agent:1", "command": ["bash-agent"], "port": 9000,
         "resources": {"cpu": 2}, "env": [{"name": "MODE", "value": "strict"}]},
        {"name": "remote-agent-of-another-team", "url": "http://x.team.svc:8000"},
    ]  # fmt: skip
    spec = parse_job(local_job).spec
    assert cel_errors(local_job) == []
    agents = {a.name: a for a in spec.job_config("local-cpu").agents}
    assert {name: a.url for name, a in agents.items()} == {
        "coder": "http://local-cpu-agent-coder:8000",
        "bash": "http://local-cpu-agent-bash:9000",
        "remote-agent-of-another-team": "http://x.team.svc:8000",
    }
    assert all(a.serve is None for a in agents.values())
    assert [a.max_concurrent_episodes for a in agents.values()] == [8, 16, 16]
    # A local run cannot run a command-only agent; it serves serve itself.
    with pytest.raises(ValueError, match="bash gives only a command, which runs in a cluster"):
        spec.job_config()
    del local_job["spec"]["agents"][1]
    [coder, remote] = parse_job(local_job).spec.job_config().agents
    assert (coder.serve, coder.url, remote.url) == (
        "agents.coder:run",
        None,
        "http://x.team.svc:8000",
    )


def test_a_local_run_serves_serve_itself_and_refuses_a_command_only_environment(
    local_job: Job,
) -> None:
    _multi_turn(local_job)
    local_job["spec"]["environments"] = [{"name": "tools", "serve": "rlhf_env.toys:LetterLookup"}]
    [tools] = parse_job(local_job).spec.job_config().environments
    assert (tools.url, tools.serve) == (None, "rlhf_env.toys:LetterLookup")
    local_job["spec"]["environments"] = [{"name": "tools", "command": ["serve-it"]}]
    with pytest.raises(ValueError, match="tools gives only a command, which runs in a cluster"):
        parse_job(local_job).spec.job_config()


# output.path beside the job's other paths (api.output_path): an export replaces its
# directory whole, so a path that holds or lies in the checkpoints, a model or the data
# is refused at admission, naming spec.output.path and the other field. Python only.
_SHARED = {"name": "s", "mountPath": "/shared", "persistentVolumeClaim": {"claimName": "s"}}


def _output_beside(output: str, *settings: tuple[str, Any]) -> Callable[[Job], None]:
    """output.path set to `output`, the checkpoints at /shared/run/ckpt on a claim of
    the pods' (mounted at /shared), and `settings` (dotted path, value) after."""

    def apply(job: Job) -> None:
        job["spec"]["pods"] = {"volumes": [_SHARED]}
        job["spec"]["trainer"]["checkpoint"]["path"] = "/shared/run/ckpt"
        job["spec"]["output"] = {"path": output}
        for path, value in settings:
            _set(path, value)(job)

    return apply


_ACTOR = ("spec.models.actor", {"path": "/shared/models/qwen"})


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (_output_beside("/shared/run/ckpt"), "is the checkpoint root spec.trainer.checkpoint."
         "path (/shared/run/ckpt): an export replaces its directory whole, and would delete "
         "the checkpoints (got /shared/run/ckpt)"),
        (_output_beside("/shared/run/ckpt/"), "is the checkpoint root"),
        (_output_beside("/shared/run"), "holds the checkpoint root"),
        (_output_beside("/shared/run/ckpt/x/.."), "is the checkpoint root"),
        (_output_beside("/shared/run/ckpt/step-00000050"), "lies in a checkpoint's directory"),
        (_output_beside("/shared/run/ckpt/.tmp-step-00000050/model"), "lies in a checkpoint's"),
        (_output_beside("/shared/models/qwen", _ACTOR),
         "is spec.models.actor.path (/shared/models/qwen): an export replaces its directory "
         "whole, and would delete it (got /shared/models/qwen)"),
        (_output_beside("/shared/models", _ACTOR), "holds spec.models.actor.path"),
        (_output_beside("/shared/models/qwen/out", _ACTOR), "lies inside spec.models.actor.path"),
        (_output_beside("/shared/models", ("spec.models.ref", {"path": "/shared/models/ref"})),
         "holds spec.models.ref.path (/shared/models/ref)"),
        (_output_beside("/shared/data", ("spec.data.train", "/shared/data/train.jsonl")),
         "holds spec.data.train (/shared/data/train.jsonl)"),
    ],
    ids=["the-root", "the-root-slash", "above-the-root", "the-root-dotted", "a-checkpoint",
         "in-a-staged-one", "the-model", "above-the-model", "in-the-model", "above-the-ref",
         "above-the-data"],
)  # fmt: skip
def test_an_output_path_that_would_delete_what_the_job_reads_or_keeps_is_refused(
    local_job: Job, mutate: Callable[[Job], None], words: str
) -> None:
    mutate(local_job)
    for parse in (parse_job, lambda job: parse_spec(job["spec"])):
        with pytest.raises(InvalidJob) as raised:
            parse(local_job)
        assert [e.path for e in raised.value.errors] == ["spec.output.path"]
        assert words in raised.value.errors[0].message


def test_an_output_beside_the_checkpoints_or_the_models_is_accepted(local_job: Job) -> None:
    """The examples' layout (/checkpoints/model beside the step-N directories), and
    siblings whose names only start alike."""
    local_job["spec"] |= {"checkpointClaim": "ckpt", "output": {"path": "/checkpoints/model"}}
    parse_job(local_job)
    for output in ("/shared/run/ckpt/model", "/shared/run/ckpt/step-model", "/shared/models/qwen2"):
        _output_beside(output, _ACTOR)(local_job)
        parse_job(local_job)


def test_rlhfjob_validate_names_the_output_path_that_holds_the_checkpoints(
    local_job: Job, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import yaml

    from rlhf_operator.app.cli import main

    _output_beside("/shared/run")(local_job)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(local_job))
    assert main(["validate", str(manifest)]) == 1
    assert f"{manifest}: spec.output.path: holds the checkpoint root" in capsys.readouterr().out
