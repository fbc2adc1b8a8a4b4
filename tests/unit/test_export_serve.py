"""The `vllm serve` command an export is written with (roles.hf_serve), read by vLLM's
own serve parser and checked by vLLM's own rules: an adapter's rank against the
--max-lora-rank it names (vLLM's default, 16, refuses a larger adapter: issue 74), and
the dtype of an fp32 export. No engine starts here (tests/trainer/test_export_serving.py
serves the commands): ~10 s, most of it importing vLLM."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest

from rlhf_trainer.api.sections import TinyModel, TrainedModel
from rlhf_trainer.models import TOKENIZER_SUBDIR, build_tiny_model, write_tiny_model
from rlhf_trainer.roles.hf_export import write_policy
from rlhf_trainer.roles.hf_serve import SERVE_FILE
from rlhf_trainer.roles.lora import with_adapter

TINY = {"vocabSize": 64, "hiddenSize": 64, "numHeads": 2}


def vllm_serve_args(command: str) -> argparse.Namespace:
    """`command` as `vllm serve` parses it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    words = shlex.split(command)
    assert words[:2] == ["vllm", "serve"], command
    return parser.parse_args(words[1:])


@pytest.mark.parametrize(("rank", "max_rank"), [(4, 8), (16, 16), (32, 32), (100, 128)])
def test_an_adapters_command_names_its_base_and_a_max_lora_rank_that_holds_it(
    tmp_path: Path, rank: int, max_rank: int
) -> None:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    tiny = TinyModel.model_validate(TINY)
    base = write_tiny_model(tiny, tmp_path / "base")
    lora = {"rank": rank, "alpha": 2 * rank, "targetModules": ["q_proj", "v_proj"]}
    actor = TrainedModel.model_validate({"path": str(base), "lora": lora})
    assert actor.lora is not None
    model = with_adapter(build_tiny_model(tiny), actor.lora)
    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    done = write_policy(trained, actor, tmp_path / "adapter", None, 1, "test", seed=0,
                        adapter=True)  # fmt: skip
    assert done.serve in (done.directory / SERVE_FILE).read_text()
    args = vllm_serve_args(done.serve)
    assert (args.model_tag, args.enable_lora, args.max_lora_rank) == (str(base), True, max_rank)
    assert [(m.name, m.path) for m in args.lora_modules] == [("policy", str(done.directory))]
    assert args.dtype == "auto"  # a bf16 adapter: the base's dtype
    assert args.tokenizer == str(done.directory / TOKENIZER_SUBDIR)  # the tiny word-level one
    written = PEFTHelper.from_local_dir(str(done.directory), max_position_embeddings=512)
    written.validate_legal(LoRAConfig(max_lora_rank=args.max_lora_rank))
    if rank > 16:  # what the docs' command without --max-lora-rank met
        with pytest.raises(ValueError, match=f"LoRA rank {rank} is greater than max_lora_rank 16"):
            written.validate_legal(LoRAConfig())


@pytest.mark.parametrize(("dtype", "served"), [("fp32", "float32"), ("bf16", "auto")])
def test_an_fp32_export_is_served_in_fp32(tmp_path: Path, dtype: str, served: str) -> None:
    actor = TrainedModel.model_validate({"tiny": TINY})
    assert actor.tiny is not None
    weights = build_tiny_model(actor.tiny).state_dict()
    done = write_policy(weights, actor, tmp_path / "policy", dtype, 1, "test", seed=0)
    args = vllm_serve_args(done.serve)
    assert (args.model_tag, args.dtype) == (str(done.directory), served)
