#!/usr/bin/env python3
"""Write a tiny Qwen2-shaped model directory that vLLM can serve with ``--load-format dummy``.

    .venv-vllm/bin/python scripts/make_tiny_model.py OUT_DIR

Nothing is downloaded: ``config.json`` describes a 2-layer model (hidden 256, 4 heads of 64,
vocab 1024), and the tokenizer is a byte-level BPE trained here on a fixed built-in corpus
with the ``tokenizers`` library (vLLM's venv has it; the main venv may not). The weights are
whatever vLLM's dummy loader makes up, so the model's output is noise; what matters for the
tests is that the prompt's token ids, and so the engine's block hashes, are stable.

Deterministic and idempotent: the same files come out byte for byte on every run, and a file
whose content is already right is not rewritten (its mtime stays). Prints OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"

# ChatML, the layout Qwen2 chat models use. Message content may be a string or a list of
# OpenAI text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to in and or for with on at by from as is are was were be been it this that "
    "these those which who what when where why how agent tool call result session program "
    "worker cache block token prompt prefix model request response user assistant system "
    "read write edit file line code test build run error fix patch diff commit branch merge "
    "search query answer plan step think reason observe act return value function class "
    "module import export python rust go java shell command output input memory disk network "
    "server client gateway router scheduler queue pause resume release retain evict store "
    "remove clear event batch sequence replay subscribe publish index ledger capacity load "
    "zero one two three four five six seven eight nine ten hundred thousand million"
).split()


def corpus() -> list[str]:
    """A fixed training corpus: words, their pairings, digits and punctuation."""
    lines = []
    n = len(_WORDS)
    for i, word in enumerate(_WORDS):
        lines.append(" ".join(_WORDS[(i + k * 7) % n] for k in range(12)))
        lines.append(f"{word.capitalize()} {word}s, {word}ed; {word}ing: {word}() -> {i} ({i * 37 % 1000}).")
    lines.append("".join(chr(c) for c in range(32, 127)))
    lines.extend(f"{i:04d} {i * 7919 % 10007} 0x{i:03x}" for i in range(200))
    return lines


def build_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes, no <unk>
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise SystemExit(f"tokenizer vocab {tokenizer.get_vocab_size()} > {VOCAB_SIZE}")
    # Round-trip through JSON with sorted keys, so the file is byte-stable.
    return json.dumps(json.loads(tokenizer.to_str()), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def model_config(eos_id: int, bos_id: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,      # head_dim 64: CPU attention rejects 16
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "use_sliding_window": False,
        "sliding_window": None,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def make_tiny_model(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = build_tokenizer_json()
    vocab = json.loads(tok_json)["model"]["vocab"]
    eos_id, bos_id = vocab[EOS_TOKEN], vocab["<|endoftext|>"]
    files = {
        "tokenizer.json": tok_json,
        "tokenizer_config.json": _dump(tokenizer_config()),
        "special_tokens_map.json": _dump({"eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>"}),
        "config.json": _dump(model_config(eos_id, bos_id)),
        "generation_config.json": _dump({"eos_token_id": eos_id, "bos_token_id": bos_id}),
    }
    for name, text in files.items():
        path = out / name
        data = text.encode("utf-8")
        if path.exists() and path.read_bytes() == data:
            continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    args = parser.parse_args(argv)
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("make_tiny_model.py needs the `tokenizers` package; run it with .venv-vllm/bin/python",
              file=sys.stderr)
        return 2
    print(make_tiny_model(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
