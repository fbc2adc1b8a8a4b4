"""Tiny models and their tokenizer, built in code from a `TinyModel` config (no download).

`write_tiny_model` writes a Hugging Face-format directory (safetensors weights, config,
tokenizer) that both transformers and vLLM load, so the trainer and the rollout engine
start from the same weights.

The tokenizer is word-level over space-separated symbols: "a b c =" is four tokens.
Its vocabulary fills `vocab_size` exactly (specials, the task's symbols, then unused
filler tokens), so every id the model can sample decodes to something.
"""

from __future__ import annotations

import json
import string
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from torch import Tensor, nn

from rlhf_trainer.algo.ppo import log_probs_from_logits
from rlhf_trainer.api.sections import ModelSource, TinyModel

# transformers is imported where it is used: the driver needs the tokenizers alone, and
# transformers' model parts (a model config's class too) import much of torch's
# compiler stack, about 1.5 s (see tests/unit/test_driver_imports.py).
if TYPE_CHECKING:
    from transformers import (
        LlamaConfig,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        Qwen2Config,
    )

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
SEPARATOR = "="  # ends a prompt: "c a f e ="
# The words of multi-turn tool use (see TINY_CHAT_TEMPLATE): "call c" asks a tool,
# "result x =" is its answer.
CALL, RESULT = "call", "result"
# The symbols tasks are written in. A small vocab_size keeps a prefix of them; the tool
# words come last so that the copy task's ids stay what they were.
SYMBOLS = (SEPARATOR, *string.ascii_lowercase, *string.digits, CALL, RESULT)
MAX_POSITIONS = 512  # prompts and responses of the toy tasks are far shorter


def vocabulary(vocab_size: int) -> list[str]:
    """The tokens, in id order: specials, task symbols, then fillers up to vocab_size."""
    base = [*SPECIAL_TOKENS, *SYMBOLS][:vocab_size]
    return base + [f"<extra_{i}>" for i in range(vocab_size - len(base))]


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over space-separated symbols that prepends <s>."""
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(vocabulary(vocab_size))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Words joined by spaces in every decode: without a decoder, vLLM's streaming
    # detokenizer (the gateway's text) joins them with none ("callc": no tool call is
    # ever parsed). No token starts with the "##" this decoder would join on; decode()
    # is unchanged.
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MAX_POSITIONS,
        padding_side="left",  # generation pads prompts on the left
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """A model's tokenizer: built in code for a tiny model, else from its path."""
    if source.tiny is not None:
        return build_tokenizer(source.tiny.vocab_size)
    # Not before: AutoTokenizer's module imports transformers' model classes.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    assert source.path is not None  # the spec's rules: exactly one of path or tiny
    if is_word_level(source.path):
        # A tiny model's directory (an export of one): for a qwen2 model, AutoTokenizer
        # ignores the tokenizer's class and rebuilds it as Qwen2Tokenizer, byte-level,
        # whose decoder drops the spaces ("a b c" decodes as "abc": the toy rewards
        # score 0). Loaded as written, it is the tiny tokenizer.
        return PreTrainedTokenizerFast.from_pretrained(source.path)
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(source.path)
    return tokenizer


# A word-level tokenizer's own directory in an export, with no config.json beside it: what
# `vllm serve DIR --tokenizer DIR/tokenizer` loads (see save_tokenizer).
TOKENIZER_SUBDIR = "tokenizer"


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path) -> Path | None:
    """Save `tokenizer` into `directory` and, a word-level one (the tiny models'), into
    directory/tokenizer as well; that one's path is returned (None for any other).

    For a qwen2 model, transformers' AutoTokenizer (vLLM's loader too) ignores the
    tokenizer_class that tokenizer_config.json names: qwen2 is among the model types
    whose hub class it distrusts (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), and it
    rebuilds the byte-level Qwen2Tokenizer from the vocabulary, which decodes
    "c a f e =" as "cafe=". With no model config beside it, it loads the class the
    file names, the word-level tokenizer as trained."""
    tokenizer.save_pretrained(directory)
    if not word_level(tokenizer):
        return None
    tokenizer.save_pretrained(directory / TOKENIZER_SUBDIR)
    return directory / TOKENIZER_SUBDIR


