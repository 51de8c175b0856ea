#!/usr/bin/env python3
"""Build a tiny random-weight Llama and a byte-level BPE tokenizer, offline.

The result is an ordinary Hugging Face model folder that `vllm serve DIR` loads.
Deterministic (fixed seeds); nothing is fetched from a hub. Replies are gibberish;
`max_tokens` ends each one.

    python scripts/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch  # type: ignore[import-not-found]
from tokenizers import (  # type: ignore[import-not-found, unused-ignore]
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)
from transformers import (  # type: ignore[import-not-found]
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

VOCAB_SIZE = 2048
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", *ROLE_TOKENS]

# Role-tagged turns, like the prompts llmgw's prefix scorer hashes.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' if m['role'] in ['system', 'user', 'assistant'] else '<|user|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(rng: random.Random) -> list[str]:
    """Synthetic sentences with enough distinct pieces for BPE to fill the vocabulary."""
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    vocab = [
        "router",
        "replica",
        "session",
        "prefix",
        "cache",
        "queue",
        "token",
        "model",
        "metric",
        "stream",
        "chat",
    ]
    vocab += ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    text = [
        " ".join(rng.choices(vocab, k=rng.randint(3, 20))) + rng.choice(".?!,")
        for _ in range(30000)
    ]
    text += ["".join(map(chr, range(32, 127)))] * 50  # every printable ASCII character
    return text


def build_tokenizer(rng: random.Random) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus(rng),
        trainer=trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=2048,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def main(out: Path) -> None:
    tokenizer = build_tokenizer(random.Random(0))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,  # vLLM's CPU attention kernels support head sizes from 32 up
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    print(f"tiny model in {out}: vocab {len(tokenizer)}, {model.num_parameters()} parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".scratch/tiny-llama"))
