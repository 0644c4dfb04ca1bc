"""A tiny random Llama (and LLaVA) with a byte-level tokenizer and a chat template, and small text and image
tasks for them."""

from __future__ import annotations

from pathlib import Path

import random

from tests.helpers import TINY, make_tiny_model, perturb_norms_and_biases
from vlora.adapters.sources import Example, make_source

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(extra: tuple[str, ...] = ()):
    """256 byte tokens (no merges) + <|im_start|> (256) + <|im_end|> (257, end of text) + ``extra`` (258...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", *extra])
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


def make_tiny_chat_llava(root: Path, name: str = "tiny-chat-llava") -> Path:
    """A tiny random LLaVA (CLIP 28 px, 16 tokens per image) whose tokenizer has <image> (258) as placeholder."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=28, patch_size=7, projection_dim=32)
    text = LlamaConfig(**{**TINY, "vocab_size": 259}, bos_token_id=256, eos_token_id=257)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_id=258, vision_feature_layer=-1)
    path = root / name
    perturb_norms_and_biases(LlavaForConditionalGeneration(cfg).eval()).save_pretrained(path)
    byte_tokenizer(("<image>",)).save_pretrained(path)
    return path


def tiny_image_sources(folder: Path, n: int = 32, requirement: float = 0.75):
    """Three image tasks drawn with PIL: 'colour' (is the noisy picture red or blue?) and 'pattern' (striped or
    plain grey?) answered by the task head, 'shade' (bright or dark? 'b'/'d') answered as text."""
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)

    def noisy(base):
        im = Image.new("RGB", (28, 28), base)
        draw = ImageDraw.Draw(im)
        for _ in range(6):
            x, y = rng.randrange(24), rng.randrange(24)
            draw.rectangle((x, y, x + 3, y + 3), fill=tuple(rng.randrange(256) for _ in range(3)))
        return im

    def save(im, name):
        im.save(folder / name)
        return str(folder / name)

    colour, pattern, shade = [], [], []
    for i in range(n):
        c = ("red", (200, 30, 30)) if i % 2 else ("blue", (30, 30, 200))
        colour.append(Example("", c[0], save(noisy(c[1]), f"colour{i}.png")))
        grey = rng.randrange(60, 200)
        im = Image.new("RGB", (28, 28), (grey, grey, grey))
        if i % 2:
            for y in range(rng.randrange(2), 28, 4):
                ImageDraw.Draw(im).rectangle((0, y, 27, y + 1), fill=(255 - grey, 255 - grey, 255 - grey))
        pattern.append(Example("", "striped" if i % 2 else "plain", save(im, f"pattern{i}.png")))
        v = rng.randrange(180, 250) if i % 2 else rng.randrange(0, 70)
        shade.append(Example("", "b" if i % 2 else "d", save(noisy((v, v, v)), f"shade{i}.png")))
    return [make_source("colour", requirement, colour, prompt="Colour?", head=True),
            make_source("pattern", requirement, pattern, prompt="{image} Pattern?", head=True),
            make_source("shade", requirement, shade, prompt="Shade?")]


def train_and_fuse(root: Path, model: Path, sources, **config):
    """A LoraTrainer on ``model`` (``config``: TrainConfig fields) and the fusion of ``sources`` into root/out
    (baselines included; the given order, so that the steps are known): (trainer, result, out folder)."""
    from vlora.adapters.fusion import FusionConfig, fuse
    from vlora.adapters.trainer import LoraTrainer, TrainConfig

    trainer = LoraTrainer(TrainConfig(model=str(model), **config), progress=False)
    return trainer, fuse(sources, trainer, root / "out", FusionConfig(order="given")), root / "out"


def assert_engine_answers_equal_evaluation(llm, trainer, result, by_task, out: Path) -> None:
    """Every adapter written, served by ``llm``: the engine's answer to each held-out example is right exactly
    when the training-time evaluation says so, and the accuracies are the report's."""
    from vlora.adapters.trainer import engine_answers

    for a in result.output:
        state = trainer.load(out / a.name)
        for task in a.tasks:
            src = by_task[task]
            answers = engine_answers(llm, a.name, src)
            correct = [ans == e.label for ans, e in zip(answers, src.heldout)]
            assert correct == trainer.evaluate(state, src), (a.name, task, answers)
            assert sum(correct) / len(correct) == a.accuracy[task]


def assert_sharing_changes_nothing(trainer, sources, adapter: Path) -> None:
    """With the adapter at ``adapter`` set, a batch mixing every source's training examples (and one of a
    single source) gives the same hidden states, gradients and verdicts whether the leading tokens all its
    examples share are run once (through a key-value cache) or in every row."""
    import torch

    from vlora.adapters.trainer import _shared_length

    state = trainer.load(adapter)
    trainer._set(state.lora)
    head = trainer._grow_head(state.head, [s for s in sources if s.head])
    mixed = [trainer._encode(s, e) for s in sources for e in s.train[:3]]
    single = [trainer._encode(sources[0], e) for e in sources[0].train[:6]]
    for batch in (mixed, single):
        assert _shared_length(trainer._layer_inputs(batch)) >= 4          # the chat template's start at least
        got = {}
        for share in (False, True):
            trainer.share_prefix = share
            trainer.model.zero_grad()
            hidden = trainer._hidden(batch)
            loss = trainer._loss(batch, _trainable(trainer, head, batch))
            loss.backward()
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
            got[share] = hidden.detach(), loss.item(), grads, trainer._score(batch, head)
        trainer.model.zero_grad()
        (h0, l0, g0, s0), (h1, l1, g1, s1) = got[False], got[True]
        assert h0.shape == h1.shape and torch.allclose(h0, h1, atol=1e-4, rtol=1e-4)
        assert abs(l0 - l1) < 1e-4 and g0.keys() == g1.keys() and g0
        assert all(torch.allclose(g0[k], g1[k], atol=1e-5, rtol=1e-3) for k in g0)
        assert s0[0] == s1[0] and all(abs(a - b) < 1e-4 for a, b in zip(s0[1], s1[1]))
    trainer.share_prefix = True


def _trainable(trainer, head, batch):
    from vlora.adapters.trainer import _TrainableHead

    heads = [it for it in batch if it.head]
    return None if head is None or not heads else _TrainableHead(head, *trainer._head_stats(heads))
