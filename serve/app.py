"""The OpenAI-compatible HTTP service: FastAPI handlers that turn HTTP into engine requests.

Handlers never block the engine: outputs arrive on the engine thread and are handed to the
request's asyncio queue with `call_soon_threadsafe`. A client that goes away cancels its
request, which frees its KV pages at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jfire.client import EngineClient
from jfire.deployment_secret import DeploymentSecret
from jfire.errors import EngineStopped, JfireError, QueueFull, RequestError
from jfire.request_checks import TextLimit
from jfire.requests import RequestOutput
from jfire.sampling import SamplingParams
from jfire.vision.encoder import RequestImage
from jfire.vision.images import ImageLimits
from serve import api_keys
from serve.access_log import AccessLog
from serve.chat import (
    OutputPlan,
    PromptError,
    compiled_grammar,
    expand_images,
    render_chat,
    request_images,
    response_grammar_builder,
    tools_constrained,
)
from serve.metrics import ServerMetrics
from serve.responses import Responder
from serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

log = logging.getLogger("jfire.serve")
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclasses.dataclass
class ServerState:
    engine: EngineClient
    model_name: str
    api_keys: tuple[str, ...] = ()  # any one opens every endpoint but /health (serve/api_keys.py); (): open
    metrics: ServerMetrics | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = 16 << 20  # larger request bodies get a 413 before they are read
    draining: bool = False  # shutting down: no new requests, in-flight ones finish
    drained: bool = False  # draining, and no request is in flight any more
    access_log: bool = True  # one line on stderr per request (serve/access_log.py)
    image_limits: ImageLimits = dataclasses.field(default_factory=ImageLimits)  # chat image parts
    # A deployment's (a frontend's): its control token also shows /health's group addresses and pids.
    deployment_secret: DeploymentSecret | None = None
    cache_salt_per_key: bool = False  # each API key's prompts hash apart (api_keys.salt_for)
    salt_key: bytes = dataclasses.field(init=False, repr=False, default=b"")
    # Where requests' grammars are built and compiled: off the event loop (a large schema takes
    # seconds), and on at most half the cores, leaving the rest to tokenizing and the engine.
    grammar_pool: concurrent.futures.Executor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max(1, (os.cpu_count() or 2) // 2), thread_name_prefix="jfire-grammar"
        ),
        repr=False,
    )

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = ServerMetrics(self.engine.stats)
        if self.cache_salt_per_key and not self.api_keys:
            raise JfireError("per-key cache salts need API keys (--api-key-file, or $JFIRE_API_KEY)")
        # A deployment's salts stay the same across a frontend's restart (the groups' caches
        # stay useful); a lone server's need only last as long as its cache.
        secret = self.deployment_secret
        self.salt_key = secret.derive("cache-salt") if secret is not None else secrets.token_bytes(32)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="jfire", description="OpenAI-compatible completion service", version="0.1.0")
    app.state.jfire = state
    _install_error_handlers(app)
    # As the decorator-installed middlewares were: the last added runs first.
    app.add_middleware(_BodyLimit, state=state)
    if state.api_keys:
        app.add_middleware(_BearerAuth, state=state)
    app.add_middleware(_RequestCounter, state=state)
    if state.access_log:
        app.add_middleware(AccessLog)

    @app.get("/health")
    async def health(request: Request):
        if state.draining:
            return JSONResponse(
                {"status": "draining", "message": "shutting down; in-flight requests finish", "drained": state.drained},
                status_code=503,
            )
        status, body = state.engine.health()
        if not _sees_details(state, request.headers.get("authorization")):
            body = _public_health(body)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "jfire",
                    "max_model_len": state.engine.max_model_len,
                }
            ],
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(
                404,
                f"model {model_id!r} is not served here; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
                kind="not_found_error",
            )
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "jfire",
            "max_model_len": state.engine.max_model_len,
        }

    # The most bytes a prompt's text may have, read from the vocabulary once, now rather than
    # during some request.
    text_limit = TextLimit.of(state.engine.tokenizer, state.engine.max_model_len)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        # Checking and tokenizing a long prompt takes a while: off the event loop, which serves
        # everyone (the tokenizer lets go of the GIL, so the engine's thread runs on too).
        try:
            prompt_ids = await asyncio.to_thread(_completion_prompt, body, state.engine, text_limit)
        except RequestError as e:
            raise _request_error(e, body, chat=False) from None
        plan = OutputPlan(response_grammar_builder(body))
        echo = _echo_text(body, prompt_ids, state.engine)
        return await _serve(state, request, body, prompt_ids, chat=False, plan=plan, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            images = await request_images(state.engine, body, state.image_limits)
            prompt_ids, plan = await asyncio.to_thread(_chat_prompt, body, state.engine, text_limit, images)
        except PromptError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except RequestError as e:
            raise _request_error(e, body, chat=True) from None
        except JfireError as e:
            raise APIError(400, str(e), param="messages") from None
        return await _serve(state, request, body, prompt_ids, chat=True, plan=plan, images=images)

    return app


# -- request handling ----------------------------------------------------------------------


def _require_tokenizer(engine: EngineClient):
    if engine.tokenizer is None:
        raise APIError(
            400, "this model has no tokenizer; send token ids as 'prompt' to /v1/completions", param="messages"
        )
    return engine.tokenizer


def _completion_prompt(body: CompletionRequest, engine: EngineClient, text_limit: TextLimit | None) -> list[int]:
    """The prompt's ids; a text too long for the context is refused before it is tokenized."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"send one prompt per request (got {len(prompt)})", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokenizer = _require_tokenizer(engine)
        _valid_text(prompt, "prompt")
        if text_limit is not None:
            text_limit.check(prompt)
        return tokenizer.encode(prompt)
    return list(prompt)


