"""Checks on a Hugging Face export against the checkpoint it should hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.sections import TinyModel
from rlhf_trainer.data.prompts import load_prompts, prompt_tokenizer
from rlhf_trainer.models import build_tiny_model, load_tokenizer
from rlhf_trainer.rollout.engine_settings import (
    CPU_EAGER_ENVIRONMENT,
    CPU_ENVIRONMENT,
    UNI_EXECUTOR_ENVIRONMENT,
)


def tree_bytes(directory: Path) -> dict[str, bytes]:
    """Every file below `directory`, by its path there: its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def checkpoint_actor(tiny: TinyModel, step_dir: Path, scratch: Path) -> PreTrainedModel:
    """A committed checkpoint's actor weights in the project's own model class, read back
    by torch's DCP converter (not by the export's reader)."""
    model = build_tiny_model(tiny, seed=1234)  # its weights are replaced below
    dcp_to_torch_save(step_dir / "actor", scratch / "actor.pt")
    model.load_state_dict(torch.load(scratch / "actor.pt", weights_only=False)["model"])
    return model.eval()


def assert_export_holds(export: Path, actor: PreTrainedModel, dtype: torch.dtype) -> None:
    """`export` (as transformers loads it, in the dtype it was saved in) holds `actor`'s
    weights cast to `dtype`, bit for bit."""
    served = AutoModelForCausalLM.from_pretrained(export, dtype="auto").state_dict()
    for name, weight in actor.state_dict().items():
        assert served[name].dtype == dtype, name
        assert torch.equal(served[name], weight.to(dtype)), name


# vLLM (its CPU build) serving an export in a process of its own, greedy, as `vllm serve`
# would answer; the engine runs in that process (no engine-core child to start).
VLLM_GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from rlhf_trainer.rollout.engine_settings import cpu_scheduling

if __name__ == "__main__":
    directory, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=directory, dtype="float32", max_model_len=64, enforce_eager=True,
              gpu_memory_utilization=0.3, seed=0, **cpu_scheduling(64))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
"""
# as the trainer's engines
VLLM_ENVIRONMENT = CPU_ENVIRONMENT | UNI_EXECUTOR_ENVIRONMENT | CPU_EAGER_ENVIRONMENT


# `vllm serve`'s command as the export writes it, parsed by vLLM's own serve parser and
# run by its LLM on CPU: greedy text for text prompts, decoded by the tokenizer the
# command names (an adapter alone served under its --lora-modules name).
VLLM_SERVE_TEXT = """
import json, shlex, sys
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.lora.request import LoRARequest
from vllm.utils.argparse_utils import FlexibleArgumentParser
from rlhf_trainer.rollout.engine_settings import cpu_scheduling

if __name__ == "__main__":
    command, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(shlex.split(command)[1:])
    args.model = args.model_tag
    asked = EngineArgs.from_cli_args(args)
    llm = LLM(model=asked.model, tokenizer=asked.tokenizer, dtype=asked.dtype,
              enable_lora=asked.enable_lora, max_lora_rank=asked.max_lora_rank,
              max_model_len=64, enforce_eager=True, gpu_memory_utilization=0.3, seed=0,
              **cpu_scheduling(64))
    lora = None
    if args.lora_modules:
        module = args.lora_modules[0]
        lora = LoRARequest(module.name, 1, module.path)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, greedy, lora_request=lora)
    print(json.dumps([o.outputs[0].text for o in outputs]))
"""


def vllm_serve_text(command: str, prompts: list[str], max_tokens: int) -> list[str]:
    """The greedy text that the `vllm serve` `command` answers `prompts` with (vLLM's
    parser, tokenizer and engine, in a process of its own)."""
    argv = [sys.executable, "-c", VLLM_SERVE_TEXT, command, json.dumps(prompts), str(max_tokens)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env=os.environ | VLLM_ENVIRONMENT, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def held_out_prompts(config: JobConfig) -> list[list[int]]:
    """The job's held-out prompts (data.eval), tokenised as the trainer tokenises them."""
    tokenize = prompt_tokenizer(load_tokenizer(config.models.actor), config.data.chat_template)
    prompts, _ = load_prompts(config.data, config.trainer.seed, tokenize, "eval")
    return [prompt.token_ids for prompt in prompts]


def vllm_greedy(export: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """vLLM's greedy answers (token ids) to `prompts`, from the export as it loads it."""
    command = [sys.executable, "-c", VLLM_GREEDY, str(export), json.dumps(prompts), str(max_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=os.environ | VLLM_ENVIRONMENT, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers: list[list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return answers


def actor_greedy(
    actor: PreTrainedModel, prompts: list[list[int]], max_tokens: int, eos: int
) -> list[list[int]]:
    """The actor's own greedy answers: one prompt at a time (no padding), stopping after
    the end-of-sequence token as vLLM does."""
    answers = []
    for prompt in prompts:
        tokens = torch.tensor([prompt])
        with torch.no_grad():
            out = actor.generate(tokens, attention_mask=torch.ones_like(tokens), do_sample=False,
                                 max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
        answers.append(out[0, len(prompt) :].tolist())
    return answers
