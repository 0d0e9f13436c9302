"""Build a tiny, RANDOM Llama-architecture model that vLLM can serve, with no downloads.

Usage (run with the *server's* interpreter, which has transformers, tokenizers and torch)::

    python build_tiny_model.py DIR [--force]

The model has random weights and emits random tokens: it exists so tests and demos run a real
engine (real batching, real scheduling, real HTTP) on machines that cannot download a model.
The tokenizer is a byte-level BPE (vocabulary 512) trained here on generated English-like text,
and ``tokenizer_config.json`` carries a chat template. Everything is seeded, so two builds give
the same files.

The shape is one the vLLM CPU attention kernels accept (head_dim 64; head_dim 16 crashes them):
hidden 256, intermediate 512, 2 layers, 4 attention heads, 2 KV heads, float32, 4096 positions.

This file is self-contained on purpose (stdlib, torch, transformers, tokenizers only): dsclient
runs it inside the server's venv, where dsclient itself is not installed.
"""

# ruff: noqa: S106  (token names like "<unk>" are not passwords)
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

SEED = 20240601
VOCAB_SIZE = 512
MARKER = "dsclient-tiny-model.json"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER,
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORD_TEXT = (
    "the a an one two three many few some every this that these those "
    "model server token request batch queue limit client engine cache memory prompt answer "
    "cat dog bird fish tree river stone cloud light night day morning evening winter summer "
    "run walk read write send wait start stop count measure build serve listen answer think "
    "fast slow small large quiet busy careful simple random tiny open closed early late "
    "and or but so because while when if then after before under over near far with without "
    "is are was were will can may must should could would has have had do does did "
    "user assistant system hello thanks please yes no maybe number time place world word"
)
_WORDS = _WORD_TEXT.split()


def _corpus(n_lines: int, rng: random.Random) -> list[str]:
    """English-like lines with punctuation, digits and chat markers, so BPE learns them all."""
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        line = " ".join(words) + rng.choice([".", "?", "!", ",", ";", ":"])
        if i % 7 == 0:
            line += f" {rng.randint(0, 10_000)}"
        if i % 11 == 0:
            line = f"<|{rng.choice(['user', 'assistant', 'system'])}|>\n{line}"
        lines.append(line)
    return lines


def is_complete(folder: Path) -> bool:
    """True when ``folder`` already holds a model this script built."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def build(folder: Path) -> None:
    """Write the tokenizer and the random model into ``folder`` (atomically, via a temp dir)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    started = time.monotonic()
    rng = random.Random(SEED)
    torch.manual_seed(SEED)

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(4000, rng), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        model.save_pretrained(tmp, safe_serialization=True)
        fast.save_pretrained(tmp)
        # Older transformers keep the template only in tokenizer_config.json; make sure it is there.
        cfg_path = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_path.read_text())
        tok_cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(tok_cfg, indent=2))
        (tmp / MARKER).write_text(
            json.dumps(
                {
                    "built_by": "dsclient make-tiny-model",
                    "random_weights": True,
                    "seed": SEED,
                    "architecture": "LlamaForCausalLM",
                    "vocab_size": VOCAB_SIZE,
                    "note": "Random weights: output is meaningless tokens. For testing only.",
                },
                indent=2,
            )
        )
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"built a tiny RANDOM Llama model ({n_params / 1e6:.1f}M parameters, vocab {VOCAB_SIZE})"
        f" in {time.monotonic() - started:.1f} s at {folder}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="folder to write the model into")
    parser.add_argument("--force", action="store_true", help="rebuild even if already complete")
    args = parser.parse_args(argv)
    folder: Path = args.dir.expanduser().resolve()
    if is_complete(folder) and not args.force:
        print(f"tiny RANDOM model already complete at {folder} (use --force to rebuild)")
        return 0
    build(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
