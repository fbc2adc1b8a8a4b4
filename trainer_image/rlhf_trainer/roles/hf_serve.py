"""The command that serves an export with vLLM as it was trained, written into the export
(README.md) and logged by the writer, so the command a user copies is the one that works.

What it adds to `vllm serve DIR`, each from vLLM's own argument parsing (0.32):
- an adapter alone is served on its base (`--enable-lora --lora-modules policy=DIR`),
  and vLLM refuses an adapter whose rank is above `--max-lora-rank` (16 by default; the
  values it accepts are api.lora.VLLM_MAX_LORA_RANKS): the command names the smallest
  that holds the adapter's rank, as the job's engines were built;
- an fp32 export gets `--dtype float32`: vLLM's "auto" runs an fp32 model in bf16 (its
  platform's first dtype), which rounds a merged LoRA's small update away again;
- a word-level tokenizer (the tiny models') is loaded from its own directory
  (`--tokenizer DIR/tokenizer`, models.save_tokenizer): beside a qwen2 config,
  transformers rebuilds it as the byte-level Qwen2Tokenizer, which drops its spaces.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from rlhf_trainer.api.lora import engine_max_lora_rank
from rlhf_trainer.api.sections import TrainedModel
from rlhf_trainer.models import TOKENIZER_SUBDIR

SERVE_FILE = "README.md"  # in the export: how to serve it
ADAPTER_NAME = "policy"  # the name the adapter is served under (the request's model)
BASE_PLACEHOLDER = "BASE"  # a tiny base has no directory: the user writes one
FLAG_NOTES = {  # why the command has each flag, in the README
    "--max-lora-rank": "vLLM refuses an adapter of a rank above it (16 by default).",
    "--dtype": "vLLM would run an fp32 model in bf16, rounding a merged update away.",
    "--tokenizer": "the word-level tokenizer as trained: beside a qwen2 config, "
    "transformers rebuilds it as Qwen2Tokenizer, which drops its spaces.",
}


def serve_command(
    target: Path, dtype: str, actor: TrainedModel, adapter: bool, word_level: bool
) -> str:
    """`vllm serve` of the export at `target` (absolute), in `dtype`: an adapter alone
    on the base models.actor names, else the directory itself."""
    here = Path(os.path.abspath(target))
    if adapter:
        assert actor.lora is not None
        rank = engine_max_lora_rank(actor.lora.rank)
        base = actor.path or BASE_PLACEHOLDER
        words = ["vllm", "serve", base, "--enable-lora", "--max-lora-rank", str(rank),
                 "--lora-modules", f"{ADAPTER_NAME}={here}"]  # fmt: skip
    else:
        words = ["vllm", "serve", str(here)]
    if dtype == "fp32":
        words += ["--dtype", "float32"]
    if word_level:
        words += ["--tokenizer", str(here / TOKENIZER_SUBDIR)]
    return shlex.join(words)


def serve_readme(
    command: str, step: int, dtype: str, actor: TrainedModel, adapter: bool, seed: int
) -> str:
    """The export's README.md: what it holds and the command that serves it."""
    what = "the LoRA adapter alone (peft's format)" if adapter else "the policy"
    lines = [
        "# The trained policy, exported by rlhf-operator",
        "",
        f"{what.capitalize()} of step {step}, in {dtype}. Serve it with vLLM:",
        "",
        f"    {command}",
        "",
    ]
    lines += [f"- `{flag}`: {why}" for flag, why in FLAG_NOTES.items() if f" {flag} " in command]
    if actor.tiny is not None and adapter:
        tiny = actor.tiny.model_dump_json(by_alias=True)
        lines += [
            "",
            f"{BASE_PLACEHOLDER}: the tiny base model (models.actor.tiny, trainer.seed {seed}), "
            "written by:",
            "",
            "    python -c 'from pathlib import Path; from rlhf_trainer.api.sections import "
            "TinyModel; from rlhf_trainer.models import write_tiny_model; "
            f'write_tiny_model(TinyModel.model_validate_json("""{tiny}"""), Path("BASE"), '
            f"seed={seed})'",
        ]
    return "\n".join(lines) + "\n"
