"""The OpenAI-compatible HTTP server: ``build_app(engine, ServerConfig)`` and ``serve``.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /health, GET /metrics
(and /docs, /redoc, /openapi.json with ``enable_docs``).
The ``model`` field picks the adapter: an adapter's name, or the base model's.

Policies (docs/server.md has the full list):
- every field is checked at the edge, so what reaches the engine is valid: JSON bodies
  (application/json, UTF-8, bounded size and depth, no lone surrogates), numbers in range
  and finite, token ids inside the vocabulary, paths free of NUL; errors name the field
  and quote at most 100 characters of what was sent, never a server path;
- the event loop does no heavy work: parsing, tokenizing, chat templates, image
  decoding and logprobs (token text, whole answers' JSON) run in a small thread pool,
  so /health answers while a large request is read;
- fields nobody defines are ignored and named in a warning in the log, as vLLM does; fields OpenAI or vLLM
  define that vlora does not implement are accepted at their neutral value only, else a 400 naming the field
  (:data:`vlora.server.protocol.VLLM_FIELDS`); the adapter routes refuse unknown fields;
- ``max_tokens`` larger than the context allows (prompt + max_tokens > context) is a
  400, as OpenAI and vLLM do; without max_tokens a chat answer may fill the context
  and a completion stops at 16 tokens (OpenAI's defaults);
- a prompt longer than the context is a 400 ``context_length_exceeded`` naming the field (text that
  cannot fit whatever it holds is refused so before it is tokenized); 413 is for bodies over the byte limit;
- chat templates: the model's, or ``--chat-template``'s; ``chat_template_kwargs``, ``add_generation_prompt``,
  ``continue_final_message`` as vLLM takes them; a request's own ``chat_template`` only with
  ``--trust-request-chat-template``;
- /v1/completions takes a list of prompts: one ``choices`` list, choice i of prompt p at index p * n + i;
- a request header block over 64 KiB is refused with 431 (:mod:`vlora.server.transport`);
- a client that disconnects, streaming or not, has its requests aborted.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from huggingface_hub import constants as hub_constants
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vlora.config import ConfigError, ServerConfig
from vlora.engine.async_engine import AsyncEngine
from vlora.engine.client import (AdapterExists, AdapterNotFound, EngineClient, EngineFailed, Job, QueueFull,
                                 RequestFailed, RequestGroup, ShuttingDown)
from vlora.engine.engine import Engine, RequestError
from vlora.engine.sequence import RequestOutput
from vlora.lora.adapter import AdapterError
from vlora.lora.loader import LOADER
from vlora.models.hub import HubError, is_hub_id, snapshot_dir
from vlora.sampling_params import GuidedSpec, SamplingError, SamplingParams
from vlora.server import protocol as P
from vlora.server import tools as T
from vlora.server.body import QUOTE_CHARS, BodyError, parse_json, quote
from vlora.server.images import ImageError, ImageLimits, load_image
from vlora.server.logprobs import TokenTexts, generated, prompt_items
from vlora.server.metrics import ServerMetrics
from vlora.server.on_demand import AdaptersBusy, OnDemandAdapters, RecentMisses
from vlora.server.templates import describe as describe_template_error
from vlora.server.templates import compile_template, load_chat_template, reserved_kwarg
from vlora.server.tool_calls import Parser, ToolStream, new_call_id, parse_answer, parser_for
from vlora.server.transport import uvicorn_config
from vlora.server.workers import HeavyWork

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
MAX_JSON_DEPTH = 32         # deepest nesting a body may have (the request schemas need 5)
MAX_MESSAGE_CHARS = 2000    # an error message longer than this is cut (user values in it are quoted shorter still)
MAX_IGNORED_SHOWN = 20      # most ignored field names one log line shows


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _raise_if_rejected(outs) -> None:
    """A request early-aborted for its latency target is answered 503 with the engine's reason."""
    for o in outs:
        if o.finish_reason == "rejected":
            raise APIError(503, o.error or "rejected: cannot meet its latency target", code="slo_rejected")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    if param is not None and len(param) > 2 * QUOTE_CHARS:
        param = param[:2 * QUOTE_CHARS] + "..."
    body = P.ErrorResponse(error=P.ErrorInfo(message=_printable(message), type=_ERROR_TYPES.get(status, "server_error"),
                                             param=None if param is None else _printable(param), code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class OpenAIServer:
    """What the routes share: the engine thread, the config, the tokenizer copy, the metrics."""

    def __init__(self, engine: Engine | EngineClient, config: ServerConfig):
        """``engine``: an Engine (served on an AsyncEngine of its own) or an :class:`EngineClient` (an
        AsyncEngine, a :class:`vlora.cluster.front.ClusterFront`): all the server uses of it."""
        self.owns_engine = isinstance(engine, Engine)
        self.engine: EngineClient = AsyncEngine(engine, config.max_queued_requests) if self.owns_engine else engine
        self.config = config
        e = self.engine.info          # one engine's or, for a cluster, its replicas'
        self.base_name = config.served_model_name or e.model_name
        if self.base_name in self.engine.adapter_names:    # the model field could never pick the adapter
            raise ConfigError(f"served model name {self.base_name!r} is also an adapter's name; choose another "
                              f"--served-model-name")
        # the workers tokenize with their own copies; the engine thread detokenizes with the original
        self.work = HeavyWork(e.tokenizer)
        self.texts = TokenTexts(self.work)      # token text for logprobs, decoded in the workers
        self.has_tokenizer = e.tokenizer is not None
        self.context_len = e.context_len
        self.vocab_size = e.vocab_size
        # a text longer than this cannot fit the context whatever it holds: refused before it is tokenized
        chars = self.work.max_token_chars
        self.max_text_chars = None if chars is None else self.context_len * chars
        self.image_placeholder = (None if e.vision is None or e.tokenizer is None else
                                  "".join(e.tokenizer.convert_ids_to_tokens(list(e.vision.image_prompt_ids))))
        self.metrics = ServerMetrics(self.engine, self.base_name)
        # adapters loaded on first request, wherever adapters may be loaded at run time
        self.on_demand = (OnDemandAdapters(self.engine, self.on_request_source, self.register_on_request,
                                           config.max_loaded_adapters, self.metrics)
                          if config.adapter_dirs or config.allow_hub_adapters else None)
        if self.on_demand is not None and isinstance(self.engine, AsyncEngine):
            LOADER.start()          # the process that reads adapters imports torch now, not on the first load
        self.hub_misses = RecentMisses()        # Hub ids not found lately: 404 without asking the Hub again
        self.image_limits = ImageLimits(config.max_image_bytes, config.max_image_pixels, config.image_dir)
        # the server's default chat template (--chat-template), in place of the model's; checked here
        self.chat_template = None if config.chat_template is None else load_chat_template(config.chat_template)
        self.model_type = e.model_type
        # forced mistral calls are written as the server's template, else the model's, writes calls
        template = self.chat_template or getattr(e.tokenizer, "chat_template", None)
        self.mistral_tags = T.mistral_tags(e.tokenizer, template)
        self.shows_tools: dict[str | None, bool] = {}      # the model's or the server's template: renders tools?
        self.created = int(time.time())

    # -- plumbing --------------------------------------------------------------------------
    async def check_auth(self, request: Request) -> None:      # async: a sync dependency hops to a thread
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    async def read_request(self, request: Request, model: type[BaseModel]):
        """Read, size-check, parse and validate a JSON body into ``model`` (errors: 400 / 413 / 415). Parsing and
        validation run in a worker thread: a large body costs the event loop only the reading."""
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {quote(media) if media else 'none'}",
                           code="unsupported_media_type")
        limit = self.config.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        return await self.work.run(_parse, bytes(body), model)

    def adapter_for(self, model: str) -> str | None:
        """The adapter ``model`` names (None: the base model): one registered, or (on_demand.py) one that may be
        loaded on request, which :meth:`submit` loads once the request is validated. 404 when there is none that
        can be told without the Hub."""
        if model == self.base_name:
            return None
        if model not in self.engine.adapter_names:
            if self.on_demand is None:
                raise self.no_model(model)
            self.on_request_path(model)
        return model

    def no_model(self, model: str) -> APIError:
        known = ", ".join([self.base_name, *sorted(self.engine.adapter_names)])
        return APIError(404, f"model {quote(model)} does not exist (served: {known})", param="model",
                        code="model_not_found")

    def max_tokens(self, prompt_len: int, requested: tuple[int | None, str], min_tokens: int, param: str) -> int:
        """The answer's token limit; ``requested``: (the value sent, the field it came in), named in errors."""
        value, field = requested
        room = self.context_len - prompt_len
        if room < 1:
            raise APIError(400, f"prompt has {prompt_len} tokens; this model accepts at most "
                                f"{self.context_len - 1}", param=param, code="context_length_exceeded")
        if value is not None and value > room:
            raise APIError(400, f"{field}={quote(value)} is too large: prompt ({prompt_len} tokens) + {field} "
                                f"must be at most the context length, {self.context_len}",
                           param=field, code="context_length_exceeded")
        n = room if value is None else value
        if min_tokens > n:
            raise APIError(400, f"min_tokens={quote(min_tokens)} is larger than {field}={n}", param="min_tokens")
        return n

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """Every id inside the vocabulary (the schema has already refused negative ones)."""
        for i, t in enumerate(ids):
            if t >= self.vocab_size:
                raise APIError(400, f"{param}[{i}] = {quote(t)} is outside the vocabulary [0, {self.vocab_size})",
                               param=f"{param}[{i}]", code="invalid_token_id")

    def check_text_size(self, chars: int, param: str) -> None:
        """400 context_length_exceeded for text too long for the context whatever it tokenizes to (a token holds
        at most max_token_chars characters), before any tokenizing."""
        if self.max_text_chars is not None and chars > self.max_text_chars:
            raise APIError(400, f"{param} holds {chars} characters of text; this model's context of "
                                f"{self.context_len} tokens holds at most {self.max_text_chars}",
                           param=param, code="context_length_exceeded")

    def image_tokens(self, images: list) -> int:
        """Prompt tokens the images add once their placeholders are expanded (one placeholder per image)."""
        vision = self.engine.info.vision          # Qwen2-VL: 0, per image size, checked on admission
        return 0 if vision is None else vision.prompt_tokens_added(images)

    def check_choices(self, req: P.SamplingRequest, prompts: int = 1) -> None:
        """A call's choices (``n`` or ``best_of`` per prompt) are queued all or none: they must fit the queue."""
        count = req.num_candidates()
        limit = self.engine.max_queued_requests
        if count > limit:
            field = "n" if count == req.n else "best_of"
            raise APIError(400, f"{field}={count} is more than the {limit} requests this server queues at once "
                                f"(--max-queued-requests)", param=field)
        if prompts * count > limit:
            raise APIError(400, f"{prompts} prompts x {count} choices each = {prompts * count} requests, more than "
                                f"the {limit} this server queues at once (--max-queued-requests): send fewer prompts "
                                f"per call", param="prompt")

    def jobs(self, req: P.SamplingRequest, prompt: list[int], adapter: str | None, max_tokens: int,
             request_id: str, guided: GuidedSpec | None, images: list | None = None) -> list[Job]:
        """One job per candidate answer (``n``, or ``best_of``); candidate *i* samples with ``seed + i``;
        ``guided``: the structured output the answers follow (:func:`_guided`'s, or the grammar that forces tool
        calls), derived once per request."""
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids")
        bias = req.logit_bias_pairs()
        for t, _ in bias:
            if t >= self.vocab_size:
                raise APIError(400, f"logit_bias names token id {quote(t)}, outside the vocabulary "
                                    f"[0, {self.vocab_size})", param="logit_bias", code="invalid_token_id")
        self.check_choices(req)
        count = req.num_candidates()
        logprobs = req.logprobs_k()
        if logprobs is None and count > req.n:
            logprobs = 0                # ranking the candidates needs their cumulative logprobs
        jobs = []
        for i in range(count):
            try:
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=1.0 if req.temperature is None else float(req.temperature),
                    top_k=max(0, req.top_k or 0), top_p=1.0 if req.top_p is None else float(req.top_p),
                    seed=None if req.seed is None else (req.seed + i) % 2**63, stop=req.stop_strings(),
                    stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                    min_tokens=req.min_tokens, task_head=req.task_head, min_p=float(req.min_p or 0.0),
                    presence_penalty=float(req.presence_penalty or 0.0),
                    frequency_penalty=float(req.frequency_penalty or 0.0),
                    repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
                    logit_bias=bias, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs_k(), guided=guided)
            except SamplingError as e:
                field = str(e).partition(" ")[0]
                raise APIError(400, str(e), param=field if field in type(req).model_fields else None) from None
            jobs.append(Job(prompt, adapter, params, f"{request_id}-{i}", tuple(images) if images else None))
        return jobs

    async def submit(self, jobs: list[Job], prompt_param: str, guided_field: str | None = None) -> RequestGroup:
        """The jobs handed to the engine; ``prompt_param``: the field an error about the prompt names;
        ``guided_field``: the field that gave the jobs' structured output, which an error about its grammar
        names."""
        try:
            if self.on_demand is None:
                return await self.engine.submit(jobs, self.metrics.observe)
            return await self.on_demand.submit(jobs, self.metrics.observe)
        except AdaptersBusy as e:
            raise APIError(429, str(e), param="model", code="adapters_busy") from None
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), code="unavailable") from None
        except AdapterNotFound as e:
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except (RequestError, SamplingError) as e:
            param = getattr(e, "param", None)
            if param == "guided":          # the grammar could not be compiled: name its field
                param = guided_field
            raise APIError(400, str(e), param=param or prompt_param) from None

    def check_accepting(self) -> None:
        if not self.engine.accepting:
            raise APIError(503, "the server is shutting down" if self.engine.failure is None
                           else "the engine failed; the server must be restarted", code="unavailable")

    # -- generation routes -----------------------------------------------------------------
    async def chat_completions(self, request: Request):
        self.check_accepting()
        req: P.ChatCompletionRequest = await self.read_request(request, P.ChatCompletionRequest)
        adapter = self.adapter_for(req.model)
        self.check_text_size(sum(_text_chars(m.content) for m in req.messages), "messages")
        guided, field = _guided(req)
        prompt, images, tools = await self.chat_prompt(req.messages, req, field is not None)
        if tools.guided is not None:        # a forced call: T.check refuses one with structured output of its own
            guided, field = tools.guided, "tools"
        prompt_len = len(prompt) + self.image_tokens(images)
        max_tokens = self.max_tokens(prompt_len, req.requested_max_tokens(), req.min_tokens, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self.submit(self.jobs(req, prompt, adapter, max_tokens, rid, guided, images), "messages", field)
        with_logprobs = req.logprobs_k() is not None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self.chat_chunks(group, rid, req.model, prompt_len, include_usage, with_logprobs,
                                         tools.parser), group)
        outs = await _finals_or_abort(group, request)
        if outs is None:
            return Response(status_code=499)
        _raise_if_rejected(outs)
        if with_logprobs:
            return await self.work.run(_json, self.chat_response, rid, req.model, outs, prompt_len, True, tools.parser)
        return self.chat_response(rid, req.model, outs, prompt_len, False, tools.parser)

    def chat_response(self, rid: str, model: str, outs: list[RequestOutput], prompt_len: int,
                      with_logprobs: bool, tool_parser: Parser | None = None) -> P.ChatCompletionResponse:
        """The whole answer; ``with_logprobs`` decodes token text, so it then runs in a worker; ``tool_parser``:
        reads tool calls out of the answers."""
        choices = [P.ChatChoice(index=i, message=message, finish_reason=finish,
                                logprobs=self.texts.chat(o.logprobs) if with_logprobs and o.logprobs is not None
                                else None, task=_task(o))
                   for i, o in enumerate(outs) for message, finish in [_chat_message(o, tool_parser)]]
        return P.ChatCompletionResponse(id=rid, model=model, choices=choices, usage=_usage(prompt_len, outs))

    async def completions(self, request: Request):
        self.check_accepting()
        req: P.CompletionRequest = await self.read_request(request, P.CompletionRequest)
        adapter = self.adapter_for(req.model)
        sent = req.prompts()            # one prompt, or a list of them (all strings or all token-id lists)
        names = [f"prompt[{i}]" for i in range(len(sent))] if req.is_batch() else ["prompt"]
        self.check_choices(req, len(sent))
        given_ids = not isinstance(sent[0], str)
        if given_ids:
            prompts = [list(p) for p in sent]
        else:
            if not self.has_tokenizer:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            for text, name in zip(sent, names):
                self.check_text_size(len(text), name)
            encode = self.work.encode
            prompts = await self.work.run(lambda texts: [encode(t) for t in texts], sent)
        limits = []
        for ids, name in zip(prompts, names):
            if not ids:
                raise APIError(400, f"{name} is empty", param=name)
            limits.append(self.max_tokens(len(ids), (req.max_tokens, "max_tokens"), req.min_tokens, name))
            if given_ids:
                self.check_token_ids(ids, name)
        echoes = [None] * len(prompts)
        if req.echo:      # the prompt's text as sent, or (token ids) decoded as the answer's text is
            decode = self.work.decode
            echoes = sent if not given_ids else await self.work.run(lambda ps: [decode(p) for p in ps], prompts)
        forms = [_CompletionForm(ids, echo, req.logprobs_k()) for ids, echo in zip(prompts, echoes)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        guided, field = _guided(req)
        jobs = []
        for i, (ids, max_tokens) in enumerate(zip(prompts, limits)):      # prompt i's choices: a run of jobs
            jobs += self.jobs(req, list(ids), adapter, max_tokens, rid if len(prompts) == 1 else f"{rid}-{i}", guided)
        group = await self.submit(jobs, "prompt", field)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self.completion_chunks(group, rid, req.model, forms, include_usage, given_ids), group)
        outs = await _finals_or_abort(group, request)
        if outs is None:
            return Response(status_code=499)
        _raise_if_rejected(outs)
        if req.logprobs_k() is None:
            return self.completion_response(rid, req.model, outs, req.n, forms)
        return await self.work.run(_json, self.completion_response, rid, req.model, outs, req.n, forms)

    def completion_response(self, rid: str, model: str, outs: list[RequestOutput], n: int,
                            forms: list[_CompletionForm]) -> P.CompletionResponse:
        """The whole answer, prompt by prompt: each prompt's ``n`` candidates of highest cumulative logprob when
        there are more (best_of), best first, choice ``i`` of prompt ``p`` at index ``p * n + i`` (as OpenAI and
        vLLM order them). Usage counts each prompt's tokens once and every candidate's tokens, as OpenAI bills."""
        count = len(outs) // len(forms)
        choices = []
        for p, form in enumerate(forms):
            candidates = outs[p * count:(p + 1) * count]
            best = candidates if count == n else sorted(candidates, key=_cumulative, reverse=True)[:n]
            for i, o in enumerate(best):
                text, logprobs, _ = self.completion_part(form, o, o.text, o.logprobs or [], first=True, offset=0)
                choices.append(P.CompletionChoice(index=p * n + i, text=text, finish_reason=o.finish_reason,
                                                  logprobs=logprobs, task=_task(o)))
        return P.CompletionResponse(id=rid, model=model, choices=choices,
                                    usage=_usage(sum(len(f.prompt) for f in forms), outs))

    def completion_part(self, form: _CompletionForm, out: RequestOutput, text: str, new: list, first: bool,
                        offset: int) -> tuple[str, P.CompletionLogprobs | None, int]:
        """(text, logprobs, text offset after them) of a choice's part: its new ``text`` and ``new`` logprobs
        entries, after ``offset`` characters. ``first``: the choice's first part, which an echo starts with the
        prompt (and, with logprobs, the prompt tokens' logprobs)."""
        echoed = first and form.echo is not None
        if echoed:
            text = form.echo + text
        if form.logprobs is None or out.logprobs is None:      # not asked for, or the request failed
            return text, None, offset
        items = prompt_items(form.prompt, out.prompt_logprobs) if echoed else []
        logprobs, offset = self.texts.completion(items + generated(new), offset)
        return text, logprobs, offset

    async def chat_prompt(self, messages: list[P.ChatMessage], req: P.ChatCompletionRequest | None = None,
                          guided: bool = False) -> tuple[list[int], list, T.ToolUse]:
        """(templated prompt, decoded images, what the tools make of the answer). Every image is checked first
        (sizes, decoding); a text-only model then refuses them; an LMM gets its image placeholder token where each
        image part was. ``req``: the template controls (the request's own template, its variables, generation
        prompt or continuation) and the tools (:mod:`vlora.server.tools`); ``guided``: it asks for structured
        output (response_format, guided_*)."""
        template, kwargs, add_prompt, cont, tools = None, None, True, False, None
        if req is not None:
            if req.tools or req.tool_choice is not None:      # else nothing to check: no hop to a worker
                try:
                    await self.work.run(T.check, req, guided)
                except T.ToolError as e:
                    raise APIError(400, str(e), param=e.param) from None
            tools = T.template_tools(req)
            if req.chat_template is not None and not self.config.trust_request_chat_template:
                raise APIError(400, "this server does not run chat templates sent in requests (start it with "
                                    "--trust-request-chat-template, or set the default with --chat-template)",
                               param="chat_template", code="unsupported")
            problem = reserved_kwarg(req.chat_template_kwargs)
            if problem is not None:
                raise APIError(400, problem[1], param=problem[0])
            template, kwargs = req.chat_template, req.chat_template_kwargs
            add_prompt, cont = req.template_options()
        if template is not None:        # compiled (and cached) in a worker: a syntax error names the field
            try:
                await self.work.run(compile_template, template)
            except Exception as e:
                raise APIError(400, f"chat_template does not parse ({quote(describe_template_error(e), 300)[1:-1]})",
                               param="chat_template", code="invalid_chat_template") from None
        urls = [part.image_url.url for m in messages if isinstance(m.content, list)
                for part in m.content if isinstance(part, P.ImagePart)]
        images = []
        for i, url in enumerate(urls):
            try:
                images.append(await self.work.run(load_image, url, self.image_limits))
            except ImageError as e:
                raise APIError(e.status, f"image {i}: {e}", param="messages", code="invalid_image") from None
        vision = self.engine.info.vision
        if images and vision is None:
            raise APIError(400, f"model {self.base_name!r} does not accept images (it is a text-only model)",
                           param="messages", code="images_not_supported")
        conv = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) or m.content is None else
                 "\n".join(p.text if isinstance(p, P.TextPart) else self.image_placeholder for p in m.content)}
                for m in messages]
        own = template is not None
        use = T.ToolUse()
        if tools or any(m.role == "tool" or m.tool_calls for m in messages):
            native = await self.shows_tools_in(template if own else self.chat_template, own)
            name = T.choose_parser(self.config.tool_call_parser, self.model_type, native)
            conv = T.conversation(conv, messages, tools, native, name)
            if tools:
                use = T.ToolUse(parser_for(name), T.grammar(req, name, self.mistral_tags))
            tools = tools if native else None
        try:
            ids = await self.work.run(self.work.chat_template, conv, template if own else self.chat_template, kwargs,
                                      add_prompt, cont, tools)
        except RequestError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:       # a template may reject a conversation (e.g. roles out of order)
            text = quote(describe_template_error(e), 300)[1:-1]
            if own:                  # the request's own template: it, or the messages, may be at fault
                raise APIError(400, f"the request's chat_template failed to render these messages ({text})",
                               param="chat_template", code="invalid_chat_template") from None
            raise APIError(400, f"the chat template refused these messages ({text})", param="messages") from None
        return ids, images, use

    async def shows_tools_in(self, template: str | None, own: bool) -> bool:
        """Whether ``template`` (None: the model's) renders tools; probed once for the server's template, every
        time for a request's ``own``."""
        known = None if own else self.shows_tools.get(template)
        if known is None:
            render = functools.partial(self.work.chat_template, template=template)
            known = await self.work.run(T.renders_tools, lambda conv, tools: render(conv, tools=tools))
            if not own:
                self.shows_tools[template] = known
        return known

    async def chat_chunks(self, group: RequestGroup, rid: str, model: str, prompt_len: int, include_usage: bool,
                          with_logprobs: bool = False, tool_parser: Parser | None = None):
        """Chunks of new text; ``with_logprobs``: also a chunk whenever tokens arrive, with their logprobs (built
        in a worker: it decodes token text); ``tool_parser``: the answers' tool calls go out as ``tool_calls``
        deltas (:class:`ToolStream`), the first with the call's id and name, the next with its arguments."""
        created = int(time.time())
        index = {r: i for i, r in enumerate(group.request_ids)}
        sent = dict.fromkeys(index, 0)        # logprobs entries streamed, per request
        streams = {r: ToolStream(tool_parser) for r in index} if tool_parser is not None else {}
        calls = dict.fromkeys(index, 0)       # tool calls streamed, per request

        def chunk(choices, usage=None) -> str:
            return _event(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

        def deltas(out: RequestOutput) -> tuple[list[P.DeltaMessage], str | None]:
            """The deltas of ``out`` and the finish reason of the last."""
            finish = out.finish_reason if out.finished else None
            stream = streams.get(out.request_id)
            if stream is None:
                return [P.DeltaMessage(content=out.delta_text or None)], finish
            content, done = stream.feed(out.delta_text)
            if out.finished:
                more, rest, called = stream.finish()
                content, done = content + more, done + rest
                finish = _called(finish) if called else finish
            out_deltas = [P.DeltaMessage(content=content or None)]
            for call in done:
                k = calls[out.request_id]
                calls[out.request_id] += 1
                out_deltas += [P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                                   index=k, id=new_call_id(), type="function",
                                   function=P.DeltaFunctionCall(name=call.name, arguments=""))]),
                               P.DeltaMessage(tool_calls=[P.DeltaToolCall(
                                   index=k, function=P.DeltaFunctionCall(arguments=call.arguments))])]
            return out_deltas[1:] if done and not content else out_deltas, finish

        def events(outs: list[RequestOutput]) -> str:
            parts = []
            for out in outs:
                out_deltas, finish = deltas(out)
                logprobs = None
                if with_logprobs and out.logprobs is not None:
                    logprobs = self.texts.chat(out.logprobs[sent[out.request_id]:])
                    sent[out.request_id] = len(out.logprobs)
                if len(out_deltas) == 1 and not (out_deltas[0].content or out.finished or logprobs):
                    continue
                for i, delta in enumerate(out_deltas):
                    last = i == len(out_deltas) - 1
                    parts.append(chunk([P.ChatChunkChoice(index=index[out.request_id], delta=delta,
                                                          logprobs=logprobs if i == 0 else None,
                                                          finish_reason=finish if last else None)]))
            return "".join(parts)

        yield chunk([P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                     for i in range(len(index))])
        finals = []
        async for outs in group.batches():
            text = await self.work.run(events, outs) if with_logprobs else events(outs)
            finals += [out for out in outs if out.finished]
            if text:
                yield text
        if include_usage:
            yield chunk([], _usage(prompt_len, finals))

    async def completion_chunks(self, group: RequestGroup, rid: str, model: str, forms: list[_CompletionForm],
                                include_usage: bool, with_ids: bool = False):
        """Chunks of new text; ``with_ids`` (token-id prompts) or logprobs asked for: a chunk whenever tokens
        arrive (one token each while the stream keeps up with the engine), with their ids (``with_ids``) or
        logprobs. An echo's prompt leads each choice's first chunk. The group's jobs are the prompts' choices in
        order (``n`` per prompt: best_of is not streamed), so job ``k`` is choice ``k`` (prompt ``k // n``)."""
        created = int(time.time())
        index = {r: i for i, r in enumerate(group.request_ids)}
        per_prompt = len(group.request_ids) // len(forms)
        form_of = {r: forms[i // per_prompt] for r, i in index.items()}
        logprobs_k = forms[0].logprobs
        sent = dict.fromkeys(index, 0)        # logprobs entries streamed, per request
        offset = dict.fromkeys(index, 0)      # text_offset of the next token, per request
        started: set[str] = set()             # requests whose first chunk (with the echo) went out
        per_token = with_ids or logprobs_k is not None

        def events(outs: list[RequestOutput]) -> str:
            parts = []
            for out in outs:
                key = out.request_id
                if not (out.delta_text or out.finished or (per_token and out.delta_token_ids)):
                    continue
                new = [] if out.logprobs is None else out.logprobs[sent[key]:]
                text, logprobs, offset[key] = self.completion_part(form_of[key], out, out.delta_text, new,
                                                                    key not in started, offset[key])
                sent[key] += len(new)
                started.add(key)
                finish = out.finish_reason if out.finished else None
                choice = (P.CompletionStreamChoice(index=index[key], text=text, finish_reason=finish,
                                                   logprobs=logprobs, token_ids=out.delta_token_ids)
                          if with_ids else P.CompletionChoice(index=index[key], text=text, finish_reason=finish,
                                                              logprobs=logprobs))
                parts.append(_event(P.CompletionResponse(id=rid, created=created, model=model, choices=[choice])))
            return "".join(parts)

        finals = []
        async for outs in group.batches():
            text = await self.work.run(events, outs) if logprobs_k is not None else events(outs)
            finals += [out for out in outs if out.finished]
            if text:
                yield text
        if include_usage:
            yield _event(P.CompletionResponse(id=rid, created=created, model=model, choices=[],
                                              usage=_usage(sum(len(f.prompt) for f in forms), finals)))

    # -- other routes ----------------------------------------------------------------------
    async def models(self, request: Request):
        cards = [P.ModelCard(id=self.base_name, created=self.created, max_model_len=self.context_len)]
        cards += [P.ModelCard(id=name, created=self.created, parent=self.base_name, max_model_len=self.context_len)
                  for name in sorted(self.engine.adapter_names)]
        return P.ModelList(data=cards)

    async def load_adapter(self, request: Request):
        req: P.LoadAdapterRequest = await self.read_request(request, P.LoadAdapterRequest)
        if not self.config.adapter_dirs and not self.config.allow_hub_adapters:
            raise APIError(403, "loading adapters at run time is disabled (start the server with --adapter-dir or "
                           "--allow-hub-adapters)", param="lora_path", code="adapter_loading_disabled")
        if req.lora_name == self.base_name:
            raise APIError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
        # checked here so the error names lora_name: the registry's own message names the served adapter's
        # directory, which may lie outside the adapter roots that hide_paths hides
        if req.lora_name != req.lora_name.strip():
            raise APIError(400, f"lora_name {quote(req.lora_name)} must not start or end with spaces",
                           param="lora_name")
        taken = APIError(400, f"an adapter named {quote(req.lora_name)} is already loaded or still being unloaded "
                              f"(unload it first)", param="lora_name", code="adapter_exists")
        if req.lora_name in self.engine.adapter_names:
            raise taken
        path = await self.adapter_source(req.lora_path)
        try:
            await self.engine.load_adapter(req.lora_name, path)
        except AdapterExists:                   # loaded meanwhile, or still being unloaded
            raise taken from None
        except AdapterError as e:
            raise APIError(400, self.hide_paths(str(e), path, req.lora_path), param="lora_path",
                           code="invalid_adapter") from None
        log.info("loaded adapter %r from %s", req.lora_name, path)
        return {"status": "ok", "lora_name": req.lora_name}

    def hide_paths(self, message: str, path: str, raw: str) -> str:
        """``message`` with the server's own paths replaced: the adapter's by what the client sent, the adapter
        roots by a placeholder."""
        message = message.replace(path, raw if len(raw) <= QUOTE_CHARS else "<lora_path>")
        for root in self.config.adapter_dirs:
            for form in {os.path.realpath(root), os.path.abspath(root)}:
                message = message.replace(form, "<adapter dir>")
        return message

    def on_request_path(self, model: str) -> str | None:
        """The directory of the adapter ``model`` names in the adapter directories (a PEFT adapter directory), or
        None when it is to be looked up on the Hub (allowed, ``model`` a Hub id, not found there lately); 404
        naming model when neither. A name with an empty, "." or ".." part, a backslash, a NUL or a leading "/"
        names none: nothing outside the adapter directories is read. Reaches no network: checked before the
        request is validated."""
        if ("\\" in model or "\x00" in model or os.path.isabs(model)
                or any(p in ("", ".", "..") for p in model.split("/"))):
            raise self.no_model(model)
        path = None
        if self.config.adapter_dirs:
            try:
                path = self.adapter_path(model)
            except (APIError, ValueError):      # ValueError: a name the file system cannot take
                pass
        if path is None:
            if self.config.allow_hub_adapters and is_hub_id(model) and model not in self.hub_misses:
                return None
            raise self.no_model(model)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise self.no_model(model)
        return path

    async def on_request_source(self, model: str) -> str:
        """The directory of the adapter ``model`` names, to load it on first request: <adapter dir>/<model>, else
        (when allowed) the Hub snapshot of ``model``; 404 naming model when there is none
        (:meth:`on_request_path`)."""
        path = self.on_request_path(model)
        if path is not None:
            return path
        try:
            path = str(await asyncio.to_thread(snapshot_dir, model, "adapter"))
        except HubError:
            path = None
        if path is None or not os.path.isfile(os.path.join(path, "adapter_config.json")):
            self.hub_misses.add(model)
            raise self.no_model(model)
        return path

    async def register_on_request(self, name: str, path: str) -> bool:
        """Register adapter ``name`` from ``path`` (on_demand.py); False if the name was taken meanwhile. A refused
        adapter is a 400 naming model, as /v1/load_lora_adapter's refusal names lora_path."""
        try:
            await self.engine.load_adapter(name, path)
        except AdapterExists:
            return False
        except AdapterError as e:
            raise APIError(400, self.hide_paths(str(e), path, name), param="model", code="invalid_adapter") from None
        return True

    async def adapter_source(self, raw: str) -> str:
        """An adapter directory for ``raw``: inside the adapter roots first, else (when allowed) the snapshot of
        the Hub id ``raw``, downloaded off the event loop."""
        if "\x00" in raw:
            raise APIError(400, "lora_path must not contain a NUL character", param="lora_path")
        hub = self.config.allow_hub_adapters and is_hub_id(raw)
        if self.config.adapter_dirs:
            try:
                return self.adapter_path(raw)
            except APIError:
                if not hub:
                    raise
        if not hub:
            raise APIError(400, f"lora_path {quote(raw)} is not a Hub id (org/name[@revision])", param="lora_path")
        try:
            return str(await asyncio.to_thread(snapshot_dir, raw, "adapter"))
        except HubError as e:
            message = str(e).replace(hub_constants.HF_HUB_CACHE, "<Hugging Face cache>")
            raise APIError(404, message, param="lora_path", code="adapter_not_found") from None

    def adapter_path(self, raw: str) -> str:
        """``raw`` resolved (symlinks too) inside one of the adapter roots, or 403/404."""
        inside = []
        for root in self.config.adapter_dirs:
            root = os.path.realpath(root)
            full = os.path.realpath(os.path.join(root, raw))     # an absolute raw replaces root
            if os.path.commonpath([root, full]) == root:
                inside.append(full)
        if not inside:
            raise APIError(403, "lora_path is outside the server's adapter directories", param="lora_path",
                           code="path_not_allowed")
        for full in inside:
            if os.path.isdir(full):
                return full
        raise APIError(404, f"no adapter directory {quote(raw)} in the server's adapter directories", param="lora_path",
                       code="adapter_not_found")

    async def unload_adapter(self, request: Request):
        req: P.UnloadAdapterRequest = await self.read_request(request, P.UnloadAdapterRequest)
        if req.lora_name == self.base_name:
            raise APIError(400, "the base model cannot be unloaded", param="lora_name")
        policy = self.config.unload_policy
        try:
            count = await self.engine.unload_adapter(req.lora_name, policy)
        except AdapterNotFound as e:
            raise APIError(404, str(e), param="lora_name", code="adapter_not_found") from None
        self.metrics.forget(req.lora_name)
        log.info("unloaded adapter %r (%s %d request(s))", req.lora_name,
                 "aborted" if policy == "abort" else "waited for", count)
        return {"status": "ok", "lora_name": req.lora_name,
                ("aborted_requests" if policy == "abort" else "waited_requests"): count}

    async def health(self, request: Request):
        if self.engine.accepting:
            return {"status": "ok"}
        return error_response(503, "shutting down" if self.engine.failure is None else "engine failed",
                              code="unavailable")

    async def prometheus(self, request: Request):
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@dataclass(frozen=True)
class _CompletionForm:
    """What shapes a completion's choices: the prompt's ids, the echoed prompt text (None: no echo) and the
    alternatives per token of the logprobs asked for (None: no logprobs)."""

    prompt: list[int]
    echo: str | None
    logprobs: int | None


def _cumulative(out: RequestOutput) -> float:
    """A candidate's rank for best_of; one without a cumulative logprob (it failed) ranks last."""
    return -math.inf if out.cumulative_logprob is None else out.cumulative_logprob


def _json(build, *args) -> Response:
    """``build(*args)`` serialized to a JSON response (in a worker: an answer with logprobs is large)."""
    return Response(build(*args).model_dump_json(), media_type="application/json")


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _task(out: RequestOutput) -> P.TaskAnswer | None:
    return None if out.task is None else P.TaskAnswer(label=out.task.label, scores=out.task.scores)


def _usage(prompt_len: int, outs: list[RequestOutput]) -> P.Usage:
    completion = sum(len(o.token_ids) for o in outs)
    return P.Usage(prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion)


def _sse(chunks, group: RequestGroup) -> StreamingResponse:
    """Server-sent events ending with [DONE]; the group is aborted if the client leaves first."""

    async def events():
        try:
            async for data in chunks:
                yield data
        except EngineFailed as e:
            yield _event(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="server_error", code=_fail_code(e))))
        finally:
            group.abort()
        yield "data: [DONE]\n\n"

    async def abort() -> None:      # async: a sync background task hops to a thread
        group.abort()

    # the background task also runs when the client disconnects before the first chunk
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(abort))