def _chat_prompt(
    body: ChatCompletionRequest, engine: EngineClient, text_limit: TextLimit | None, images: list[RequestImage]
) -> tuple[list[int], OutputPlan]:
    """The chat's prompt ids (each image's placeholder ids in its place) and output plan; a
    rendered prompt too long for the context is refused before it is tokenized."""
    tokenizer = _require_tokenizer(engine)
    for i, m in enumerate(body.messages):  # names are not in the prompt, but must be text all the same
        _valid_text(m.text(), "messages")
        _valid_text(m.name or "", f"messages.{i}.name")
    prompt_ids, plan = render_chat(tokenizer, engine.model_type, body, text_limit)
    if images:
        prompt_ids = expand_images(engine, prompt_ids, images)
    return prompt_ids, plan


def _valid_text(text: str, param: str) -> str:
    """Refuses text that is not valid Unicode (a lone surrogate, which JSON's \\ud800 escapes
    can carry): the tokenizer could not encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"{param} is not valid Unicode: a lone surrogate at character {e.start}; send UTF-8 text",
            param=param,
            code="invalid_value",
        ) from None
    return text


def _echo_text(body: CompletionRequest, prompt_ids: list[int], engine: EngineClient) -> str:
    if not body.echo:
        return ""
    prompt = (
        body.prompt[0]
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list))
        else body.prompt
    )
    if isinstance(prompt, str):
        return prompt
    tokenizer = engine.tokenizer
    return tokenizer.decode(prompt_ids, skip_special_tokens=False) if tokenizer else ""


def _logprobs_asked(body: SamplingFields, chat: bool) -> int | None:
    """How many top logprobs per token (0: the sampled token's only), or None for none."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def _sampling(
    body: SamplingFields,
    max_tokens: int,
    plan: OutputPlan,
    logprobs: int | None,
    seed: int | None,
    chat: bool,
    cache_salt: str | None,
    grammar: str | None = None,
) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=seed,
            max_tokens=max_tokens,
            stop=tuple(body.stop_list()),
            ignore_eos=body.ignore_eos,
            frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty,
            repetition_penalty=body.repetition_penalty,
            logprobs=logprobs,
            min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            grammar=grammar,
            skip_special_tokens=not plan.keep_special_tokens,
            prompt_logprobs=getattr(body, "echo", False) and logprobs is not None,
            cache_salt=cache_salt,
        )
    except RequestError as e:
        raise _request_error(e, body, chat) from None


