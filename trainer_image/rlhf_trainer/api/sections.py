"""The sections of a job spec that say what to train and how: the models, the data, the
algorithm, generation and the trainer. `config.JobConfig` puts them together with the
pools and roles."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_trainer.api.agentic import MultiTurnConfig
from rlhf_trainer.api.agents import AgentEpisodes
from rlhf_trainer.api.lora import LoraConfig
from rlhf_trainer.api.reward import RewardSource
from rlhf_trainer.api.rules import Rule, SpecModel
from rlhf_trainer.api.shape import ModelShape

TINY_MIN_HEAD_DIM = 32  # vLLM's CPU attention kernels need head_dim >= 32


class TinyModel(SpecModel):
    """A small causal LM built from this config at run time (tests, demos); no download."""

    architecture: Literal["qwen2", "llama"] = Field("qwen2", description="Model family.")
    hidden_size: int = Field(128, ge=32, le=8192, description="Hidden size.")
    num_layers: int = Field(2, ge=1, le=64, description="Transformer layers.")
    num_heads: int = Field(4, ge=1, le=128, description="Attention heads.")
    vocab_size: int = Field(
        512, ge=16, le=262144, description="Vocabulary size (the built-in tokenizer's)."
    )

    rules = (
        Rule(
            "hiddenSize",
            f"hiddenSize / numHeads (the head dim) must be a whole number >= {TINY_MIN_HEAD_DIM}",
            f"self.hiddenSize % self.numHeads == 0 && "
            f"self.hiddenSize / self.numHeads >= {TINY_MIN_HEAD_DIM}",
            lambda m: (
                m.hidden_size % m.num_heads == 0
                and m.hidden_size // m.num_heads >= TINY_MIN_HEAD_DIM
            ),
        ),
    )

    def shape(self) -> ModelShape:
        """The tiny model's shape (rlhf_trainer.models.model_config: an MLP 4x wide,
        as many key-value heads as heads, the LM head tied to the embeddings)."""
        h = self.hidden_size
        return ModelShape(
            layers=self.num_layers,
            hidden_size=h,
            intermediate_size=4 * h,
            kv_size=h,
            vocab_size=self.vocab_size,
            tied_embeddings=True,
        )


class ModelSource(SpecModel):
    """Where a model comes from: a checkpoint path, or a tiny model built from a config."""

    path: str | None = Field(
        None,
        min_length=1,
        description="A Hugging Face-format checkpoint: a local directory or a hub model id.",
    )
    tiny: TinyModel | None = Field(None, description="Build a tiny model from this config.")
    shape: ModelShape | None = Field(
        None,
        description=(
            "The model's shape (its config.json's fields), with path: `rlhfjob plan` shows "
            "the memory each role takes of a GPU, and a placement that cannot fit "
            "pools[].gpuMemoryGiB is refused. Unset: that memory is unknown and nothing is "
            "refused. A tiny model's shape is known."
        ),
    )

    rules = (
        Rule(
            "",
            "set exactly one of path or tiny",
            "has(self.path) != has(self.tiny)",
            lambda m: (m.path is None) != (m.tiny is None),
        ),
        Rule(
            "shape",
            "goes with path only (a tiny model's shape is its tiny config)",
            "!has(self.shape) || has(self.path)",
            lambda m: m.shape is None or m.path is not None,
        ),
    )

    def model_shape(self) -> ModelShape | None:
        """The shape of the model: the spec's, or a tiny model's own; None if unknown."""
        return self.tiny.shape() if self.tiny is not None else self.shape


class TrainedModel(ModelSource):
    """A model the job trains: all its weights, or a LoRA adapter on it."""

    lora: LoraConfig | None = Field(
        None,
        description=(
            "Train a LoRA adapter on this model, frozen, instead of all its weights; unset: "
            "full fine-tuning. On the critic (models.critic, set to give it its own), the "
            "value head trains whole."
        ),
    )


class ModelsConfig(SpecModel):
    """The models of the job. ref and critic start from the actor's model unless set."""

    actor: TrainedModel = Field(description="The initial policy.")
    ref: ModelSource | None = Field(
        None, description="The reference policy; defaults to the actor's initial model."
    )
    critic: TrainedModel | None = Field(
        None,
        description=(
            "The value model's backbone (gae only); defaults to the actor's initial model."
        ),
    )
    reward: RewardSource = Field(description="The reward model or rule-based reward function.")

    @property
    def ref_is_actor_base(self) -> bool:
        """The ref is the LoRA'd actor's own base: the actor answers its log-probs with the
        adapter off, and no second copy of the model is loaded."""
        return self.actor.lora is not None and self.ref is None