async def _finals_or_abort(group: RequestGroup, request: Request) -> list[RequestOutput] | None:
    """The group's final outputs, or None (and the group aborted) if the client disconnects first."""
    results = asyncio.ensure_future(group.results())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not results.done():
            results.cancel()
            group.abort()
    if not results.done() or results.cancelled():
        return None
    try:
        return results.result()
    except EngineFailed as e:
        raise APIError(500, str(e), code=_fail_code(e)) from None


def _fail_code(e: EngineFailed) -> str:
    return "request_failed" if isinstance(e, RequestFailed) else "engine_failed"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _parse(body: bytes, model: type[BaseModel]):
    """The body validated into ``model`` (in a worker thread), or APIError 400 naming the field."""
    try:
        obj = parse_json(body, MAX_JSON_DEPTH)
    except BodyError as e:
        raise APIError(400, e.message, param=e.param, code=e.code) from None
    try:
        req = model.model_validate(obj)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise APIError(400, message, param=param) from None
    ignored, problem = P.extra_fields(req)
    if problem is not None:
        raise APIError(400, problem[1], param=problem[0], code=problem[2])
    problem = getattr(req, "invalid", lambda: None)()
    if problem is not None:
        raise APIError(400, problem[1], param=problem[0])
    problem = getattr(req, "unsupported", lambda: None)()
    if problem is not None:
        raise APIError(400, problem[1], param=problem[0], code="unsupported")
    if ignored:         # as vLLM: accepted, and named once in the log
        shown = ", ".join(quote(name) for name in ignored[:MAX_IGNORED_SHOWN])
        more = f" and {len(ignored) - MAX_IGNORED_SHOWN} more" if len(ignored) > MAX_IGNORED_SHOWN else ""
        log.warning("ignored request fields this server does not know: %s%s", shown, more)
    return req


