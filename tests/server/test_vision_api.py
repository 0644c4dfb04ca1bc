"""The HTTP server with an LMM (the demo SmolLM2 + random ViT): image parts in chat messages, task heads."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch

from tests.server.conftest import API_KEY, LiveServer
from vlora import LLM, SamplingParams
from vlora.config import ServerConfig
from vlora.lora.random_adapter import write_random_adapter

pytestmark = pytest.mark.slow
LABELS = ["cat", "dog", "car"]


def png(color, size=(64, 48)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_lmm_chat_with_images_and_task_head_over_http(tmp_path):
    from PIL import Image
    from safetensors.torch import save_file

    llm = LLM("demo:smollm2-llava", kv_cache_memory_gb=0.25)
    eng = llm.engine
    head_dir = write_random_adapter(tmp_path / "cls", eng.adapters.shape, rank=4, seed=5)
    g = torch.Generator().manual_seed(6)
    save_file({"weight": torch.randn(3, eng.model.cfg.hidden_size, generator=g), "bias": torch.zeros(3)},
              str(head_dir / "vlora_head.safetensors"))
    (head_dir / "vlora_head.json").write_text(json.dumps({"labels": LABELS, "token": "last"}))
    llm.register_adapter("cls", head_dir)

    red, blue = png((220, 20, 20)), png((20, 20, 220))
    messages = [{"role": "user", "content": "<image>\nWhat colour is this?"}]
    ids = llm.apply_chat_template(messages)
    images = [Image.open(io.BytesIO(red))]
    expected = llm.generate(ids, sampling=SamplingParams(max_tokens=8), images=images)[0]
    task = llm.classify(ids, "cls", images=[images])[0]
    assert task.label in LABELS and set(task.scores) == set(LABELS)

    server = LiveServer(eng, ServerConfig(api_key=API_KEY))
    try:
        with server.http() as h:
            def chat(image: bytes, **kw):
                content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                               + base64.b64encode(image).decode()}},
                           {"type": "text", "text": "What colour is this?"}]
                return h.post("/v1/chat/completions", json={"model": eng.model_name, "temperature": 0,
                              "messages": [{"role": "user", "content": content}], **kw})

            r = chat(red, max_tokens=8)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["message"]["content"] == expected.text
            assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)

            r = chat(red, model="cls", task_head=True)
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["task"]
            assert answer["label"] == task.label
            assert answer["scores"] == pytest.approx(task.scores, rel=1e-5)

            r = chat(blue, task_head=True)                 # the base model has no head
            assert r.status_code == 400 and "has none" in r.json()["error"]["message"]
            r = chat(red, model="cls", task_head=True, stream=True)
            assert r.status_code == 400 and r.json()["error"]["param"] == "task_head"
            r = chat(b"\x89PNGbroken")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image"
    finally:
        server.stop()