class DataConfig(SpecModel):
    """The prompts to train on."""

    train: str = Field(
        min_length=1,
        description=(
            "Training prompts: a .parquet, .jsonl or .json file, or a directory saved by HF "
            "datasets, the prompt under promptKey; or 'toy:<task>' for a built-in "
            "generated task (e.g. 'toy:copy')."
        ),
    )
    prompt_key: str = Field(
        "prompt",
        min_length=1,
        description="Column holding the prompt: a string or a list of {role, content} messages.",
    )
    chat_template: bool | None = Field(
        None,
        description=(
            "Render conversations with the tokenizer's chat template; unset: when the "
            "tokenizer has one."
        ),
    )
    overlong_prompts: Literal["drop", "truncate", "error"] = Field(
        "drop",
        description=(
            "A prompt over maxPromptLength tokens: drop it (counted and logged), truncate "
            "it to its last tokens, or fail the job at start."
        ),
    )
    max_prompt_length: int = Field(512, ge=1, le=131072, description="Prompt tokens, at most.")
    max_response_length: int = Field(
        512, ge=1, le=131072, description="Generated tokens per response, at most."
    )
    shuffle: bool = Field(True, description="Shuffle prompts every epoch (seeded).")
    eval: str | None = Field(
        None,
        min_length=1,
        description=(
            "Held-out prompts, scored before training, every trainer.evalEverySteps steps "
            "and at the end (see generation.eval): the same sources and columns as train; "
            "'toy:<task>:heldout' for a built-in task's held-out split."
        ),
    )


class EvalGeneration(SpecModel):
    """How the held-out prompts (data.eval) are answered and judged."""

    samples_per_prompt: int = Field(
        1,
        ge=1,
        le=1024,
        description="Responses per held-out prompt (k of pass@k); above 1 needs temperature.",
    )
    temperature: float = Field(
        0.0, ge=0, le=10, description="Sampling temperature; 0 answers greedily."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling probability mass.")
    pass_reward: float = Field(
        1.0,
        description="A response passes (pass@1, pass@k) when its reward is at least this.",
    )

    rules = (
        Rule(
            "samplesPerPrompt",
            "above 1 needs temperature > 0 (greedy answers to one prompt are all the same)",
            "!has(self.samplesPerPrompt) || self.samplesPerPrompt == 1 || "
            "(has(self.temperature) && self.temperature > 0.0)",
            lambda e: e.samples_per_prompt == 1 or e.temperature > 0,
        ),
    )


class GenerationConfig(SpecModel):
    """Sampling and engine settings of the rollout role."""

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling probability mass.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=16, description="GPUs per vLLM engine; must divide the pool's gpusPerNode."
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of GPU memory vLLM may take."
    )
    enforce_eager: bool = Field(
        False,
        description=(
            "Run vLLM eagerly, without CUDA graphs: no graph capture at start-up and no "
            "memory held for graphs, but slower decoding. Unset, engines on GPUs capture "
            "CUDA graphs; engines on CPUs always run eagerly."
        ),
    )
    samples_per_prompt: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Responses generated per prompt (n, the group size); a step trains on "
            "batchSize x n samples."
        ),
    )
    max_engine_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description=(
            "Times the rollout engine in each bundle may be lost and replaced in a run (its "
            "vLLM engine died, or its rollout rank's process or node was lost). A new "
            "engine starts in the bundle and a weight push brings it to the current "
            "policy, the same way on every weight transfer (CPU or GPU); its work is done "
            "again. One more loss in that bundle fails the job, naming the engine."
        ),
    )
    eval: EvalGeneration = Field(
        default_factory=EvalGeneration,
        description="Sampling of the held-out prompts (data.eval): greedy by default.",
    )
    multi_turn: MultiTurnConfig | None = Field(
        None,
        description=(
            "Set for multi-turn, tool-using rollouts against an environment (agentic RL); "
            "unset: one prompt, one response."
        ),
    )
    agent: AgentEpisodes | None = Field(
        None,
        description=(
            "Set for episodes run by an agent that owns its loop (agents[]), calling the "
            "policy through the rollout pool's OpenAI-compatible gateway."
        ),
    )