def _printable(text: str) -> str:
    """``text`` with anything UTF-8 cannot encode (a lone surrogate) written as an escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errors = e.errors(include_url=False)
    err = max(errors, key=lambda x: len(x["loc"]))
    parts = [p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS
                                                                    or p.startswith("function-")))]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or None
    if err["type"] == "extra_forbidden":      # the field's own name, whatever characters it holds
        key = str(err["loc"][-1])
        param = f"{param.rpartition('.')[0]}.{key}".lstrip(".") if len(parts) > 1 else key
        return f"unknown field {quote(key)} (vlora refuses fields it does not know)", param
    if err["type"] == "missing":
        return f"missing required field {quote(param)}", param
    msg = err["msg"] if len(err["msg"]) <= 2 * QUOTE_CHARS else err["msg"][:2 * QUOTE_CHARS] + "..."
    return (f"{param}: {msg}" if param else msg), param


def build_app(engine: Engine | EngineClient, config: ServerConfig | None = None, stop_client: bool = False) -> FastAPI:
    """The FastAPI app serving ``engine``. It starts the engine on startup; given an Engine, it makes an
    AsyncEngine of it (with config.max_queued_requests) and drains and stops it on shutdown; given an
    :class:`EngineClient`, the caller keeps it (and its queue bound) and stops it, unless ``stop_client``: then
    the app drains and stops it on shutdown as well."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        if server.owns_engine or stop_client:
            await server.engine.shutdown(config.drain_timeout)
        server.work.shutdown()

    # FastAPI's own docs routes take no dependencies, so they are off here and added below, behind the key
    app = FastAPI(title="vlora", summary="OpenAI-compatible multi-LoRA server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    auth = [Depends(server.check_auth)]
    if config.enable_docs:
        _add_docs_routes(app, auth)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"], dependencies=auth,
                      response_model=None)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"], dependencies=auth,
                      response_model=None)
    app.add_api_route("/v1/models", server.models, methods=["GET"], dependencies=auth, response_model=None)
    app.add_api_route("/v1/load_lora_adapter", server.load_adapter, methods=["POST"], dependencies=auth,
                      response_model=None)
    app.add_api_route("/v1/unload_lora_adapter", server.unload_adapter, methods=["POST"], dependencies=auth,
                      response_model=None)
    app.add_api_route("/health", server.health, methods=["GET"], response_model=None)
    app.add_api_route("/metrics", server.prometheus, methods=["GET"], response_model=None)

    def count(status: int) -> None:
        server.metrics.http_errors.labels(str(status)).inc()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        count(exc.status)
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return error_response(exc.status, exc.message, exc.param, exc.code, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        count(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)       # nobody reads it; nothing was submitted yet

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        count(400)
        return error_response(400, quote(str(exc), 2 * QUOTE_CHARS)[1:-1])

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        count(500)
        return error_response(500, f"internal server error ({type(exc).__name__})")

    return app


def _add_docs_routes(app: FastAPI, auth: list) -> None:
    """/openapi.json, /docs (Swagger UI, with its OAuth2 redirect page) and /redoc, each behind ``auth``."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html

    async def openapi(request: Request):
        return JSONResponse(app.openapi())

    async def swagger(request: Request):
        return get_swagger_ui_html(openapi_url="/openapi.json", title="vlora",
                                   oauth2_redirect_url="/docs/oauth2-redirect")

    async def oauth2_redirect(request: Request):
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request):
        return get_redoc_html(openapi_url="/openapi.json", title="vlora")

    for path, route in [("/openapi.json", openapi), ("/docs", swagger), ("/docs/oauth2-redirect", oauth2_redirect),
                        ("/redoc", redoc)]:
        app.add_api_route(path, route, methods=["GET"], dependencies=auth, include_in_schema=False,
                          response_model=None)


def serve(engine: Engine | EngineClient, config: ServerConfig, log_level: str = "info", stop_client: bool = False) -> None:
    """Run the server until SIGINT/SIGTERM: then refuse new requests (503), let running ones finish
    (up to config.drain_timeout), and stop (an :class:`EngineClient` too with ``stop_client``)."""
    import uvicorn

    app = build_app(engine, config, stop_client)
    client: EngineClient = app.state.server.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            client.begin_shutdown()
            super().handle_exit(sig, frame)

    server = Server(uvicorn_config(app, host=config.host, port=config.port, log_level=log_level,
                                   timeout_graceful_shutdown=config.drain_timeout))
    # an engine that cannot go on has answered its requests; the process stops (exit status 1) so that a
    # supervisor restarts it, rather than answering 503 for good
    client.on_fatal = lambda exc: setattr(server, "should_exit", True)
    try:
        server.run()
    except KeyboardInterrupt:       # uvicorn re-raises Ctrl-C once it has shut down gracefully: no traceback
        raise SystemExit(130) from None
    if client.failure is not None:
        raise SystemExit(f"vlora: the engine failed ({client.failure!r}); exiting for a restart")


def _chat_message(out: RequestOutput, tool_parser: Parser | None) -> tuple[P.ChatMessageOut, str | None]:
    """A whole answer's message and finish reason: ``tool_calls`` when ``tool_parser`` finds calls in it."""
    content, calls = (out.text, []) if tool_parser is None else parse_answer(tool_parser, out.text)
    if not calls:
        return P.ChatMessageOut(content=out.text), out.finish_reason
    return P.ChatMessageOut(content=content, tool_calls=[
        P.ToolCallOut(id=new_call_id(), function=P.FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls]), _called(out.finish_reason)


def _called(finish_reason: str | None) -> str | None:
    """The finish reason of an answer that made tool calls: "tool_calls" where it ended on its own."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _text_chars(content) -> int:
    """Characters of text in a message's content (a string, parts, or None)."""
    if content is None or isinstance(content, str):
        return len(content or "")
    return sum(len(p.text) for p in content if isinstance(p, P.TextPart))


def _guided(req: P.SamplingRequest) -> tuple[GuidedSpec | None, str | None]:
    """(the request's structured output, the field that asked for it: chat's response_format, else a guided_*
    extra), or (None, None); a malformed one is a 400 naming its field."""
    try:
        return req.guided()
    except SamplingError as e:
        field = str(e).partition(":")[0]
        raise APIError(400, str(e), param=field if field in type(req).model_fields else None) from None
