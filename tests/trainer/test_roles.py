"""The role workers without Ray: on real gloo ranks, or plain in the test process."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForSequenceClassification,
)

from rlhf_trainer.algo.experience import Experience, Sequences
from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.export import export_checkpoint
from rlhf_trainer.models import BOS, EOS, PAD, SPECIAL_TOKENS, UNK, build_tokenizer, vocabulary
from rlhf_trainer.roles import checkpoint, trainable
from rlhf_trainer.roles.checkpoint import capture_rng
from rlhf_trainer.roles.critic import Critic
from rlhf_trainer.roles.hf_export import Export
from rlhf_trainer.roles.policy import Actor
from rlhf_trainer.roles.reward import RewardModel
from rlhf_trainer.roles.sharding import clip_gradients, full_state_dict
from rlhf_trainer.worker import RankInfo, free_port, init_distributed, split_batch
from tests.specs import local_job
from tests.trainer.distributed import run_ranks

ROWS, LENGTH = 8, 10


def config(micro_batch_size: int | None, gpus: int, tmp: Path) -> JobConfig:
    job = local_job(colocated=True, total_steps=1, checkpoint_dir=tmp, every_steps=1)
    spec = job.model_dump(by_alias=True, exclude_none=True)
    spec["pools"][0]["gpusPerNode"] = gpus
    spec["models"]["actor"]["tiny"] |= {"hiddenSize": 64, "numHeads": 2}
    spec["trainer"] |= {
        "miniBatchSize": ROWS,
        "batchSize": ROWS,
        "microBatchSize": micro_batch_size,
    }
    return JobConfig.model_validate(spec)


def experience() -> Experience:
    """A batch whose rows have different response lengths (so ranks and micro-batches
    hold different token counts), left padding and right padding."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, 30, (ROWS, LENGTH), generator=generator)
    attention_mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
    response_mask = torch.zeros(ROWS, LENGTH)
    for row in range(ROWS):
        end = LENGTH - row % 2
        attention_mask[row, : row % 3] = 0
        attention_mask[row, end:] = 0
        response_mask[row, end - 1 - row % 4 : end] = 1
    input_ids *= attention_mask
    zeros = torch.zeros(ROWS, LENGTH)  # filled in by the test that needs them
    return Experience(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rollout_log_probs=zeros,
        policy_version=torch.zeros(ROWS, dtype=torch.long),
        old_log_probs=zeros,
        values=zeros,
        advantages=torch.randn(ROWS, LENGTH, generator=generator) * response_mask,
        returns=torch.randn(ROWS, LENGTH, generator=generator) * response_mask,
    )


def train_once(rank: int, job: JobConfig) -> list[dict[str, torch.Tensor]]:
    """One update of a fresh actor and of a fresh critic on this rank's shard; the
    weights of each, before and after (actor before, actor after, critic before, ...)."""
    world = torch.distributed.get_world_size()
    batch = split_batch(experience(), world)[rank]
    weights = []
    for worker in (
        Actor(RankInfo(Role.ACTOR, "policy", rank, world), job),
        Critic(RankInfo(Role.CRITIC, "policy", rank, world), job),
    ):
        if isinstance(worker, Actor):
            log_probs = worker.log_probs(batch).detach()
            shard = replace(batch, old_log_probs=log_probs, rollout_log_probs=log_probs)
        else:
            shard = replace(batch, values=worker.values(batch))
        before = full_state_dict(worker.model)
        worker.update(shard, step=1)
        weights += [before, full_state_dict(worker.model)]
    return weights


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_micro_batches_and_ranks_add_up_to_one_pass_over_the_batch(tmp_path: Path) -> None:
    """The loss is normalised by the whole mini-batch's token count over all ranks, so
    splitting it into micro-batches, or over ranks with unequal token counts, takes the
    same optimizer step as one pass over everything (for the actor and the critic)."""
    (whole,) = run_ranks(train_once, 1, config(None, 1, tmp_path))
    (micro,) = run_ranks(train_once, 1, config(2, 1, tmp_path))
    sharded, _ = run_ranks(train_once, 2, config(2, 2, tmp_path))
    for role, after in ((Role.ACTOR, 1), (Role.CRITIC, 3)):  # [before, after] per role
        initial = whole[after - 1]
        assert any(not torch.equal(whole[after][n], initial[n]) for n in initial), role
        assert_same_weights(micro[after], whole[after])
        assert_same_weights(sharded[after], whole[after])


