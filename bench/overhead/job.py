"""The fully-async job both overhead ratios are measured in: bench/async's tiny model
(qwen2, hidden 96, 2 layers) and toy task, GRPO (no critic: the actor is the only
trained role), the actor on two ranks of pool "train", one engine on pool "rollout"."""

from __future__ import annotations

from pathlib import Path

from rlhf_trainer.api.config import JobConfig

ACTOR_RANKS = 2  # FSDP2 over gloo, one torch thread each, as a role rank has on CPU
PROMPTS_PER_STEP = 8
SAMPLES_PER_PROMPT = 4
RESPONSE_CAP = 192  # bench/async's: long-tailed lengths, mean ~50 tokens
MODEL = {"hiddenSize": 96, "numLayers": 2, "numHeads": 3, "vocabSize": 64}


def job(checkpoints: Path) -> JobConfig:
    return JobConfig.model_validate(
        {
            "pools": [
                {"name": "train", "replicas": 1, "gpusPerNode": ACTOR_RANKS},
                {"name": "rollout", "replicas": 1, "gpusPerNode": 1},
            ],
            "roles": {"actor": "train", "rollout": "rollout"},
            "models": {"actor": {"tiny": MODEL}, "reward": {"function": "toy_copy"}},
            "data": {"train": "toy:copy", "maxPromptLength": 16, "maxResponseLength": RESPONSE_CAP},
            "algorithm": {"klCoef": 0, "advantageEstimator": "grpo"},
            "generation": {"gpuMemoryUtilization": 0.3, "samplesPerPrompt": SAMPLES_PER_PROMPT},
            "async": {"stalenessThreshold": 1, "triggerParameterSyncStep": 2},
            "trainer": {
                "totalSteps": 1_000_000,
                "batchSize": PROMPTS_PER_STEP,
                "miniBatchSize": 16,
                "microBatchSize": 4,
                # Tiny: the pushed weights barely change what the engine samples.
                "actorLearningRate": 1e-7,
                "checkpoint": {"path": str(checkpoints), "everySteps": 1_000_000},
            },
        }
    )