def word_level(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` is word-level (the tiny tokenizer's kind)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.model, models.WordLevel)


def is_word_level(path: str) -> bool:
    """Whether `path` is a local directory whose tokenizer.json is word-level (the tiny
    tokenizer's kind; a hub id or a real model's tokenizer is not)."""
    file = Path(path) / "tokenizer.json"
    return file.is_file() and json.loads(file.read_text())["model"]["type"] == "WordLevel"


# The tiny model's conversations, word by word, with no system prompt:
#   user "c"                    -> c =
#   assistant calling lookup(c) -> call c</s>   (one "call <first argument>" per call)
#   assistant "x"               -> x</s>
#   tool "x"                    -> result x =
# It opens with <s>, as real models' templates write their own start token (a rendered
# conversation is encoded without special tokens). Messages are separated by one space;
# the generation prompt adds nothing (the model goes on after "="). The end-of-turn
# token follows the content with no space, as ChatRenderer requires: the tokenizer
# still splits it off as a token of its own.
TINY_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- for message in messages -%}
  {%- if not loop.first %} {% endif -%}
  {%- if message.role == 'user' -%}
    {{ message.content }} =
  {%- elif message.role == 'assistant' and message.tool_calls -%}
    {%- for call in message.tool_calls -%}
      {%- set arguments = call.function.arguments -%}
      {%- if not loop.first %} {% endif -%}
      call {{ arguments.values() | first if arguments is mapping else arguments }}
    {%- endfor -%}
    {{ eos_token }}
  {%- elif message.role == 'assistant' -%}
    {{ message.content }}{{ eos_token }}
  {%- elif message.role == 'tool' -%}
    result {{ message.content }} =
  {%- else -%}
    {{ raise_exception('the tiny chat template has no ' ~ message.role ~ ' role') }}
  {%- endif -%}
{%- endfor -%}
"""


def chat_tokenizer(source: ModelSource, template: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of multi-turn rollouts: `load_tokenizer`'s, with a chat template.

    A tiny model gets TINY_CHAT_TEMPLATE here only, not in `load_tokenizer`: prompts
    are rendered through a tokenizer's template whenever it has one, which would change
    the single-turn toy tasks. A real model keeps its own template and must have one,
    unless the job gives one (`template`, multiTurn.chatTemplate, which the renderer uses).
    """
    tokenizer = load_tokenizer(source)
    if source.tiny is not None:
        missing = [word for word in (CALL, RESULT) if word not in tokenizer.get_vocab()]
        if missing:
            size = len(SPECIAL_TOKENS) + len(SYMBOLS)
            raise ValueError(
                f"tiny model: vocabSize {source.tiny.vocab_size} lacks the tool words "
                f"{missing}; multi-turn rollouts need vocabSize >= {size}"
            )
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    elif template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"model {source.path}: its tokenizer has no chat template, and multi-turn "
            "rollouts need one to render tool calls and results"
        )
    return tokenizer


# The dtype a `trainer.precision` computes in (the ref's weights, the actor's and critic's
# FSDP2 parameters; their master weights stay fp32).
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def model_config(tiny: TinyModel) -> Qwen2Config | LlamaConfig:
    """A transformers config for the tiny causal LM (embeddings tied to the LM head)."""
    from transformers import LlamaConfig, Qwen2Config

    config_class = Qwen2Config if tiny.architecture == "qwen2" else LlamaConfig
    return config_class(
        vocab_size=tiny.vocab_size,
        hidden_size=tiny.hidden_size,
        intermediate_size=4 * tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        dtype="float32",
    )


def build_tiny_model(tiny: TinyModel, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised causal LM; the same seed gives the same weights."""
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = model_config(tiny)
    model: PreTrainedModel
    if isinstance(config, Qwen2Config):
        model = Qwen2ForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    return model.eval()


def position_ids(attention_mask: Tensor) -> Tensor:
    """(B, T) positions that skip left padding, so a padded row sees the same positions
    as the unpadded sequence (and as vLLM, which never pads)."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)


def token_log_probs(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, T) log π(x_t | x_<t) of every token under a causal LM, in float32.

    The first real token of a row (and padding) gets 0: nothing before it predicts it.
    The trainer's view of what the rollout engine reports for the same tokens.
    """
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
    ).logits  # (B, T, V)
    predicted = log_probs_from_logits(logits[:, :-1], input_ids[:, 1:])  # (B, T-1)
    predicted = predicted * attention_mask[:, :-1] * attention_mask[:, 1:]
    return torch.nn.functional.pad(predicted, (1, 0))


def write_tiny_model(tiny: TinyModel, directory: Path, seed: int = 0) -> Path:
    """Build the model and its tokenizer and save both into directory (HF format), the
    tokenizer into directory/tokenizer as well, which vLLM loads (save_tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tiny_model(tiny, seed).save_pretrained(directory)
    save_tokenizer(build_tokenizer(tiny.vocab_size), directory)
    return directory


class ValueModel(nn.Module):
    """The critic: a transformer backbone and a scalar head, V(s_t) at every position.

    It starts from a causal LM's checkpoint (the actor's, by default): the backbone
    keeps its weights and the LM head is dropped. The head starts at zero, so the
    first values are 0 and the first advantages are the rewards themselves.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: Path | str) -> ValueModel:
        from transformers import AutoModel

        backbone: PreTrainedModel = AutoModel.from_pretrained(path, dtype=torch.float32)
        return cls(backbone)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T) token ids and mask -> (B, T) V(s_t): the value after reading token t."""
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids(attention_mask),
        ).last_hidden_state  # (B, T, H)
        # A copy, not a view: FSDP2 warns that in-place ops on a returned view skip its
        # backward hook.
        values: Tensor = self.value_head(hidden).squeeze(-1).clone()  # (B, T)
        return values


def model_path(source: ModelSource, seed: int) -> str:
    """A directory (or hub id) for vLLM to load the model from; a tiny model is written
    to a fresh local directory, the same weights on every node for the same seed."""
    if source.tiny is None:
        assert source.path is not None  # the spec's rules: exactly one of path or tiny
        return source.path
    directory = Path(tempfile.mkdtemp(prefix="rlhf-tiny-model-"))
    return str(write_tiny_model(source.tiny, directory, seed))
