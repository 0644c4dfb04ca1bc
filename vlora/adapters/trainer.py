"""PEFT LoRA training and evaluation on the served model: the :class:`~vlora.adapters.fusion.Trainer` that
adapter generation uses.

A task example is asked exactly as the engine is asked: the user message
``source.message(example)`` goes through the model's chat template when it has
one (what ``LLM.chat`` and ``/v1/chat/completions`` send), else it is encoded
as plain text (what ``LLM.generate(str)`` and ``/v1/completions`` send); see
:func:`prompt_ids`. The answer is the label's tokens followed by the end-of-text
token. Training is supervised cross-entropy on those answer tokens only
(V-LoRA §4.2.1); the logits are computed at the answer positions only.

Evaluation is greedy decoding, computed in one teacher-forced forward pass: an
example counts as correct iff at every answer position the most likely token is
the label's next token and, after the label, an end-of-text token the engine
stops on. That is exactly "greedy generation returns the label", so the
engine's answers (:func:`engine_answers`) equal the evaluation's verdicts, up to
floating-point ties (evaluation runs in float32; serve with ``--dtype float32``
on a GPU for the same numbers). Closed-set task heads (``vlora_head.*``) are not
trained here: every task is answered through the language-model head.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from vlora.adapters.sources import Example, KnowledgeSource
from vlora.lora.adapter import LORA_TARGETS

WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class TrainConfig:
    model: str | None = None
    """Base model to train on (the one that will serve the adapters): local HF directory or .gguf file. Default: the embedded SmolLM2-135M-Instruct."""
    rank: int = 8
    """LoRA rank of every adapter."""
    alpha: float = 16.0
    """LoRA alpha (scaling = alpha / rank)."""
    targets: tuple[str, ...] = ()
    """Projections that get LoRA (repeatable). Default: all seven (q, k, v, o, gate, up, down)."""
    last_layers: int = 0
    """Put LoRA on the last N decoder layers only (backward stops there: faster). 0: every layer."""
    epochs: int = 3
    """Passes over a source's training split each time it is trained into an adapter."""
    lr: float = 2e-3
    """AdamW learning rate (constant; a fresh optimizer for each training run)."""
    batch_size: int = 16
    """Examples per optimizer step."""
    device: str = "auto"
    """Training device: auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    threads: int = 0
    """CPU threads for torch (process-wide; 1 is fastest on a CPU shared with other jobs). 0: leave torch's setting."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        for name in ("rank", "epochs", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"threads must be an integer >= 0, got {self.threads!r}")
        if not isinstance(self.last_layers, int) or self.last_layers < 0:
            raise ValueError(f"last_layers must be an integer >= 0, got {self.last_layers!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"lr and alpha must be finite and > 0, got lr={self.lr!r} alpha={self.alpha!r}")
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if bad:
            raise ValueError(f"targets {bad} cannot be served; choose among {list(LORA_TARGETS)}")


def prompt_ids(tokenizer, message: str) -> list[int]:
    """Token ids the engine gets when ``message`` is asked: chat template if the model has one, else plain."""
    from vlora.engine.llm import apply_chat_template

    if getattr(tokenizer, "chat_template", None):
        return apply_chat_template(tokenizer, [{"role": "user", "content": message}])
    return tokenizer.encode(message, add_special_tokens=False)


def engine_answers(llm, adapter: str | None, source: KnowledgeSource,
                   examples: Sequence[Example] | None = None) -> list[str]:
    """Greedy answers of a served adapter (``vlora.LLM``) to ``examples`` (default: the held-out split),
    asked as training asked them; an answer is correct iff it equals the label."""
    from vlora import SamplingParams

    tok = llm.tokenizer
    examples = source.heldout if examples is None else examples
    longest = max(len(tok.encode(label, add_special_tokens=False)) for label in source.labels)
    prompts = [prompt_ids(tok, source.message(e)) for e in examples]
    outs = llm.generate(prompts, adapter, SamplingParams(max_tokens=longest + 1, temperature=0.0))
    return [o.text for o in outs]


class LoraTrainer:
    """One PEFT model on the base weights; adapter states (LoRA tensors on the CPU) are swapped in and out."""

    def __init__(self, config: TrainConfig = TrainConfig(), progress: bool = True):
        try:
            import peft
        except ImportError:
            raise ImportError("training adapters needs PEFT: pip install 'vlora[adapters]'") from None
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from vlora.engine.engine import resolve_device
        from vlora.models.lmm import is_lmm_dir
        from vlora.models.loader import resolve_model_dir

        self.config, self.progress = config, progress
        if config.threads:
            torch.set_num_threads(config.threads)
        self.model_dir = resolve_model_dir(config.model)
        if is_lmm_dir(self.model_dir):
            raise ValueError(f"{self.model_dir} is a multimodal model; adapter generation trains text tasks on "
                             f"text-only models for now")
        if not any((self.model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            raise ValueError(f"model {self.model_dir} has no tokenizer: tasks are asked as text")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.device = resolve_device(config.device)
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        n = base.config.num_hidden_layers
        if config.last_layers > n:
            raise ValueError(f"last_layers={config.last_layers} but the model has {n} layers")
        self.layers = list(range(n - config.last_layers, n)) if config.last_layers else None
        self.targets = list(config.targets or LORA_TARGETS)
        lora = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, target_modules=self.targets,
                               layers_to_transform=self.layers, lora_dropout=0.0, bias="none")
        self.model = peft.get_peft_model(base, lora).to(self.device).eval()
        decoder = base.get_decoder()
        if config.last_layers and not (hasattr(decoder, "layers") and hasattr(decoder, "norm")):
            raise ValueError(f"last_layers needs a decoder with .layers and .norm; {type(decoder).__name__} has not")
        eos = base.config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.insert(0, self.tokenizer.eos_token_id)
        if not eos:
            raise ValueError(f"model {self.model_dir} defines no end-of-text token to end answers with")
        self.eos, self.stop_ids = eos[0], set(eos)       # the engine stops on any of them
        self._encoded: dict[tuple[str, str, str], tuple[list[int], list[int]]] = {}
        self.first = n - config.last_layers if config.last_layers else 0     # first layer with LoRA
        self._prefix: dict[tuple[int, ...], torch.Tensor] = {}              # tokens -> [len, hidden] into it

    # ------------------------------------------------------------------ states

    def _get(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.model).items()}

    def _set(self, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state)

    def init(self, seed: int) -> dict[str, torch.Tensor]:
        """PEFT's default initialisation (A Kaiming-uniform, B zero: the adapter starts as the base model)."""
        g = torch.Generator().manual_seed(seed)
        state = {}
        for k, v in self._get().items():
            if ".lora_A." in k:
                bound = 1 / math.sqrt(v.shape[1])          # kaiming_uniform_(a=sqrt(5)) as nn.Linear and PEFT
                state[k] = (torch.rand(v.shape, generator=g) * 2 - 1) * bound
            else:
                state[k] = torch.zeros_like(v)
        return state

    def save(self, state, path: Path) -> None:
        self._set(state)
        self.model.save_pretrained(str(path))

    def load(self, path: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        state = load_file(str(Path(path) / WEIGHTS))
        want = self._get()
        if set(state) != set(want) or any(state[k].shape != want[k].shape for k in want):
            raise ValueError(f"{path}: adapter was trained with other settings (rank, targets or layers)")
        return state

    def size_bytes(self, state) -> int:
        return sum(t.numel() * t.element_size() for t in state.values())

    def settings(self) -> dict:
        c = self.config
        return {"model": self.model_dir.name, "model_path": str(self.model_dir), "rank": c.rank, "alpha": c.alpha, "targets": self.targets,
                "layers": self.layers or "all", "epochs": c.epochs, "lr": c.lr, "batch_size": c.batch_size,
                "device": str(self.device), "answer": "greedy label text (language-model head), float32"}

    # ------------------------------------------------------------------ training

    def fit(self, state, new: Sequence[KnowledgeSource], replay: Sequence[KnowledgeSource], seed: int,
            desc: str) -> dict[str, torch.Tensor]:
        """``epochs`` passes over the new sources' training examples; each pass also replays as many examples
        (at most) drawn from the replay sources' training splits, so the adapter keeps those tasks."""
        from tqdm.auto import tqdm

        self._set(state)
        rng = random.Random(seed)
        fresh = [self._encode(s, e) for s in new for e in s.train]
        old = [self._encode(s, e) for s in replay for e in s.train]
        per_epoch = len(fresh) + min(len(old), len(fresh))
        bs = self.config.batch_size
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=0.0)
        self.model.train()
        with torch.random.fork_rng(devices=[]), tqdm(total=self.config.epochs * math.ceil(per_epoch / bs), desc=desc,
                                                     unit="step", disable=not self.progress, leave=False) as bar:
            torch.manual_seed(seed)
            for _ in range(self.config.epochs):
                items = fresh + rng.sample(old, min(len(old), len(fresh)))
                rng.shuffle(items)
                for i in range(0, len(items), bs):
                    logits, targets, _ = self._forward(items[i:i + bs])
                    loss = torch.nn.functional.cross_entropy(logits, targets)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    bar.update()
                    bar.set_postfix(loss=f"{loss.item():.3f}")
        self.model.eval()
        return self._get()

    def evaluate(self, state, source: KnowledgeSource) -> list[bool]:
        """Per held-out example: would greedy decoding answer exactly the label (then stop)?"""
        self._set(state)
        items = [self._encode(source, e) for e in source.heldout]
        order = sorted(range(len(items)), key=lambda i: len(items[i][0]) + len(items[i][1]))
        hits = [False] * len(items)
        bs = 2 * self.config.batch_size
        with torch.no_grad():
            for i in range(0, len(order), bs):
                idx = order[i:i + bs]
                logits, targets, lengths = self._forward([items[k] for k in idx])
                pred = logits.argmax(-1).tolist()
                tgt = targets.tolist()
                at = 0
                for k, n in zip(idx, lengths):
                    p, t = pred[at:at + n], tgt[at:at + n]
                    hits[k] = p[:-1] == t[:-1] and p[-1] in self.stop_ids
                    at += n
        return hits

    def _encode(self, source: KnowledgeSource, e: Example) -> tuple[list[int], list[int]]:
        key = (source.task, e.text, e.label)
        if key not in self._encoded:
            answer = self.tokenizer.encode(e.label, add_special_tokens=False) + [self.eos]
            self._encoded[key] = (prompt_ids(self.tokenizer, source.message(e)), answer)
        return self._encoded[key]

    def _forward(self, items: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Logits at the answer positions only: ([sum answer lengths, vocab], targets, answer lengths)."""
        seqs = [p + a[:-1] for p, a in items]
        ids, mask = self._pad(seqs)
        width = ids.shape[1]
        rows, cols, targets = [], [], []
        for i, (p, a) in enumerate(items):
            rows += [i] * len(a)
            cols += range(len(p) - 1, len(p) - 1 + len(a))
            targets += a
        base = self.model.get_base_model()
        decoder = base.get_decoder()
        if self.first:       # the frozen layers' output is cached: run the LoRA layers only
            h0 = torch.zeros((len(seqs), width, base.config.hidden_size), device=self.device)
            for i, x in enumerate(self._inputs_of_first_lora_layer(seqs)):
                h0[i, :len(x)] = x
            with _only_layers(decoder, decoder.layers[self.first:]):
                hidden = decoder(inputs_embeds=h0, attention_mask=mask.to(self.device)).last_hidden_state
        else:
            hidden = decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
        logits = base.get_output_embeddings()(hidden[torch.tensor(rows), torch.tensor(cols)])
        return logits.float(), torch.tensor(targets, device=self.device), [len(a) for _, a in items]

    def _pad(self, seqs) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and attention mask [B, T]: every token keeps position 0..len-1."""
        ids = torch.full((len(seqs), max(map(len, seqs))), self.eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        return ids, mask

    def _inputs_of_first_lora_layer(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        """Hidden states entering layer ``self.first`` (no LoRA below it), computed once per token sequence."""
        missing = list({tuple(s) for s in seqs if tuple(s) not in self._prefix})
        if missing:
            decoder = self.model.get_base_model().get_decoder()
            ids, mask = self._pad(missing)
            with torch.no_grad(), _only_layers(decoder, decoder.layers[:self.first], norm=False):
                h = decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
            for i, s in enumerate(missing):
                self._prefix[s] = h[i, :len(s)].float().clone()
        return [self._prefix[tuple(s)] for s in seqs]


@contextmanager
def _only_layers(decoder, layers, norm: bool = True):
    """Run ``decoder`` (a transformers decoder stack) with only ``layers``, and without its final norm if
    ``norm`` is False; its inputs_embeds then stand for the hidden states entering the first of them."""
    saved = decoder.layers, decoder.norm
    decoder.layers = torch.nn.ModuleList(layers)
    if not norm:
        decoder.norm = torch.nn.Identity()
    try:
        yield
    finally:
        decoder.layers, decoder.norm = saved