def train_save_and_export(
    rank: int, job: JobConfig, checkpoint_dir: str, directory: str
) -> tuple[dict[str, torch.Tensor], Export | None]:
    """One update of a fresh actor on this rank's shard, its checkpoint (each rank writes
    its shards) and its export: the trained weights, whole (gathered apart from both),
    and what the export returned."""
    world = torch.distributed.get_world_size()
    actor = Actor(RankInfo(Role.ACTOR, "policy", rank, world), job)
    batch = split_batch(experience(), world)[rank]
    log_probs = actor.log_probs(batch).detach()
    actor.update(replace(batch, old_log_probs=log_probs, rollout_log_probs=log_probs), step=1)
    actor.save(checkpoint_dir)
    return full_state_dict(actor.model), actor.export(directory, "fp32", step=1)


@pytest.mark.slow
def test_the_actor_ranks_export_the_trained_policy_whole_and_so_does_their_checkpoint(
    tmp_path: Path,
) -> None:
    """Two ranks, each holding half of every weight (FSDP2), gather the trained policy
    to rank 0, which writes it as a Hugging Face directory (what a job writes to
    spec.output): transformers loads exactly those weights, tied as the model ties them.
    `rlhfjob export` of the checkpoint the two ranks wrote (each its shards) gives the
    same weights, read in one process with no process group."""
    target, root = tmp_path / "policy", tmp_path / "checkpoints"
    job = config(None, 2, tmp_path)
    staging = checkpoint.staging_dir(root, 1)
    (trained, done), (_, elsewhere) = run_ranks(
        train_save_and_export, 2, job, str(staging / Role.ACTOR), str(target)
    )
    assert done == Export(target, 1, "fp32") and elsewhere is None
    checkpoint.save_trainer_state(staging, checkpoint.TrainerState(1, 1, 0, 0, capture_rng()))
    checkpoint.save_job_config(staging, job)
    from_shards = export_checkpoint(checkpoint.commit(root, 1), tmp_path / "from-shards", "fp32")
    for directory in (target, from_shards.directory):
        loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
        served = loaded.state_dict()
        for name, weight in trained.items():
            assert torch.equal(served[name], weight), (directory, name)
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (target / name).is_file(), name


def outputs_batched_and_alone(rank: int, role: Role, job: JobConfig) -> list[torch.Tensor]:
    """A fresh actor's log-probs or critic's values of the whole batch, and of each row
    run alone without padding, put back in the row's columns."""
    info = RankInfo(role, "policy", rank, 1)
    worker = Actor(info, job) if role == Role.ACTOR else Critic(info, job)
    if isinstance(worker, Critic):  # its head starts at zero, which would hide a misplacement
        with torch.no_grad():
            worker.model.value_head.weight.normal_()
    outputs = worker.log_probs if isinstance(worker, Actor) else worker.values
    batch = experience()
    alone = torch.zeros_like(batch.response_mask)
    for row in range(ROWS):
        columns = batch.attention_mask[row].nonzero()[:, 0]
        one = batch.select(slice(row, row + 1))
        alone[row, columns] = outputs(
            replace(one, **{n: t[:, columns] for n, t in one.tensors().items() if t.dim() == 2})
        )
    return [outputs(batch), alone]


def each_batched_and_alone(
    rank: int, jobs: list[tuple[Role, JobConfig]]
) -> list[list[torch.Tensor]]:
    return [outputs_batched_and_alone(rank, role, job) for role, job in jobs]


@pytest.mark.slow
def test_micro_batches_sorted_and_trimmed_give_each_row_what_it_gets_alone(
    tmp_path: Path,
) -> None:
    """Micro-batches group rows by length and drop the columns that are padding in all
    their rows; no row's log-probs or values may change for it."""
    cases = [(role, size) for role in (Role.ACTOR, Role.CRITIC) for size in (None, 2)]
    jobs = [(role, config(size, 1, tmp_path)) for role, size in cases]
    (outputs,) = run_ranks(each_batched_and_alone, 1, jobs)  # one process for all
    for case, (batched, alone) in zip(cases, outputs, strict=True):
        assert batched.abs().sum() > 0, case
        torch.testing.assert_close(batched, alone, rtol=0, atol=1e-5, msg=str(case))


