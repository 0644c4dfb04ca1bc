"""A tiny random Llama with a byte-level tokenizer and a chat template, and small text tasks for it."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import make_tiny_model
from vlora.adapters.sources import Example, make_source

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer():
    """256 byte tokens (no merges) + <|im_start|> (256) + <|im_end|> (257, end of text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   chat_template=CHAT_TEMPLATE)


def make_tiny_chat_model(root: Path, name: str = "tiny-chat") -> Path:
    path, _ = make_tiny_model(root, name=name, vocab_size=258, bos_token_id=256, eos_token_id=257)
    byte_tokenizer().save_pretrained(path)
    return path


def tiny_sources(requirement: float = 0.75):
    """Three tasks over two-word texts. 'farm' (is the animal a farm animal? y/n) and 'clash' ask the same
    prompt of the same texts with the opposite labels, so they cannot share an adapter; 'hue' (is the colour
    warm or cool? w/c) has its own prompt. Held-out texts are unseen (animal, colour) pairs."""
    animals, colours = ["cow", "pig", "hen", "goat", "fox", "owl", "bee", "wolf"], \
        ["red", "tan", "gold", "pink", "blue", "gray", "jade", "navy"]
    pairs = [(a, c) for a in animals for c in colours]
    farm = [Example(f"{a} {c}", "y" if a in animals[:4] else "n") for a, c in pairs]
    return [make_source("farm", requirement, farm, prompt="Q {text}"),
            make_source("clash", requirement, [Example(e.text, "n" if e.label == "y" else "y") for e in farm],
                        prompt="Q {text}"),
            make_source("hue", requirement, [Example(f"{c} {a}", "w" if c in colours[:4] else "c") for a, c in pairs],
                        prompt="H {text}")]