def _max_tokens(body: SamplingFields, prompt_len: int, engine: EngineClient, chat: bool) -> int:
    given = body.max_completion_tokens if chat and body.max_completion_tokens else body.max_tokens
    if given is None:  # chat without a limit: whatever the context leaves
        return max(1, engine.max_model_len - prompt_len)
    return given


async def _serve(
    state: ServerState,
    request: Request,
    body: SamplingFields,
    prompt_ids: list[int],
    *,
    chat: bool,
    plan: OutputPlan,
    echo: str = "",
    images: list[RequestImage] | None = None,
):
    engine = state.engine
    if state.draining:
        raise APIError(
            503,
            "the server is shutting down; send the request to another replica or retry later",
            kind="server_error",
            code="shutting_down",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if not engine.is_ready():
        raise APIError(
            503,
            "the server is still compiling its programs; retry shortly",
            kind="server_error",
            code="not_ready",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if body.model != state.model_name:
        raise APIError(
            400,
            f"model {body.model!r} is not served here; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    for stop in body.stop_list():
        _valid_text(stop, "stop")
    _valid_text(body.user or "", "user")
    _valid_text(body.cache_salt or "", "cache_salt")
    cache_salt = body.cache_salt
    if state.cache_salt_per_key:  # the middleware has checked the key
        cache_salt = api_keys.salt_for(
            state.salt_key, api_keys.bearer(request.headers.get("authorization")), cache_salt
        )
    logprobs = _logprobs_asked(body, chat)
    max_tokens = _max_tokens(body, len(prompt_ids), engine, chat)
    try:  # a full queue answers before any grammar is compiled
        engine.checks.admit(body.n)
    except BaseException as e:
        _raise_submit_error(e, body, chat)

    def check(grammar: str) -> None:  # the request as each choice sends it, but for its seed
        engine.validate(prompt_ids, _sampling(body, max_tokens, plan, logprobs, None, chat, cache_salt, grammar))

    try:
        grammar = await compiled_grammar(state.grammar_pool, plan, check)
    except PromptError as e:
        raise APIError(400, str(e), param=e.param, code="invalid_value") from None
    except BaseException as e:
        _raise_submit_error(e, body, chat)
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def on_output(out: RequestOutput) -> None:  # engine thread: hand over, never block
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    # Choice i > 0 draws from seed + i (a given seed stays reproducible, the choices differ)
    # and waits for choice 0's prompt pages (engine `after`).
    choice_ids = [request_id] if body.n == 1 else [f"{request_id}-{i}" for i in range(body.n)]
    first_seed = body.seed if body.seed is not None else SamplingParams().resolved_seed()
    submitted: list[str] = []
    # Only a request with images names them: an engine client that takes none keeps its signature.
    image_args = {"images": images} if images else {}
    try:
        for i, choice_id in enumerate(choice_ids):
            seed = (first_seed + i) % 2**32
            sampling = _sampling(body, max_tokens, plan, logprobs, seed, chat, cache_salt, grammar)
            engine.submit(
                prompt_ids,
                sampling,
                request_id=choice_id,
                on_output=on_output,
                affinity=request.headers.get("x-session-affinity"),
                after=submitted[0] if i else None,
                **image_args,
            )
            submitted.append(choice_id)
    except BaseException as e:
        for choice_id in submitted:
            engine.cancel(choice_id)
        _raise_submit_error(e, body, chat)
    responder = Responder(
        state,
        request,
        engine,
        request_id,
        choice_ids,
        outputs,
        body.model,
        chat,
        plan,
        logprobs=logprobs,
        echo=echo,
        prompt_ids=prompt_ids,
        token_ids=body.return_token_ids,
    )
    request.state.responder = responder  # for the access log's line, written when the response has gone
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            responder.sse(include_usage), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    response = await responder.whole()
    if response is None:  # nobody is listening any more
        return JSONResponse({}, status_code=499)
    if "error" in response:
        raise APIError(503 if state.draining else 500, response["error"], kind="server_error")
    return response


def _raise_submit_error(e: BaseException, body: SamplingFields, chat: bool):
    """The HTTP error for an engine that refused a request."""
    if isinstance(e, QueueFull):
        raise APIError(
            429, str(e), kind="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(e, EngineStopped):  # not the client's fault: the server is down until restarted
        raise APIError(503, str(e), kind="server_error", code="engine_stopped")
    if isinstance(e, RequestError):
        raise _request_error(e, body, chat)
    if isinstance(e, JfireError):
        raise APIError(400, str(e))
    raise e


def _request_error(e: RequestError, body: SamplingFields, chat: bool) -> APIError:
    """The 400 for a request that can never run, naming the field as the client sent it."""
    message, param = str(e), e.param
    if param == "prompt" and chat:  # a chat's prompt is its messages
        param = "messages"
    elif param == "max_tokens" and chat and getattr(body, "max_completion_tokens", None):
        message, param = message.replace("max_tokens", "max_completion_tokens"), "max_completion_tokens"
    elif param == "response_format" and isinstance(body, ChatCompletionRequest) and tools_constrained(body):
        message, param = "tools" + message.removeprefix("response_format"), "tools"  # the grammar is the tools'
    return APIError(400, message, param=param, code=e.code)


# -- errors and auth -------------------------------------------------------------------------


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return APIError(400, "the request body is not valid JSON", code="invalid_json").response()
        part = _content_part_error(errors)
        if part is not None:
            return APIError(400, part[1], param=part[0], code="invalid_value").response()
        param = _param_of(first.get("loc", ()))
        if first.get("type") == "missing" and param is None:
            message = "the request body is empty; send a JSON object with the request's fields"
        elif first.get("type") == "missing":
            message = f"missing required field '{param}'"
        elif first.get("type") == "extra_forbidden":
            message = f"unknown field '{param}': this endpoint does not take it (see /openapi.json)"
        elif first.get("type") == "model_attributes_type" and param is not None:
            message = f"{param} must be a JSON object"
        elif first.get("type") == "model_attributes_type" and not _is_json(request.headers.get("content-type")):
            # FastAPI reads a body as JSON only when its Content-Type says so.
            message = "send the request body as JSON, with 'Content-Type: application/json'"
        elif first.get("type") == "model_attributes_type":
            message = "the request body must be a JSON object"
        elif _is_union_error(first.get("loc", ())):
            message = f"{param}: {_field_description(request, param) or 'invalid value'}"
        else:
            # pydantic prefixes errors raised in validators with "Value error, ". A check of
            # several fields together (a model validator) names its field first: "field: ...".
            detail = first.get("msg", "invalid request").removeprefix("Value error, ")
            named = re.match(r"([a-z_]+): (.*)", detail, re.S)
            if first.get("type") == "value_error" and named:
                param = f"{param}.{named.group(1)}" if param else named.group(1)
                detail = named.group(2)
            message = f"{param + ': ' if param else ''}{detail}"
        return APIError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind=kind, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", kind="server_error").response()


# The middlewares below are plain ASGI, not Starlette's BaseHTTPMiddleware: that one hands the
# endpoint a `receive` of its own, through which `request.is_disconnected()` never sees a
# client that left while a non-streaming response was still being generated.


class _ASGIMiddleware:
    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.refuse(scope)
        if refused is not None:
            return await refused(scope, receive, send)
        await self.app(scope, receive, self.wrap_send(scope, send))

    def refuse(self, scope):
        """A response to send instead of calling the app, or None."""
        return None

    def wrap_send(self, scope, send):
        return send


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class _BodyLimit(_ASGIMiddleware):
    """413 for a body whose declared length is over the limit, before any of it is read; 411
    for a POST that declares no length (a chunked body could not be bounded before reading)."""

    def refuse(self, scope):
        limit = self.state.max_body_bytes
        length = _header(scope, b"content-length")
        if scope["method"] == "POST" and (length is None or not length.isdigit()):
            return APIError(
                411, "send the request body with a Content-Length header", code="length_required"
            ).response()
        if length is not None and length.isdigit() and int(length) > limit:
            return APIError(
                413,
                f"the request body is larger than {limit} bytes; send a shorter prompt or smaller images",
                code="body_too_large",
            ).response()
        return None


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions", "/v1/models": "models"}


class _RequestCounter(_ASGIMiddleware):
    """Counts every API response by endpoint and status, errors included."""

    def wrap_send(self, scope, send):
        endpoint = ENDPOINTS.get(scope["path"])
        if endpoint is None:
            return send

        async def counted(message):
            if message["type"] == "http.response.start":
                self.state.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        return counted


class _BearerAuth(_ASGIMiddleware):
    """Every endpoint but /health needs `Authorization: Bearer <key>`, one of the server's keys."""

    def refuse(self, scope):
        if scope["path"] == "/health":
            return None
        if not api_keys.matches(_header(scope, b"authorization"), self.state.api_keys):
            return APIError(
                401,
                "missing or wrong API key; send 'Authorization: Bearer <key>'",
                kind="authentication_error",
                code="invalid_api_key",
            ).response()
        return None


def _sees_details(state: ServerState, authorization: str | None) -> bool:
    """Whether a /health caller may see where a deployment's groups are (their control and
    transfer addresses, pids): one bearing a valid API key, or the deployment's control token
    (what the launcher and an operator holding the deployment secret send). Nobody else: an
    open API still keeps its groups' addresses to itself."""
    if state.api_keys and api_keys.matches(authorization, state.api_keys):
        return True
    return state.deployment_secret is not None and state.deployment_secret.check_bearer(authorization)


def _public_health(body: dict) -> dict:
    """/health for anyone: the status and message, and of each group (a frontend's) only its
    role and whether it is alive."""
    groups = body.get("groups")
    if not isinstance(groups, dict):
        return body
    return {**body, "groups": {name: {"role": g.get("role"), "alive": g.get("alive")} for name, g in groups.items()}}


def _is_json(content_type: str | None) -> bool:
    kind = (content_type or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _is_type_tag(part) -> bool:
    # pydantic names the union member it tried ("str", "list[int]", "function-after[...]").
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def _is_union_error(loc) -> bool:
    return any(_is_type_tag(p) for p in loc)


def _param_of(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(parts) or None


def _content_part_error(errors: Sequence[dict]) -> tuple[str, str] | None:
    """(param, message) of an error inside a chat message's content part, or None. pydantic
    reports content's string form failing first; once content is a list, the error inside its
    part says what is wrong. The part's "type" picks its model and sits in the error's location
    after the part's index (`messages, 0, content, list[tagged-union[...]], 1, image_url, ...`)."""
    first = [p for p in (errors[0].get("loc", ()) if errors else ()) if p != "body"]
    for error in errors:
        loc = [p for p in error.get("loc", ()) if p != "body"]
        at = next((k for k, p in enumerate(loc) if isinstance(p, str) and p.startswith("list[tagged-union[")), None)
        if at is None or at + 1 >= len(loc) or first[:at] != loc[:at]:  # only the first error's field
            continue
        param = ".".join(str(p) for p in [*loc[:at], loc[at + 1], *loc[at + 3 :]])
        kind = error.get("type")
        if kind == "union_tag_invalid":
            tag = (error.get("ctx") or {}).get("tag")
            return param, f"{param}: content parts of type {tag!r} are not taken; {CONTENT_PARTS}"
        if kind == "union_tag_not_found":
            return param, f'{param}: a content part names its "type"; {CONTENT_PARTS}'
        if kind == "model_attributes_type":
            return param, f"{param}: a content part is a JSON object; {CONTENT_PARTS}"
        if kind == "missing":
            return param, f"missing required field '{param}'"
        if kind == "extra_forbidden":
            return param, f"unknown field '{param}': this endpoint does not take it (see /openapi.json)"
        return param, f"{param}: {error.get('msg', 'invalid value').removeprefix('Value error, ')}"
    return None


CONTENT_PARTS = (
    'send {"type": "text", "text": ...} parts, and {"type": "image_url", "image_url": {"url": ...}} parts '
    "in user messages to a model that takes images"
)


def _field_description(request: Request, param: str | None) -> str | None:
    schemas = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    model = schemas.get(request.url.path)
    field = model.model_fields.get((param or "").split(".")[0]) if model else None
    return field.description if field else None