class CheckpointConfig(SpecModel):
    """Where and how often to checkpoint; a restarted job resumes from the latest."""

    path: str | None = Field(
        None,
        min_length=1,
        description=(
            "Directory for checkpoints, one place that every pod shares. Unset: /checkpoints "
            "on checkpointClaim when the job has one, else no checkpoints (a local run: its "
            "run folder). Set without checkpointClaim, it must lie on a persistentVolumeClaim "
            "of pods.volumes."
        ),
    )
    every_steps: int = Field(50, ge=1, description="Checkpoint every this many steps.")
    keep: int = Field(2, ge=1, le=1000, description="How many recent checkpoints to keep.")


class ExportConfig(SpecModel):
    """When the trained policy is written to `output` besides the end of the job."""

    every_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "Also write the policy to output every this many steps; unset: only at the "
            "end. Needs output."
        ),
    )


class OutputConfig(SpecModel):
    """Where the trained policy goes as a Hugging Face directory (safetensors, config,
    generation config, tokenizer and chat template): what `vllm serve` and
    `AutoModelForCausalLM.from_pretrained` load."""

    path: str = Field(
        min_length=2,
        pattern=r"^/",
        description=(
            "The directory, an absolute path on a volume every pod shares (below "
            "/output with output.claim, or on checkpointClaim's or a pods.volumes claim). "
            "Written whole at the end of the job (and every trainer.export.everySteps), "
            "replacing the previous export only once complete."
        ),
    )
    dtype: Literal["bf16", "fp32"] | None = Field(
        None,
        description=(
            "The weights' dtype. Unset: fp32 for a LoRA adapter merged into its base "
            "(models.actor.lora with lora: merged; bf16 rounds W + BA back toward W and "
            "loses most of a small update, and the export logs how much when asked for "
            "it), bf16 otherwise."
        ),
    )
    lora: Literal["merged", "adapter"] = Field(
        "merged",
        description=(
            "With models.actor.lora: merged writes the model with the adapter merged into "
            "its weights (what any server loads); adapter writes the adapter alone in "
            "peft's format (megabytes: `vllm serve BASE --enable-lora --max-lora-rank R "
            "--lora-modules NAME=DIR`, R at least lora.rank; the export's README.md gives "
            "the command). Needs models.actor.lora when adapter."
        ),
    )


class TrainerConfig(SpecModel):
    """The training schedule."""

    total_steps: int = Field(100, ge=1, le=10_000_000, description="PPO steps to run.")
    batch_size: int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="Prompts per PPO step (each answered generation.samplesPerPrompt times).",
    )
    mini_batch_size: int = Field(
        16,
        ge=1,
        le=1_000_000,
        description=(
            "Samples per optimizer step; must divide batchSize x samplesPerPrompt and be a "
            "multiple of the actor's and the critic's data-parallel size (their pool's GPUs)."
        ),
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description=(
            "Samples per forward/backward on one GPU (gradient accumulation); "
            "unset = the whole per-GPU mini-batch at once."
        ),
    )
    epochs: int = Field(1, ge=1, le=100, description="PPO epochs over each batch.")
    actor_learning_rate: float = Field(1e-6, gt=0, le=1, description="Actor learning rate.")
    critic_learning_rate: float = Field(1e-5, gt=0, le=1, description="Critic learning rate.")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="Gradient clipping norm.")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description=(
            "bf16: FSDP2 mixed precision for the actor and critic (bf16 parameters and "
            "compute, fp32 master weights and gradient reduction); the ref and the rollout "
            "engines run in bf16. fp32: everything in fp32 (the fast choice on CPUs "
            "without native bf16)."
        ),
    )
    gradient_checkpointing: bool = Field(
        False,
        description=(
            "Recompute the actor's and critic's activations in the backward pass instead "
            "of keeping them: much less memory for about a third more compute."
        ),
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for data order and sampling.")
    weight_sync_timeout_seconds: int = Field(
        600,
        ge=10,
        le=86_400,
        description=(
            "How long setting up the weight transfer, or each of its calls to the rollout "
            "engines, may take. Past it the job fails, naming each rank that did not "
            "answer (stopped, hung or lost) and those left waiting for it; except after "
            "a push that lost an engine, when an engine still in that push's receive "
            "(NCCL) is replaced as a lost one is."
        ),
    )
    eval_every_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "Score data.eval every this many steps (also before training and at the "
            "end); unset: only before training and at the end. Needs data.eval."
        ),
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpointing."
    )
    export: ExportConfig = Field(
        default_factory=ExportConfig, description="Writing the policy to output."
    )
