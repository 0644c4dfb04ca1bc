"""A small thread pool for the server's heavy work: parsing bodies, tokenizing, chat templates, images.

The event loop hands such work here and awaits it, so one large request never holds up the
others or ``/health``. Concurrency is bounded by the pool's size (work beyond it queues).
Each worker thread uses its own tokenizer copy: a fast tokenizer is not safe to share
between threads, and the engine thread keeps the original for detokenizing.
"""

from __future__ import annotations

import asyncio
import copy
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from vlora.llm import apply_chat_template

WORKERS = max(1, min(4, os.cpu_count() or 1))


class HeavyWork:
    def __init__(self, tokenizer, workers: int = WORKERS):
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="vlora-http")
        # copies made now, before the engine thread starts using the original
        self._spare: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers if tokenizer is not None else 0):
            self._spare.put(copy.deepcopy(tokenizer))
        self._local = threading.local()
        self._has_tokenizer = tokenizer is not None
        self.max_token_chars = _max_token_chars(tokenizer)

    async def run(self, fn, *args):
        """``fn(*args)`` in a worker thread; its exception, if any, is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def tokenizer(self):
        """This worker thread's tokenizer copy (call it in a worker); None for a model without one."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self._has_tokenizer:
            tok = self._local.tokenizer = self._spare.get_nowait()
        return tok

    def encode(self, text: str) -> list[int]:
        return self.tokenizer().encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """Token ids to text as the engine writes an answer (special tokens left out); "" without a tokenizer."""
        tok = self.tokenizer()
        return "" if tok is None else tok.decode(ids, skip_special_tokens=True)

    def chat_template(self, conversation: list[dict], template: str | None = None, template_kwargs: dict | None = None,
                      add_generation_prompt: bool = True, continue_final_message: bool = False,
                      tools: list[dict] | None = None) -> list[int]:
        """The conversation rendered and tokenized (``template``: in place of the model's; ``tools``: shown to
        the model by the template)."""
        return apply_chat_template(self.tokenizer(), conversation, chat_template=template,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, template_kwargs=template_kwargs,
                                   tools=tools)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _max_token_chars(tokenizer) -> int | None:
    """Most characters of text one token can stand for (its vocabulary entry's length: for byte-level BPE
    one character per byte, for SentencePiece one per character), or None if the vocabulary is unknown."""
    try:
        return max(map(len, tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError, NotImplementedError):   # no tokenizer or no readable vocabulary
        return None