def test_a_reward_model_scores_each_sequence_at_its_last_token(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model_config = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    Qwen2ForSequenceClassification(model_config).save_pretrained(tmp_path / "rm")
    spec = config(None, 1, tmp_path).model_dump(by_alias=True, exclude_none=True)
    spec["models"]["reward"] = {"path": str(tmp_path / "rm")}
    spec["roles"]["reward"] = "policy"
    scorer = RewardModel(RankInfo(Role.REWARD, "policy", 0, 1), JobConfig.model_validate(spec))
    attention_mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    batch = Sequences(  # left-padded prompts, right-padded responses, as experience.py packs them
        input_ids=torch.tensor([[0, 5, 6, 7, 0], [5, 6, 7, 8, 9]]),
        attention_mask=attention_mask,
        response_mask=torch.zeros(attention_mask.shape),
        rollout_log_probs=torch.zeros(attention_mask.shape),
        policy_version=torch.zeros(2, dtype=torch.long),
    )
    scores = scorer.score(batch)
    alone = [
        scorer.model(input_ids=torch.tensor([ids])).logits[0, 0]
        for ids in ([5, 6, 7], [5, 6, 7, 8, 9])
    ]
    torch.testing.assert_close(scores, torch.stack(alone).detach(), rtol=0, atol=1e-5)


def reversed_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer like the tiny models', with its symbols in reverse order."""
    tokens = vocabulary(size)
    specials = len(SPECIAL_TOKENS)
    order = [*tokens[:specials], *reversed(tokens[specials:])]
    model = Tokenizer(WordLevel(vocab={t: i for i, t in enumerate(order)}, unk_token=UNK))
    model.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )


