"""Vision task heads (V-LoRA §4.2.2): a linear head, shipped inside an adapter, that answers a closed-set task
in one forward pass instead of decoding the answer token by token.

Files beside the adapter's PEFT weights (the format the adapter generator writes):

    vlora_head.safetensors   weight [num_labels, hidden], bias [num_labels]
    vlora_head.json          {"labels": ["walking", "running", ...], "token": "last"}

Semantics: ``scores = weight @ h + bias`` with ``h`` the decoder's final normed hidden state of the chosen
token (``"last"``: the prompt's last token); the answer is ``labels[argmax(scores)]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vlora.lora.adapter import AdapterError

HEAD_WEIGHTS, HEAD_CONFIG = "vlora_head.safetensors", "vlora_head.json"
TOKENS = ("last",)


class TaskHeadError(AdapterError):
    """An adapter's task head files are malformed or do not fit the model."""


@dataclass(frozen=True)
class TaskHead:
    labels: tuple[str, ...]
    weight: torch.Tensor        # [num_labels, hidden]
    bias: torch.Tensor          # [num_labels]
    token: str                  # which token's hidden state feeds the head


@dataclass(frozen=True)
class TaskResult:
    label: str                  # labels[argmax(scores)]
    scores: dict[str, float]    # label -> the head's raw score (logit)


def load_task_head(path: str | Path, hidden_size: int, dtype: torch.dtype,
                   device: torch.device) -> TaskHead | None:
    """The head in adapter directory ``path``, None if it has none; TaskHeadError if its files are bad."""
    path = Path(path)
    has_w, has_c = (path / HEAD_WEIGHTS).is_file(), (path / HEAD_CONFIG).is_file()
    if not has_w and not has_c:
        return None
    if has_w != has_c:
        raise TaskHeadError(f"{path}: a task head needs both {HEAD_WEIGHTS} and {HEAD_CONFIG}")
    try:
        cfg = json.loads((path / HEAD_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TaskHeadError(f"{path / HEAD_CONFIG}: not valid JSON ({e})") from None
    labels = cfg.get("labels") if isinstance(cfg, dict) else None
    if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
        raise TaskHeadError(f"{HEAD_CONFIG}: 'labels' must be a non-empty list of strings")
    if len(set(labels)) != len(labels):
        raise TaskHeadError(f"{HEAD_CONFIG}: 'labels' holds duplicates")
    token = cfg.get("token", "last")
    if token not in TOKENS:
        raise TaskHeadError(f"{HEAD_CONFIG}: token {token!r} is not supported (supported: {list(TOKENS)})")
    from safetensors.torch import load_file

    try:
        tensors = load_file(path / HEAD_WEIGHTS, device="cpu")
    except Exception as e:
        raise TaskHeadError(f"{path / HEAD_WEIGHTS}: cannot be read as safetensors ({e})") from None
    expected = {"weight": (len(labels), hidden_size), "bias": (len(labels),)}
    if set(tensors) != set(expected):
        raise TaskHeadError(f"{HEAD_WEIGHTS}: expected tensors ['bias', 'weight'], got {sorted(tensors)}")
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise TaskHeadError(f"{HEAD_WEIGHTS}: {name} has shape {list(t.shape)}, expected {list(shape)} "
                                f"({len(labels)} labels, hidden size {hidden_size})")
        if not t.is_floating_point() or not torch.isfinite(t).all():
            raise TaskHeadError(f"{HEAD_WEIGHTS}: {name} must be finite floats")
    return TaskHead(tuple(labels), tensors["weight"].to(device, dtype), tensors["bias"].to(device, dtype), token)


def apply_heads(hidden: torch.Tensor, heads: list[TaskHead]) -> list[TaskResult]:
    """hidden [n, hidden] (row i = the chosen token of request i) -> one answer per row, scored in float32."""
    out = []
    for h, head in zip(hidden, heads):
        scores = torch.addmv(head.bias.float(), head.weight.float(), h.float())
        out.append(TaskResult(head.labels[int(scores.argmax())], dict(zip(head.labels, scores.tolist()))))
    return out
