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
on a GPU for the same numbers).

Image tasks (LLaVA-style LMMs): the image goes through the engine's own vision
tower and projector (``models/vision.py``, frozen, float32, same preprocessing)
and its rows replace the expanded placeholder tokens; LoRA is on the language
model only, as the engine serves it (projector or tower LoRA is refused by
``lora/adapter.py``).

Task heads (V-LoRA §4.2.2): sources with ``head=True`` are answered by a linear
head over the final normed hidden state of the prompt's last token, trained
jointly with the LoRA (cross-entropy over the head's labels, added to the
answer-token loss). An adapter has ONE head whose labels are the sorted union of
the labels of its head tasks; the prompt tells the tasks apart, the head is
trained over the whole union and answers with the argmax over it, exactly as
the engine's ``LLM.classify`` does (an answer outside the asked task's labels
counts as wrong). It is saved as ``vlora_head.safetensors`` + ``vlora_head.json``
(``lora/task_head.py``). Fusing a task with new labels adds zero rows for them.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from vlora.adapters.sources import Example, KnowledgeSource, meets
from vlora.lora.adapter import LORA_TARGETS
from vlora.lora.task_head import HEAD_CONFIG, HEAD_WEIGHTS

WEIGHTS = "adapter_model.safetensors"
MIN_TRAIN_FOR_VALIDATION = 10       # fewer training examples than this: no validation split, the whole budget
MIN_LOSS_GAIN, MIN_LOSS_DROP = 0.01, 1e-3   # a validation loss lower by less (relative, absolute) is no progress
MIN_SHARED = 4                      # fewer leading positions shared by a whole batch are not worth a second call


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
    last_layers: int = 8
    """Put LoRA on the last N decoder layers only: the layers below run once per example and are cached, so a
    step costs only the top N layers. 0: every layer."""
    epochs: int = 12
    """Most passes over the training examples in one training run (its step budget, scaled to the data the run
    trains on; at least --min-steps); early stopping usually ends the run sooner."""
    min_steps: int = 30
    """Fewest optimizer steps of every run, early stopping or not (the budget is at least this): a small source
    trained alone gets enough steps, and a hard task whose validation accuracy is still flat is not given up."""
    patience: int = 3
    """Early stopping: end a run after this many validation checks (one per pass) without a better mean validation
    accuracy; while a task is below its requirement, the first check after each better accuracy that matches it
    with a validation loss lower by 1% counts too (a perfect accuracy ends the run at once); the last weights with
    the best accuracy are kept. 0: train the whole budget and keep the final weights."""
    val_fraction: float = 0.2
    """Fraction of each source's training examples set apart as its validation split (seeded, per label; never
    the held-out split), which decides when to stop. 0 (or --patience 0): no validation split, the whole budget."""
    lr: float = 3e-3
    """AdamW learning rate (constant; a fresh optimizer for each training run)."""
    head_lr: float = 0.0
    """AdamW learning rate of the task heads (in standardised coordinates). 0: the same as --lr."""
    batch_size: int = 16
    """Examples per optimizer step."""
    device: str = "auto"
    """Training device: auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    threads: int = 0
    """CPU threads for torch (process-wide). 0: training on the CPU takes the cores idle when it starts (the core
    count less the 1-minute load average, at least 1), since a thread competing with another job for its core
    slows every step; on a GPU, torch's setting."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        for name in ("rank", "epochs", "batch_size", "min_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"threads must be an integer >= 0, got {self.threads!r}")
        if not isinstance(self.last_layers, int) or self.last_layers < 0:
            raise ValueError(f"last_layers must be an integer >= 0, got {self.last_layers!r}")
        if not isinstance(self.patience, int) or isinstance(self.patience, bool) or self.patience < 0:
            raise ValueError(f"patience must be an integer >= 0, got {self.patience!r}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if not (self.head_lr >= 0 and math.isfinite(self.head_lr)):
            raise ValueError(f"head_lr must be finite and >= 0, got {self.head_lr!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)) or not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"lr and alpha must be finite and > 0, got lr={self.lr!r} alpha={self.alpha!r}")
        bad = sorted(set(self.targets) - set(LORA_TARGETS))
        if bad:
            raise ValueError(f"targets {bad} cannot be served; choose among {list(LORA_TARGETS)}")


@dataclass
class EarlyStop:
    """When a training run stops making progress on its validation split (checked after every pass). Progress is a
    better mean accuracy over the tasks. The loss only breaks a tie, once: while some task is still below its
    requirement, the first check after a better accuracy that matches it with a clearly lower validation loss
    counts as progress too (a hard task's accuracy moves in jumps, its loss shows the run is on its way). A task
    that never meets its requirement would otherwise keep a run going to its budget on a loss that keeps falling
    while no answer changes. A perfect accuracy cannot get better and ends the run."""

    requirements: list[float]       # per task checked
    patience: int                   # checks without progress that end the run
    best_score: float = -1.0        # best mean validation accuracy so far
    best_loss: float = math.inf
    waited: int = 0                 # checks since the last progress
    tied: bool = False              # a lower loss has broken a tie since the last better accuracy

    def check(self, accuracies: list[float], loss: float) -> bool:
        """Record one check (each task's validation accuracy, the mean loss); True when these weights are the
        ones to keep (the best mean accuracy so far; ties keep the later, longer-trained weights)."""
        score = sum(accuracies) / len(accuracies)
        learnt = all(meets(a, r) for a, r in zip(accuracies, self.requirements))
        better = score > self.best_score + 1e-9
        lower = loss < self.best_loss - max(MIN_LOSS_GAIN * self.best_loss, MIN_LOSS_DROP)
        tie_broken = not better and not learnt and not self.tied and score >= self.best_score - 1e-9 and lower
        self.tied = tie_broken or (self.tied and not better)
        self.waited = 0 if better or tie_broken else self.waited + 1
        if score >= 1.0:        # every validation example right: nothing left to gain on this split
            self.waited = max(self.waited, self.patience)
        self.best_loss = min(self.best_loss, loss)
        keep = score >= self.best_score - 1e-9
        self.best_score = max(self.best_score, score)
        return keep


@dataclass
class Head:
    """A task head being trained: ``scores = weight @ h + bias`` over ``labels`` (the format of task_head.py)."""

    labels: tuple[str, ...]
    weight: torch.Tensor            # [num_labels, hidden]
    bias: torch.Tensor              # [num_labels]


@dataclass
class AdapterState:
    """What the fusion loop passes around: the LoRA tensors (PEFT state dict, on the CPU) and the task head."""

    lora: dict[str, torch.Tensor]
    head: Head | None = None


class _TrainableHead:
    """A head trained in standardised coordinates, ``scores = w' ((h - mu) / sigma) + b'``: the final hidden
    state of a decoder varies across examples by a tiny fraction of its size (a few dimensions are huge and
    nearly constant), so plain Adam steps on ``weight`` would barely move the scores. The same linear map,
    ``weight = w' / sigma`` and ``bias = b' - weight @ mu``, is what :meth:`export` saves."""

    def __init__(self, head: Head, mu: torch.Tensor, sigma: torch.Tensor):
        self.labels, self.mu, self.sigma = head.labels, mu, sigma
        self.w = (head.weight * sigma).requires_grad_(True)
        self.b = (head.bias + head.weight @ mu).requires_grad_(True)

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """h [n, hidden] -> [n, num_labels]."""
        return ((h - self.mu) / self.sigma) @ self.w.T + self.b

    def export(self) -> Head:
        w = (self.w.detach() / self.sigma).cpu()
        return Head(self.labels, w, (self.b.detach().cpu() - w @ self.mu.cpu()))


@dataclass(frozen=True)
class _Item:
    """One example as the model sees it: the prompt ids (image placeholder expanded), the answer ids (label
    then end of text; empty for head tasks), the image path and the label."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    image: str | None
    label: str
    head: bool = False

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens fed to the model: the prompt, then the answer but its last token (teacher forcing)."""
        return self.prompt + self.answer[:-1]


def idle_cores(cores: int | None = None, load: float | None = None) -> int:
    """CPU cores not busy now: the usable core count less the 1-minute load average (rounded), at least 1."""
    import os

    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    load = load if load is not None else os.getloadavg()[0]
    return max(1, cores - round(load))


def prompt_ids(tokenizer, message: str) -> list[int]:
    """Token ids the engine gets when ``message`` is asked: chat template if the model has one, else plain."""
    from vlora.llm import apply_chat_template

    if getattr(tokenizer, "chat_template", None):
        return apply_chat_template(tokenizer, [{"role": "user", "content": message}])
    return tokenizer.encode(message, add_special_tokens=False)


def engine_answers(llm, adapter: str | None, source: KnowledgeSource,
                   examples: Sequence[Example] | None = None) -> list[str]:
    """Answers of a served adapter (``vlora.LLM``) to ``examples`` (default: the held-out split), asked as
    training asked them: greedy text, or ``LLM.classify`` (the task head) for head tasks; an answer is
    correct iff it equals the label."""
    from vlora import SamplingParams

    tok = llm.tokenizer
    examples = source.heldout if examples is None else examples
    vision = llm.engine.vision
    image_token = tok.convert_ids_to_tokens(vision.image_token_id) if vision is not None else "<image>"
    prompts = [prompt_ids(tok, source.message(e, image_token)) for e in examples]
    images = [[e.image] if e.image is not None else None for e in examples]
    if source.head:
        return [r.label for r in llm.classify(prompts, adapter, images)]
    longest = max(len(tok.encode(label, add_special_tokens=False)) for label in source.labels)
    outs = llm.generate(prompts, adapter, SamplingParams(max_tokens=longest + 1, temperature=0.0), images)
    return [o.text for o in outs]


class LoraTrainer:
    """One PEFT model on the base weights; adapter states (LoRA tensors and task heads on the CPU) are swapped
    in and out. On an LMM the frozen vision tower and projector are vlora's own (as served)."""

    def __init__(self, config: TrainConfig = TrainConfig(), progress: bool = True):
        try:
            import peft
        except ImportError:
            raise ImportError("training adapters needs PEFT: pip install 'vlora[adapters]'") from None
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from vlora.engine.engine import resolve_device
        from vlora.models.lmm import is_lmm_dir
        from vlora.models.loader import resolve_model_dir

        self.config, self.progress = config, progress
        self.device = resolve_device(config.device)
        threads = config.threads or (idle_cores() if self.device.type == "cpu" else 0)
        if threads:
            torch.set_num_threads(threads)
        self.model_dir = resolve_model_dir(config.model)
        if not any((self.model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            raise ValueError(f"model {self.model_dir} has no tokenizer: tasks are asked as text")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.lmm = is_lmm_dir(self.model_dir)
        if self.lmm:
            from transformers import LlavaForConditionalGeneration

            hf_config = AutoConfig.from_pretrained(self.model_dir)
            if hf_config.model_type != "llava":
                raise ValueError(f"{self.model_dir}: adapter generation trains on LLaVA-style LMMs only, not "
                                 f"{hf_config.model_type!r}")
            base = LlavaForConditionalGeneration.from_pretrained(self.model_dir, dtype=torch.float32)
            self.text_config, decoder = hf_config.text_config, base.model.language_model
            self._init_vision(hf_config)
        else:
            base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            self.text_config, decoder = base.config, base.get_decoder()
            self.vision = None
        n = self.text_config.num_hidden_layers
        last = config.last_layers if config.last_layers < n else 0       # a smaller model: every layer
        self.layers = list(range(n - last, n)) if last else None
        self.targets = list(config.targets or LORA_TARGETS)
        if self.lmm:        # the language model only: the vision tower has q/k/v_proj too
            layers = "|".join(map(str, self.layers or range(n)))
            where = dict(target_modules=rf".*language_model\.(?:model\.)?layers\.({layers})\.(?:self_attn|mlp)\."
                                        rf"({'|'.join(self.targets)})")
        else:
            where = dict(target_modules=self.targets, layers_to_transform=self.layers)
        lora = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=0.0, bias="none", **where)
        self.model = peft.get_peft_model(base, lora).to(self.device).eval()
        if not (hasattr(decoder, "layers") and hasattr(decoder, "norm") and hasattr(decoder, "embed_tokens")):
            raise ValueError(f"training needs a decoder with .embed_tokens, .layers and .norm; "
                             f"{type(decoder).__name__} has not")
        self.decoder, self.lm_head = decoder, base.get_output_embeddings()
        self.hidden_size = self.text_config.hidden_size
        eos = self.text_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.insert(0, self.tokenizer.eos_token_id)
        if not eos:
            raise ValueError(f"model {self.model_dir} defines no end-of-text token to end answers with")
        self.eos, self.stop_ids = eos[0], set(eos)       # the engine stops on any of them
        self._encoded: dict[tuple, _Item] = {}
        self.first = n - last if last else 0                # first layer with LoRA
        self._val: dict[str, tuple[tuple[Example, ...], tuple[Example, ...]]] = {}   # task -> (train, validation)
        self._prefix: dict[tuple, torch.Tensor] = {}      # (tokens, image) -> [len, hidden] entering layer first
        self._image_rows: dict[str, torch.Tensor] = {}    # image path -> [tokens_per_image, hidden]
        import inspect

        params = inspect.signature(decoder.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"    # renamed in transformers 5.x
        self.share_prefix = all(hasattr(getattr(layer, "self_attn", None), "layer_idx") for layer in decoder.layers)

    def _init_vision(self, hf_config) -> None:
        from vlora.models.lmm import image_processor, load_vision_weights, vision_config
        from vlora.models.vision import VisionTower

        vcfg = vision_config(hf_config)
        with torch.device("meta"):
            tower = VisionTower(vcfg)
        tower = tower.to_empty(device=self.device)
        load_vision_weights(tower, self.model_dir)
        self.vision = tower.float().eval().requires_grad_(False)
        self.processor = image_processor(self.model_dir, vcfg)
        self.image_token_id = hf_config.image_token_id
        self.image_token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)

    # ------------------------------------------------------------------ states

    def _get(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.model).items()}

    def _set(self, lora: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, lora)

    def init(self, seed: int) -> AdapterState:
        """PEFT's default initialisation (A Kaiming-uniform, B zero: the adapter starts as the base model);
        no head (``fit`` adds one, zero, when it trains a head task)."""
        g = torch.Generator().manual_seed(seed)
        lora = {}
        for k, v in self._get().items():
            if ".lora_A." in k:
                bound = 1 / math.sqrt(v.shape[1])          # kaiming_uniform_(a=sqrt(5)) as nn.Linear and PEFT
                lora[k] = (torch.rand(v.shape, generator=g) * 2 - 1) * bound
            else:
                lora[k] = torch.zeros_like(v)
        return AdapterState(lora)

    def save(self, state: AdapterState, path: Path) -> None:
        from safetensors.torch import save_file

        self._set(state.lora)
        self.model.save_pretrained(str(path))
        if state.head is not None:
            h = state.head
            save_file({"weight": h.weight.contiguous(), "bias": h.bias.contiguous()}, str(Path(path) / HEAD_WEIGHTS))
            (Path(path) / HEAD_CONFIG).write_text(json.dumps({"labels": list(h.labels), "token": "last"}) + "\n",
                                                  encoding="utf-8")

    def load(self, path: Path) -> AdapterState:
        from safetensors.torch import load_file

        from vlora.lora.task_head import load_task_head

        lora = load_file(str(Path(path) / WEIGHTS))
        want = self._get()
        if set(lora) != set(want) or any(lora[k].shape != want[k].shape for k in want):
            raise ValueError(f"{path}: adapter was trained with other settings (rank, targets or layers)")
        head = load_task_head(path, self.hidden_size, torch.float32, torch.device("cpu"))
        return AdapterState(lora, None if head is None else Head(head.labels, head.weight, head.bias))

    def size_bytes(self, state: AdapterState) -> int:
        head = () if state.head is None else (state.head.weight, state.head.bias)
        return sum(t.numel() * t.element_size() for t in (*state.lora.values(), *head))

    def settings(self) -> dict:
        c = self.config
        return {"model": self.model_dir.name, "model_path": str(self.model_dir), "rank": c.rank, "alpha": c.alpha, "targets": self.targets,
                "layers": self.layers or "all", "epochs": c.epochs, "min_steps": c.min_steps, "patience": c.patience,
                "val_fraction": c.val_fraction, "lr": c.lr, "head_lr": c.head_lr or c.lr,
                "batch_size": c.batch_size,
                "device": str(self.device),
                "answer": "greedy label text (language-model head), or the argmax of the adapter's task head over "
                          "the union of its head tasks' labels (head tasks); float32"}

    def check(self, sources: Sequence[KnowledgeSource]) -> None:
        """Encode every example now, so a source the model cannot take fails before any training."""
        for s in sources:
            for e in s.train + s.heldout:
                self._encode(s, e)

    # ------------------------------------------------------------------ training

    def fit(self, state: AdapterState, new: Sequence[KnowledgeSource], replay: Sequence[KnowledgeSource], seed: int,
            desc: str) -> AdapterState:
        """Train on the new sources' training examples; each pass also replays as many examples (at most) drawn
        from the replay sources' training examples, so the adapter keeps those tasks. The step budget is
        ``epochs`` passes, at least ``min_steps``; after each pass the validation split of every task (new and
        replayed) is checked, and the run stops after ``patience`` checks without progress (:class:`EarlyStop`),
        returning the last weights with the best mean validation accuracy. The head (if any source is a head
        task) covers the union of the head tasks' labels and trains jointly."""
        from tqdm.auto import tqdm

        self._set(state.lora)
        head = self._grow_head(state.head, [s for s in (*replay, *new) if s.head])
        rng = random.Random(seed)
        fresh = [self._encode(s, e) for s in new for e in self._splits(s)[0]]
        old = [self._encode(s, e) for s in replay for e in self._splits(s)[0]]
        checked = [(s, [self._encode(s, e) for e in self._splits(s)[1]]) for s in (*new, *replay)]
        checked = [(s, c) for s, c in checked if c] if self.config.patience else []
        checks = [c for _, c in checked]
        bs = self.config.batch_size
        steps_per_epoch, budget = self._budget(len(fresh), len(old))
        groups = [{"params": [p for p in self.model.parameters() if p.requires_grad]}]
        if head is not None:
            head = _TrainableHead(head, *self._head_stats([it for it in fresh + old if it.head]))
            groups.append({"params": [head.w, head.b], "lr": self.config.head_lr or self.config.lr})
        opt = torch.optim.AdamW(groups, lr=self.config.lr, weight_decay=0.0)
        best, step = None, 0
        stop = EarlyStop([src.requirement for src, _ in checked], self.config.patience)
        self.last_history: list[tuple[int, float, float]] = []     # (step, validation accuracy, loss) per check
        with torch.random.fork_rng(devices=[]), tqdm(total=budget, desc=desc, unit="step", disable=not self.progress,
                                                     leave=False) as bar:
            torch.manual_seed(seed)
            def done() -> bool:
                return step >= budget or bool(checks) and stop.waited >= stop.patience and \
                    step >= self.config.min_steps

            while not done():
                items = fresh + rng.sample(old, min(len(old), len(fresh)))
                rng.shuffle(items)
                for i in range(0, len(items), bs):
                    self.model.train()
                    loss = self._loss(items[i:i + bs], head)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1
                    bar.update()
                    bar.set_postfix(loss=f"{loss.item():.3f}", val_accuracy=f"{max(stop.best_score, 0):.2f}")
                    if checks and (step % steps_per_epoch == 0 or step == budget):     # after each pass
                        self.model.eval()
                        now = AdapterState(self._get(), None if head is None else head.export())
                        hits, losses = self._score([it for c in checks for it in c], now.head)
                        accuracies, loss = _task_means(checks, hits), sum(_task_means(checks, losses)) / len(checks)
                        self.last_history.append((step, sum(accuracies) / len(accuracies), loss))
                        if stop.check(accuracies, loss):
                            best = now
                    if done():
                        break
        self.model.eval()
        self.last_steps = step              # optimizer steps the run took (for tests and logs)
        if best is not None:
            return best
        return AdapterState(self._get(), None if head is None else head.export())

    def budget(self, new: Sequence[KnowledgeSource], replay: Sequence[KnowledgeSource]) -> int:
        """Most optimizer steps :meth:`fit` takes on ``new`` with ``replay``: ``epochs`` passes, at least
        ``min_steps``."""
        return self._budget(sum(len(self._splits(s)[0]) for s in new), sum(len(self._splits(s)[0]) for s in replay))[1]

    def _budget(self, fresh: int, old: int) -> tuple[int, int]:
        """(optimizer steps a pass, step budget) of a run on ``fresh`` new training examples replaying ``old``:
        a pass is the new examples and as many replayed (at most)."""
        steps_per_epoch = math.ceil((fresh + min(old, fresh)) / self.config.batch_size)
        return steps_per_epoch, max(self.config.min_steps, self.config.epochs * steps_per_epoch)

    def _splits(self, source: KnowledgeSource) -> tuple[tuple[Example, ...], tuple[Example, ...]]:
        """(examples to train on, validation examples) of the source's training split: ``val_fraction`` of
        each label set apart (seeded by the task), none when the split is too small to spare them."""
        if source.task not in self._val:
            from vlora.adapters.sources import split

            f = self.config.val_fraction if self.config.patience else 0     # no early stopping: train on all
            if f and len(source.train) >= MIN_TRAIN_FOR_VALIDATION:
                self._val[source.task] = split(source.train, f, f"validation:{source.task}")
            else:
                self._val[source.task] = (source.train, ())
        return self._val[source.task]

    def evaluate(self, state: AdapterState, source: KnowledgeSource) -> list[bool]:
        """Per held-out example: would the engine answer exactly the label? (greedy text then a stop token;
        for head tasks, the head's argmax over all its labels)."""
        self._set(state.lora)
        if source.head and (state.head is None or not set(source.labels) <= set(state.head.labels)):
            return [False] * len(source.heldout)            # never trained into this adapter: no head for it
        return self._hits([self._encode(source, e) for e in source.heldout], state.head)

    def _hits(self, items: list[_Item], head: Head | None) -> list[bool]:
        """Per item, under the LoRA weights set in the model: is the engine's answer exactly the label?"""
        return self._score(items, head)[0]

    def _score(self, items: list[_Item], head: Head | None) -> tuple[list[bool], list[float]]:
        """Per item, under the LoRA weights set in the model, from one forward pass: (is the engine's answer
        exactly the label, the item's mean cross-entropy over its answer tokens or its head label). Items are
        batched in token order, so a batch mostly holds one task and shares its prompt's leading tokens."""
        order = sorted(range(len(items)), key=lambda i: (items[i].tokens, items[i].image or ""))
        hits, losses = [False] * len(items), [math.inf] * len(items)
        bs = 2 * self.config.batch_size
        with torch.no_grad():
            for i in range(0, len(order), bs):
                idx = order[i:i + bs]
                batch = [items[k] for k in idx]
                hidden = self._hidden(batch)
                rows, cols, targets = _answer_positions(batch, skip_heads=True)
                if targets:
                    logits = self.lm_head(hidden[rows, cols]).float()
                    pred = logits.argmax(-1).tolist()
                    ce = torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=self.device),
                                                           reduction="none").tolist()
                at = 0
                for k, it in zip(idx, batch):
                    if it.head:
                        continue
                    n = len(it.answer)
                    p, t = pred[at:at + n], targets[at:at + n]
                    hits[k] = p[:-1] == t[:-1] and p[-1] in self.stop_ids
                    losses[k] = sum(ce[at:at + n]) / n
                    at += n
                heads = [j for j, it in enumerate(batch) if it.head]
                if heads and head is not None:
                    w, b = head.weight.to(self.device), head.bias.to(self.device)
                    last = self._last([batch[j] for j in heads], hidden[heads])
                    scores = torch.addmm(b.float(), last, w.float().T)
                    want = torch.tensor([head.labels.index(batch[j].label) if batch[j].label in head.labels else -100
                                         for j in heads], device=self.device)
                    ce = torch.nn.functional.cross_entropy(scores, want, reduction="none").tolist()
                    for j, p, c in zip(heads, scores.argmax(-1).tolist(), ce):
                        hits[idx[j]] = head.labels[p] == batch[j].label
                        losses[idx[j]] = c
        return hits, losses

    def _grow_head(self, head: Head | None, sources: Sequence[KnowledgeSource]) -> Head | None:
        """A trainable copy of ``head`` over the union of its labels and the head sources' labels (new rows
        zero); None if there is nothing for a head to answer."""
        labels = set(head.labels if head is not None else ()) | {lab for s in sources for lab in s.labels}
        if not labels:
            return None
        labels = tuple(sorted(labels))
        w = torch.zeros(len(labels), self.hidden_size)
        b = torch.zeros(len(labels))
        if head is not None:
            for i, lab in enumerate(head.labels):
                w[labels.index(lab)], b[labels.index(lab)] = head.weight[i], head.bias[i]
        return Head(labels, w.to(self.device), b.to(self.device))

    def _head_stats(self, items: list[_Item]) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and spread per dimension of the head's input (last prompt token) over up to 128 training
        examples, under the adapter's current weights."""
        items = items[:128]
        if not items:
            return torch.zeros(self.hidden_size, device=self.device), torch.ones(self.hidden_size, device=self.device)
        bs = 2 * self.config.batch_size
        with torch.no_grad():
            h = torch.cat([self._last(items[i:i + bs], self._hidden(items[i:i + bs])) for i in range(0, len(items), bs)])
        var = h.var(0, unbiased=False) if len(items) > 1 else torch.zeros_like(h[0])
        return h.mean(0), (var + var.mean() + 1e-12).sqrt()

    def _last(self, batch: list[_Item], hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``hidden`` at each item's last prompt token (what a task head reads): [B, hidden]."""
        return hidden[torch.arange(len(batch)), torch.tensor([len(it.prompt) - 1 for it in batch])].float()

    def _loss(self, batch: list[_Item], head: _TrainableHead | None) -> torch.Tensor:
        """Cross-entropy over every answer token of the text tasks and every head task's label, averaged."""
        hidden = self._hidden(batch)
        texts = [it for it in batch if not it.head]
        heads = [i for i, it in enumerate(batch) if it.head]
        total, count = hidden.new_zeros(()), 0
        if texts:
            rows, cols, targets = _answer_positions(batch, skip_heads=True)
            logits = self.lm_head(hidden[rows, cols]).float()
            total = total + torch.nn.functional.cross_entropy(logits, torch.tensor(targets, device=self.device),
                                                              reduction="sum")
            count += len(targets)
        if heads:
            scores = head.scores(self._last(batch, hidden)[heads])
            want = torch.tensor([head.labels.index(batch[i].label) for i in heads], device=self.device)
            total = total + torch.nn.functional.cross_entropy(scores, want, reduction="sum")
            count += len(heads)
        return total / count

    def _encode(self, source: KnowledgeSource, e: Example) -> _Item:
        key = (source.task, source.head, e.text, e.label, e.image)
        if key not in self._encoded:
            if e.image is not None and self.vision is None:
                raise ValueError(f"task {source.task!r} has image inputs but model {self.model_dir} reads text only; "
                                 f"train image tasks on an LMM (e.g. --model demo:smollm2-llava)")
            prompt = prompt_ids(self.tokenizer, source.message(e, getattr(self, "image_token", "<image>")))
            if e.image is not None:
                where = [i for i, t in enumerate(prompt) if t == self.image_token_id]
                if len(where) != 1:
                    raise ValueError(f"task {source.task!r}: its prompt encodes the image placeholder "
                                     f"{self.image_token!r} {len(where)} times, expected once")
                i = where[0]
                prompt = prompt[:i] + [self.image_token_id] * self.vision.cfg.tokens_per_image + prompt[i + 1:]
            answer = () if source.head else tuple(self.tokenizer.encode(e.label, add_special_tokens=False) + [self.eos])
            self._encoded[key] = _Item(tuple(prompt), answer, e.image, e.label, source.head)
        return self._encoded[key]

    def _hidden(self, batch: list[_Item]) -> torch.Tensor:
        """Final normed hidden states [B, T, hidden] of the batch's token sequences. The layers below the first
        LoRA layer run once per sequence (cached)."""
        return self._run(self._layer_inputs(batch), self.decoder.layers[self.first:])

    def _layer_inputs(self, batch: list[_Item]) -> list[torch.Tensor]:
        """Hidden states entering layer ``self.first`` (no LoRA below it), computed once per (tokens, image)."""
        keys = [(it.tokens, it.image) for it in batch]
        missing = list(dict.fromkeys(k for k in keys if k not in self._prefix))
        if missing:
            with torch.no_grad():
                embeds = [self._embed(tokens, image) for tokens, image in missing]
                if self.first:
                    h = self._run(embeds, self.decoder.layers[:self.first], norm=False)
                    embeds = [h[i, :len(e)] for i, e in enumerate(embeds)]
            for k, e in zip(missing, embeds):
                self._prefix[k] = e.float().clone()
        return [self._prefix[k] for k in keys]

    def _run(self, rows: list[torch.Tensor], layers, norm: bool = True) -> torch.Tensor:
        """``rows`` (each [len, hidden]: a sequence's states entering ``layers[0]``) right-padded into one batch
        (every token keeps position 0..len-1) through ``layers``, then the final norm if ``norm``: [B, T, hidden].

        The leading positions where every row holds the same states (the chat template's system prompt, a
        task's own prompt words) are computed once, as a batch of one, and the rest of each row attends to their
        keys and values through a cache: causal attention makes those positions' outputs the same in every row,
        so this is the same computation without repeating the shared part B times."""
        shared = _shared_length(rows) if self.share_prefix else 0
        with _only_layers(self.decoder, layers, norm):
            if shared < MIN_SHARED:
                x, mask = _pad(rows, self.hidden_size, self.device)
                return self.decoder(inputs_embeds=x, attention_mask=mask).last_hidden_state
            from transformers import DynamicCache

            cache = DynamicCache()
            arg = self._cache_arg
            top = self.decoder(inputs_embeds=rows[0][None, :shared], use_cache=True, **{arg: cache}).last_hidden_state
            cache.batch_repeat_interleave(len(rows))
            x, mask = _pad([r[shared:] for r in rows], self.hidden_size, self.device)
            mask = torch.cat([mask.new_ones((len(rows), shared)), mask], 1)
            rest = self.decoder(inputs_embeds=x, attention_mask=mask, use_cache=True, **{arg: cache}).last_hidden_state
        return torch.cat([top.expand(len(rows), -1, -1), rest], 1)

    def _embed(self, tokens: tuple[int, ...], image: str | None) -> torch.Tensor:
        """Input embeddings [len, hidden]: the token embeddings, the image's rows in place of its placeholders."""
        ids = torch.tensor(tokens, device=self.device)
        x = self.decoder.embed_tokens(ids).float()
        if image is not None:
            x[ids == self.image_token_id] = self._image(image)
        return x

    def _image(self, path: str) -> torch.Tensor:
        """The image's token embeddings [tokens_per_image, hidden] through the frozen tower and projector, with
        the engine's decoding (PIL, RGB) and preprocessing."""
        if path not in self._image_rows:
            from PIL import Image

            with Image.open(path) as im:
                im.load()
                rgb = im.convert("RGB")
            px = torch.as_tensor(self.processor(images=[rgb], return_tensors="pt")["pixel_values"][0])
            with torch.no_grad():
                self._image_rows[path] = self.vision(px[None].to(self.device, torch.float32))[0].float()
        return self._image_rows[path]


def _task_means(checks: list[list[_Item]], values: list) -> list[float]:
    """Each task's mean of ``values`` (given per item, the tasks' items one after another)."""
    out, at = [], 0
    for c in checks:
        out.append(sum(values[at:at + len(c)]) / len(c))
        at += len(c)
    return out


def _answer_positions(batch: list[_Item], skip_heads: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(rows, columns, target ids) of every answer token: the logits at column c predict the token at c + 1."""
    rows, cols, targets = [], [], []
    for i, it in enumerate(batch):
        if skip_heads and it.head:
            continue
        rows += [i] * len(it.answer)
        cols += range(len(it.prompt) - 1, len(it.prompt) - 1 + len(it.answer))
        targets += it.answer
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long), targets


def _shared_length(rows: list[torch.Tensor]) -> int:
    """How many leading positions hold the same states in every row, leaving each row at least one of its own."""
    if len(rows) < 2:
        return 0
    n = min(len(r) for r in rows) - 1
    if n < 1:
        return 0
    first = rows[0][:n]
    same = torch.stack([(r[:n] == first).all(-1) for r in rows[1:]]).all(0)
    return int(same.long().cumprod(0).sum())


def _pad(rows: list[torch.Tensor], hidden: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` right-padded into [B, T, hidden] with its attention mask [B, T]."""
    width = max(len(x) for x in rows)
    x = torch.zeros((len(rows), width, hidden), device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        x[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return x, mask


@contextmanager
def _only_layers(decoder, layers, norm: bool = True):
    """Run ``decoder`` (a transformers decoder stack) with only ``layers``, and without its final norm if
    ``norm`` is False; its inputs_embeds then stand for the hidden states entering the first of them. The
    layers' attention is renumbered from 0 meanwhile, so a key-value cache sized by its first layer fits."""
    saved = decoder.layers, decoder.norm
    attn = [a for a in (getattr(layer, "self_attn", None) for layer in layers) if hasattr(a, "layer_idx")]
    numbers = [a.layer_idx for a in attn]
    decoder.layers = torch.nn.ModuleList(layers)
    for i, a in enumerate(attn):
        a.layer_idx = i
    if not norm:
        decoder.norm = torch.nn.Identity()
    try:
        yield
    finally:
        decoder.layers, decoder.norm = saved
        for a, i in zip(attn, numbers):
            a.layer_idx = i
