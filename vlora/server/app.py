"""The OpenAI-compatible HTTP server: ``build_app(engine, ServerConfig)`` and ``serve``.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, GET /health, GET /metrics.
The ``model`` field picks the adapter: an adapter's name, or the base model's.

Policies (docs/server.md has the full list):
- unknown request fields are a 400 naming the field (typos never pass silently);
- ``max_tokens`` larger than the context allows (prompt + max_tokens > context) is a
  400, as OpenAI and vLLM do; without max_tokens a chat answer may fill the context
  and a completion stops at 16 tokens (OpenAI's defaults);
- a client that disconnects, streaming or not, has its requests aborted.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vlora.config import ServerConfig
from vlora.engine.async_engine import (AdapterNotFound, AsyncEngine, EngineFailed, Job, QueueFull, RequestGroup,
                                       ShuttingDown)
from vlora.engine.engine import Engine, RequestError
from vlora.engine.llm import apply_chat_template
from vlora.engine.sequence import RequestOutput
from vlora.lora.adapter import AdapterError
from vlora.sampling_params import SamplingError, SamplingParams
from vlora.server import protocol as P
from vlora.server.images import ImageError, ImageLimits, load_image
from vlora.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


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
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "server_error"),
                                             param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class OpenAIServer:
    """What the routes share: the engine thread, the config, the tokenizer copy, the metrics."""

    def __init__(self, engine: Engine | AsyncEngine, config: ServerConfig):
        self.owns_engine = isinstance(engine, Engine)
        self.engine = AsyncEngine(engine, config.max_queued_requests) if self.owns_engine else engine
        self.config = config
        e = self.engine.engine
        self.base_name = config.served_model_name or e.model_name
        # the event loop tokenizes with its own copy; the engine thread detokenizes with the original
        self.tokenizer = copy.deepcopy(e.tokenizer) if e.tokenizer is not None else None
        # longest prompt + output: the model's limit, and what one sequence can hold in the KV cache
        self.context_len = min(e.max_model_len, e.pool.num_pages * e.block_size)
        self.metrics = ServerMetrics(self.engine, self.base_name)
        self.image_limits = ImageLimits(config.max_image_bytes, config.max_image_pixels, config.image_dir)
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
        """Read, size-check, parse and validate a JSON body into ``model`` (errors: 400 / 413)."""
        limit = self.config.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="request_too_large")
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(obj).__name__}")
        try:
            req = model.model_validate(obj)
        except ValidationError as e:
            message, param = _validation_message(e)
            raise APIError(400, message, param=param) from None
        problem = getattr(req, "unsupported", lambda: None)()
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0], code="unsupported")
        return req

    def adapter_for(self, model: str) -> str | None:
        if model == self.base_name:
            return None
        if model not in self.engine.adapter_names:
            known = ", ".join([self.base_name, *sorted(self.engine.adapter_names)])
            raise APIError(404, f"model {model!r} does not exist (served: {known})", param="model",
                           code="model_not_found")
        return model

    def max_tokens(self, prompt_len: int, requested: int | None, min_tokens: int, param: str) -> int:
        room = self.context_len - prompt_len
        if room < 1:
            raise APIError(400, f"prompt has {prompt_len} tokens; this model accepts at most "
                                f"{self.context_len - 1}", param=param, code="context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(400, f"max_tokens={requested} is too large: prompt ({prompt_len} tokens) + max_tokens "
                                f"must be at most the context length, {self.context_len}",
                           param="max_tokens", code="context_length_exceeded")
        n = room if requested is None else requested
        if min_tokens > n:
            raise APIError(400, f"min_tokens={min_tokens} is larger than max_tokens={n}", param="min_tokens")
        return n

    def image_tokens(self, images: list) -> int:
        """Prompt tokens the images add once their placeholders are expanded (one placeholder per image)."""
        vision = self.engine.engine.vision
        if vision is None or vision.tokens_per_image is None:   # Qwen2-VL: per image size, checked on admission
            return 0
        return len(images) * (vision.tokens_per_image - 1)

    def jobs(self, req: P.SamplingRequest, prompt: list[int], adapter: str | None, max_tokens: int,
             request_id: str, images: list | None = None) -> list[Job]:
        jobs = []
        for i in range(req.n):
            try:
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=1.0 if req.temperature is None else float(req.temperature),
                    top_k=max(0, req.top_k or 0), top_p=1.0 if req.top_p is None else float(req.top_p),
                    seed=None if req.seed is None else req.seed + i, stop=req.stop_strings(),
                    stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                    min_tokens=req.min_tokens, task_head=req.task_head)
            except SamplingError as e:
                raise APIError(400, str(e)) from None
            jobs.append(Job(prompt, adapter, params, f"{request_id}-{i}", tuple(images) if images else None))
        return jobs

    async def submit(self, jobs: list[Job]) -> RequestGroup:
        try:
            return await self.engine.submit(jobs, self.metrics.observe)
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full") from None
        except ShuttingDown as e:
            raise APIError(503, str(e), code="unavailable") from None
        except AdapterNotFound as e:
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except (RequestError, SamplingError) as e:
            raise APIError(400, str(e), param="prompt") from None

    def check_accepting(self) -> None:
        if not self.engine.accepting:
            raise APIError(503, "the server is shutting down" if self.engine.failure is None
                           else "the engine failed; the server must be restarted", code="unavailable")

    # -- generation routes -----------------------------------------------------------------
    async def chat_completions(self, request: Request):
        self.check_accepting()
        req: P.ChatCompletionRequest = await self.read_request(request, P.ChatCompletionRequest)
        adapter = self.adapter_for(req.model)
        prompt, images = await self.chat_prompt(req.messages)
        prompt_len = len(prompt) + self.image_tokens(images)
        max_tokens = self.max_tokens(prompt_len, req.requested_max_tokens(), req.min_tokens, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self.submit(self.jobs(req, prompt, adapter, max_tokens, rid, images))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(self.chat_chunks(group, rid, req.model, prompt_len, include_usage), group)
        outs = await _finals_or_abort(group, request)
        if outs is None:
            return Response(status_code=499)
        _raise_if_rejected(outs)
        choices = [P.ChatChoice(index=i, message=P.ChatMessageOut(content=o.text), finish_reason=o.finish_reason,
                                task=_task(o)) for i, o in enumerate(outs)]
        return P.ChatCompletionResponse(id=rid, model=req.model, choices=choices, usage=_usage(prompt_len, outs))

    async def completions(self, request: Request):
        self.check_accepting()
        req: P.CompletionRequest = await self.read_request(request, P.CompletionRequest)
        adapter = self.adapter_for(req.model)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        max_tokens = self.max_tokens(len(prompt), req.max_tokens, req.min_tokens, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = await self.submit(self.jobs(req, list(prompt), adapter, max_tokens, rid))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            with_ids = not isinstance(req.single_prompt(), str)
            return _sse(self.completion_chunks(group, rid, req.model, len(prompt), include_usage, with_ids), group)
        outs = await _finals_or_abort(group, request)
        if outs is None:
            return Response(status_code=499)
        _raise_if_rejected(outs)
        choices = [P.CompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason, task=_task(o))
                   for i, o in enumerate(outs)]
        return P.CompletionResponse(id=rid, model=req.model, choices=choices, usage=_usage(len(prompt), outs))

    async def chat_prompt(self, messages: list[P.ChatMessage]) -> tuple[list[int], list]:
        """(templated prompt, decoded images). Every image is checked first (sizes, decoding); a text-only model
        then refuses them; an LMM gets its image placeholder token where each image part was."""
        urls = [part.image_url.url for m in messages if isinstance(m.content, list)
                for part in m.content if isinstance(part, P.ImagePart)]
        images = []
        for i, url in enumerate(urls):
            try:
                images.append(await asyncio.to_thread(load_image, url, self.image_limits))
            except ImageError as e:
                raise APIError(e.status, f"image {i}: {e}", param="messages", code="invalid_image") from None
        vision = self.engine.engine.vision
        if images and vision is None:
            raise APIError(400, f"model {self.base_name!r} does not accept images (it is a text-only model)",
                           param="messages", code="images_not_supported")
        placeholder = (None if vision is None or self.tokenizer is None
                       else "".join(self.tokenizer.convert_ids_to_tokens(list(vision.image_prompt_ids))))
        conv = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else
                 "\n".join(p.text if isinstance(p, P.TextPart) else placeholder for p in m.content)}
                for m in messages]
        try:
            return apply_chat_template(self.tokenizer, conv), images
        except RequestError as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:       # a template may reject a conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template refused these messages ({e})", param="messages") from None

    async def chat_chunks(self, group: RequestGroup, rid: str, model: str, prompt_len: int, include_usage: bool):
        created = int(time.time())
        index = {r: i for i, r in enumerate(group.request_ids)}

        def chunk(choices, usage=None) -> str:
            return _event(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

        yield chunk([P.ChatChunkChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                     for i in range(len(index))])
        finals = []
        async for outs in group.batches():
            events = []
            for out in outs:
                if out.delta_text or out.finished:
                    delta = P.DeltaMessage(content=out.delta_text) if out.delta_text else P.DeltaMessage()
                    events.append(chunk([P.ChatChunkChoice(index=index[out.request_id], delta=delta,
                                                           finish_reason=out.finish_reason if out.finished else None)]))
                if out.finished:
                    finals.append(out)
            if events:
                yield "".join(events)
        if include_usage:
            yield chunk([], _usage(prompt_len, finals))

    async def completion_chunks(self, group: RequestGroup, rid: str, model: str, prompt_len: int,
                                include_usage: bool, with_ids: bool = False):
        """Chunks of new text; ``with_ids`` (a token-id prompt): a chunk whenever tokens arrive, with their ids
        (one token each while the stream keeps up with the engine)."""
        created = int(time.time())
        index = {r: i for i, r in enumerate(group.request_ids)}
        finals = []
        async for outs in group.batches():
            events = []
            for out in outs:
                if out.delta_text or out.finished or (with_ids and out.delta_token_ids):
                    finish = out.finish_reason if out.finished else None
                    choice = (P.CompletionStreamChoice(index=index[out.request_id], text=out.delta_text,
                                                       finish_reason=finish, token_ids=out.delta_token_ids)
                              if with_ids else P.CompletionChoice(index=index[out.request_id], text=out.delta_text,
                                                                  finish_reason=finish))
                    events.append(_event(P.CompletionResponse(id=rid, created=created, model=model,
                                                              choices=[choice])))
                if out.finished:
                    finals.append(out)
            if events:
                yield "".join(events)
        if include_usage:
            yield _event(P.CompletionResponse(id=rid, created=created, model=model, choices=[],
                                              usage=_usage(prompt_len, finals)))

    # -- other routes ----------------------------------------------------------------------
    async def models(self, request: Request):
        cards = [P.ModelCard(id=self.base_name, created=self.created, max_model_len=self.context_len)]
        cards += [P.ModelCard(id=name, created=self.created, parent=self.base_name)
                  for name in sorted(self.engine.adapter_names)]
        return P.ModelList(data=cards)

    async def load_adapter(self, request: Request):
        req: P.LoadAdapterRequest = await self.read_request(request, P.LoadAdapterRequest)
        if not self.config.adapter_dirs:
            raise APIError(403, "loading adapters at run time is disabled (start the server with --adapter-dir)",
                           param="lora_path", code="adapter_loading_disabled")
        path = self.adapter_path(req.lora_path)
        if req.lora_name == self.base_name:
            raise APIError(400, f"{req.lora_name!r} is the base model's name", param="lora_name")
        try:
            await self.engine.call(lambda e: e.adapters.register(req.lora_name, path))
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_adapter") from None
        log.info("loaded adapter %r from %s", req.lora_name, path)
        return {"status": "ok", "lora_name": req.lora_name}

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
        raise APIError(404, f"no adapter directory {raw!r} in the server's adapter directories", param="lora_path",
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
            yield _event(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="server_error", code="engine_failed")))
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
        raise APIError(500, str(e), code="engine_failed") from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    errors = e.errors(include_url=False)
    err = max(errors, key=lambda x: len(x["loc"]))
    parts = [p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS
                                                                    or p.startswith("function-")))]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or None
    if err["type"] == "extra_forbidden":
        return f"unknown field {param!r} (vlora refuses fields it does not know)", param
    if err["type"] == "missing":
        return f"missing required field {param!r}", param
    return (f"{param}: {err['msg']}" if param else err["msg"]), param


def build_app(engine: Engine | AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``. It starts the engine thread on startup; given an Engine, it
    makes that thread itself (with config.max_queued_requests) and drains and stops it on shutdown;
    given an AsyncEngine, the caller keeps it (and its queue bound) and stops it."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        yield
        if server.owns_engine:
            await server.engine.shutdown(config.drain_timeout)

    app = FastAPI(title="vlora", summary="OpenAI-compatible multi-LoRA server", lifespan=lifespan)
    app.state.server = server
    auth = [Depends(server.check_auth)]
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
        return error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        count(500)
        return error_response(500, f"internal server error ({type(exc).__name__})")

    return app


def serve(engine: Engine, config: ServerConfig, log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM: then refuse new requests (503), let running ones finish
    (up to config.drain_timeout), and stop."""
    import uvicorn

    app = build_app(engine, config)
    async_engine: AsyncEngine = app.state.server.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            async_engine.begin_shutdown()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                          timeout_graceful_shutdown=config.drain_timeout)).run()