def test_a_reward_model_with_its_own_tokenizer_reads_the_text_re_tokenized(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    job = config(None, 1, tmp_path)
    actor = build_tokenizer(job.models.actor.tiny.vocab_size)  # type: ignore[union-attr]
    theirs = reversed_tokenizer(40)  # another vocabulary: other ids for the same symbols
    model_config = Qwen2Config(
        vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_labels=1,
        pad_token_id=theirs.pad_token_id,
    )  # fmt: skip
    Qwen2ForSequenceClassification(model_config).save_pretrained(tmp_path / "rm")
    theirs.save_pretrained(tmp_path / "rm")
    spec = job.model_dump(by_alias=True, exclude_none=True)
    spec["models"]["reward"] = {"path": str(tmp_path / "rm")}
    spec["roles"]["reward"] = "policy"
    scorer = RewardModel(RankInfo(Role.REWARD, "policy", 0, 1), JobConfig.model_validate(spec))
    texts = ["a b c", "b c d e"]
    encoded = actor(texts, return_tensors="pt", padding=True)  # the actor's ids, left-padded
    batch = Sequences(
        input_ids=encoded["input_ids"],
        attention_mask=encoded["attention_mask"],
        response_mask=torch.zeros(encoded["input_ids"].shape),
        rollout_log_probs=torch.zeros(encoded["input_ids"].shape),
        policy_version=torch.zeros(2, dtype=torch.long),
    )
    assert actor.convert_tokens_to_ids("a") != theirs.convert_tokens_to_ids("a")
    alone = [scorer.model(**theirs(text, return_tensors="pt")).logits[0, 0] for text in texts]
    torch.testing.assert_close(scorer.score(batch), torch.stack(alone).detach(), rtol=0, atol=1e-5)


def test_the_actor_and_the_critic_each_report_their_own_grad_norm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each update reports the gradient norm its own clipping measured (once, the
    critic's grad norm overwrote the actor's in the step's statistics)."""
    measured: list[float] = []

    def measuring(model: torch.nn.Module, max_norm: float) -> float:
        norm = clip_gradients(model, max_norm)
        measured.append(norm)
        return norm

    monkeypatch.setattr(trainable, "clip_gradients", measuring)
    job = config(None, 1, tmp_path)
    init_distributed(RankInfo(Role.ACTOR, "policy", 0, 1), "127.0.0.1", free_port())
    try:
        reported = {}
        for role in (Role.ACTOR, Role.CRITIC):
            measured.clear()
            info = RankInfo(role, "policy", 0, 1)
            worker: Any = Actor(info, job) if role == Role.ACTOR else Critic(info, job)
            batch = experience()
            if role == Role.ACTOR:
                log_probs = worker.log_probs(batch)
                batch = replace(batch, old_log_probs=log_probs, rollout_log_probs=log_probs)
            else:
                batch = replace(batch, values=worker.values(batch))
            stats = worker.update(batch, step=1)
            assert len(measured) == job.trainer.epochs  # one optimizer step per epoch
            assert stats["grad_norm"] == pytest.approx(sum(measured) / len(measured))
            reported[role] = stats["grad_norm"]
    finally:
        torch.distributed.destroy_process_group()
    assert reported[Role.ACTOR] != pytest.approx(reported[Role.CRITIC])
    assert all(norm > 0 for norm in reported.values())


def update_on_nothing(rank: int, job: JobConfig) -> list[dict[str, torch.Tensor]]:
    """An actor updated twice: on a batch, then on the same batch with nothing counted
    (every response masked, as when the reward service left every sample unscored);
    its weights before and after each."""
    actor = Actor(RankInfo(Role.ACTOR, "policy", rank, 1), job)
    batch = experience()
    log_probs = actor.log_probs(batch).detach()
    batch = replace(batch, old_log_probs=log_probs, rollout_log_probs=log_probs)
    weights = [full_state_dict(actor.model)]
    actor.update(batch, step=1)
    weights.append(full_state_dict(actor.model))
    actor.update(replace(batch, response_mask=torch.zeros_like(batch.response_mask)), step=2)
    return [*weights, full_state_dict(actor.model)]


def test_an_update_with_nothing_counted_leaves_the_weights_as_they_were(tmp_path: Path) -> None:
    """AdamW would still move them on its momentum (and weight decay) from the update
    before: no step is taken."""
    (weights,) = run_ranks(update_on_nothing, 1, config(None, 1, tmp_path))
    start, trained, after_nothing = weights
    assert any(not torch.equal(trained[n], start[n]) for n in start)
    for name in trained:
        assert torch.equal(after_nothing[name], trained[name]), name


def frozen_models(
    rank: int, job: JobConfig, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """On this rank: the ref's log-probs and the reward model's scores of one batch (every
    rank the whole of it), and the share of the ref's weights the rank holds."""
    from torch.distributed.tensor import DTensor

    from rlhf_trainer.roles.policy import load_ref, sequence_log_probs

    cpu = torch.device("cpu")
    batch = experience()
    ref = load_ref(job, cpu)
    scorer = RewardModel(RankInfo(Role.REWARD, "policy", rank, world_size), job)
    with torch.no_grad():
        log_probs = sequence_log_probs(ref, batch, job, cpu)
        scores = scorer.score(batch)
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
               for p in ref.parameters())  # fmt: skip
    return log_probs, scores, held / sum(p.numel() for p in ref.parameters())


def test_the_ref_and_a_reward_model_are_sharded_over_their_ranks_and_answer_as_whole(
    tmp_path: Path,
) -> None:
    """A frozen model over two ranks holds half of its weights on each (FSDP2, as the
    actor), and answers what the whole model answers on one."""
    torch.manual_seed(0)
    reward = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         num_labels=1, pad_token_id=0)  # fmt: skip
    Qwen2ForSequenceClassification(reward).save_pretrained(tmp_path / "rm")
    spec = config(None, 2, tmp_path).model_dump(by_alias=True, exclude_none=True)
    spec["models"]["reward"] = {"path": str(tmp_path / "rm")}
    spec["roles"]["reward"] = "policy"
    job = JobConfig.model_validate(spec)
    whole_log_probs, whole_scores, whole_held = frozen_models(0, job, 1)  # no process group
    assert whole_held == 1
    for log_probs, scores, held in run_ranks(frozen_models, 2, job, 2):
        assert 0.45 < held < 0.55
        torch.testing.assert_close(log_probs, whole_log_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(scores, whole_scores, rtol=0, atol=1e-5)
