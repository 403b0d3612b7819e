"""The OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of a trtspec deployment.

  GET  /v1/models                 the speculative model (the spec's name) and its target-only
                                  control (``<name>-target-only``)
  POST /v1/completions            text completion, optionally streamed as server-sent events
  POST /v1/chat/completions       chat completion (the target tokenizer's chat template)

Every generation is one gRPC request to the Triton deployment (openai/triton.py). Greedy
decoding unless the request sends temperature > 0 (then temperature, top_p and seed go to
the deployment's lossless speculative sampler). presence / frequency penalties (and the
trtllm-serve / vLLM extensions repetition_penalty and min_tokens) go to the deployment's logits
processing; logprobs (chosen tokens, unstreamed) come from the target's log probs; n > 1 sends
n requests at once (choice i samples with seed + i). Top-k logprobs, logit_bias, tools... are
refused with an OpenAI-shaped error naming the field. ``usage`` carries the token counts and the speculative
acceptance of that request (``completion_tokens_details.accepted_prediction_tokens`` /
``rejected_prediction_tokens`` are the accepted and rejected draft tokens; ``speculative`` has
the same as trtspec reports them).

Hardening (docs/operations.md, "OpenAI front"): a body over ``max_body_bytes`` is refused
with 413 before it is read, one that has not arrived whole within ``body_timeout_s`` with 408
(a client that sends part of a body and stalls holds nothing for long); tokenizing runs on one worker thread, never on the event loop;
every error, streamed or not, is OpenAI's error object with the status that says why (400
the client's mistake, 404 an unknown model, 408 a body too slow, 413 too large, 503 + Retry-After when the
deployment is full, unloading or unreachable, 504 when it did not answer in time, 500 ours);
a client that disconnects cancels its gRPC calls; with n > 1 one failed call cancels the
others; greedy n > 1 is one call whose answer is repeated (greedy decoding is deterministic).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trtspec.errors import RequestError
from trtspec.openai.keys import DEFAULT_TENANT, ApiKeys
from trtspec.openai.schemas import ChatBody, CompletionBody
from trtspec.openai.triton import DeploymentError, Generation, Piece, TritonText

CONTROL_SUFFIX = "-target-only"
RETRY_AFTER_S = 1  # what a 503 tells the client to wait before retrying
log = logging.getLogger("trtspec.openai")


@dataclass(frozen=True)
class FrontSettings:
    model: str  # the spec's name
    max_seq_len: int
    created: int
    max_body_bytes: int = 0  # 0: default_body_limit(max_seq_len)
    # The most a request body may take to arrive whole, from the request's headers on (408 after).
    body_timeout_s: float = 30.0
    # The deployment reads suffix cache scopes (trtspec's endpoints with suffix drafting): each
    # request is sent in its tenant's scope. False: no scope is sent (nothing would read it).
    suffix_scopes: bool = True

    @property
    def body_limit(self) -> int:
        return self.max_body_bytes or default_body_limit(self.max_seq_len)


def default_body_limit(max_seq_len: int) -> int:
    """1 MiB, or 32 bytes per token of context where that is more: room for any prompt the
    model can hold (a few bytes a token) and the JSON around it, far below what would stall."""
    return max(1 << 20, 32 * max_seq_len)


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_deployment(err: DeploymentError) -> ApiError:
    kind = "invalid_request_error" if err.status == 400 else "server_error"
    code = {503: "service_unavailable", 504: "timeout"}.get(err.status)
    return ApiError(err.status, err.message, kind=kind, code=code)


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 503 else None
    return JSONResponse(error_body(err.message, err.kind, err.param, err.code), status_code=err.status, headers=headers)


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer: its calls were cancelled."""


def _error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape: ours, the deployment's, HTTP's, validation's and
    an unexpected one (logged); a client that went away gets nothing (499)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return error_response(err)

    @app.exception_handler(DeploymentError)
    async def _deployment_error(request: Request, err: DeploymentError):
        return error_response(from_deployment(err))

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, err: _ClientGone):
        return Response(status_code=499)  # nobody is there to read it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return error_response(ApiError(err.status_code, str(err.detail), kind=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):  # a bug: still OpenAI's shape, logged
        log.exception("unexpected error in the OpenAI front")
        return error_response(ApiError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        if first.get("type") == "extra_forbidden":
            message = f"{where} is not supported by trtspec; leave it out"
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)


def create_app(backend: TritonText, tokenizer, settings: FrontSettings, keys: ApiKeys | None = None) -> FastAPI:
    """The app; with ``keys`` every /v1 request needs one of them and is its key's tenant,
    without, every request is the one tenant DEFAULT_TENANT (a single-tenant deployment)."""
    app = FastAPI(title="trtspec OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    front = _Front(backend, tokenizer, settings)
    app.add_middleware(BodyLimit, limit=settings.body_limit, timeout=settings.body_timeout_s)
    if keys is not None:  # outermost: a request without a key is refused before its body is parsed
        app.add_middleware(RequireKey, keys=keys, limit=settings.body_limit)

    _error_handlers(app)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": settings.created, "owned_by": "trtspec"}
                for name in (settings.model, settings.model + CONTROL_SUFFIX)
            ],
        }

    @app.get("/health")
    async def health():
        ready = await backend.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt = _checked(body.check)
        g = await front.generation(body, prompt, chat=False, tenant=_tenant(request))
        return await front.answer(body, g, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        messages = _checked(body.check)
        g = await front.generation(body, await front.tokenized(front.render, messages), chat=True, tenant=_tenant(request))
        return await front.answer(body, g, chat=True, request=request)

    return app


# A refused body the client is still sending is read and dropped, up to this many times the
# limit and for at most this long, before the answer: a connection closed on unread data is
# reset, and the client would see the reset instead of its 413 (nginx's lingering close).
_DRAIN_FACTOR = 16
_DRAIN_S = 5.0


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 (OpenAI's error
    shape) and never kept, whether it declares its length or streams it; one that has not
    arrived whole ``timeout`` seconds after the request began is answered 408 (a partial body,
    a slow-loris client). Either way the connection is closed after the answer."""

    def __init__(self, app, limit: int, timeout: float = 30.0):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _drain(receive, self.limit * _DRAIN_FACTOR)
            return await _refuse(send, self._too_large())
        deadline = asyncio.get_running_loop().time() + self.timeout
        received, whole, refusal, started = 0, False, None, False

        async def limited_receive():
            nonlocal received, whole, refusal
            if whole:  # the body is in: what follows is the client's disconnect, whenever it comes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except TimeoutError:
                refusal = self._too_slow()
                return {"type": "http.disconnect"}  # the app stops reading; its answer is replaced
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if received > self.limit:
                    refusal = self._too_large()
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if refusal is not None:
                return
            started = True
            await send(message)

        await self.app(scope, limited_receive, guarded_send)
        if refusal is not None and not started:
            if refusal.status == 413 and not whole:
                await _drain(receive, self.limit * _DRAIN_FACTOR)
            await _refuse(send, refusal)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body exceeds {self.limit} bytes; send a shorter prompt", code="request_too_large")

    def _too_slow(self) -> ApiError:
        return ApiError(
            408, f"the request body did not arrive whole within {self.timeout:g} s; send it at once", code="request_timeout"
        )


async def _drain(receive, budget: int) -> bool:
    """Read and drop what the client still sends of its body: at most ``budget`` bytes, for at
    most _DRAIN_S seconds. True where the body ended within them (the connection can take the
    next request)."""
    loop = asyncio.get_running_loop()
    deadline, dropped = loop.time() + _DRAIN_S, 0
    while dropped <= budget:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            return False
        if message["type"] != "http.request":
            return False
        if not message.get("more_body", False):
            return True
        dropped += len(message.get("body", b""))
    return False


async def _refuse(send, err: ApiError) -> None:
    """``err`` as the whole answer, and the connection closed after it."""
    response = error_response(err)
    response.headers["Connection"] = "close"
    await response({"type": "http"}, None, send)


class RequireKey:
    """ASGI middleware: every /v1 request carries a valid API key (``Authorization: Bearer
    KEY``) or is answered 401 in OpenAI's error shape, its body never kept: what the client
    sends of it is read and dropped first as a refused body's (``limit`` * _DRAIN_FACTOR bytes,
    _DRAIN_S), and where it did not end within that the connection is closed after the answer.
    The key's tenant goes to the routes as ``request.state.tenant``. /health stays open (a
    probe needs no key)."""

    def __init__(self, app, keys: ApiKeys, limit: int):
        self.app, self.keys, self.limit = app, keys, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        tenant = self.keys.tenant_of(_bearer(scope.get("headers") or []))
        if tenant is None:
            err = ApiError(
                401,
                "the request has no valid API key; send `Authorization: Bearer <key>` with a key this server was given",
                code="invalid_api_key",
            )
            whole = await _drain(receive, self.limit * _DRAIN_FACTOR)
            response = error_response(err)
            response.headers["WWW-Authenticate"] = "Bearer"
            if not whole:
                response.headers["Connection"] = "close"
            return await response({"type": "http"}, None, send)
        scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)


def _bearer(headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (None: none)."""
    value = dict(headers).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _tenant(request: Request) -> str:
    """The request's tenant: its API key's (RequireKey), or the one tenant where there are no keys."""
    return getattr(request.state, "tenant", DEFAULT_TENANT)


def _checked(check):
    try:
        return check()
    except RequestError as err:
        raise ApiError(400, str(err)) from None


class _Front:
    def __init__(self, backend: TritonText, tokenizer, settings: FrontSettings):
        self.backend = backend
        self.tokenizer = tokenizer
        self.s = settings
        # One thread for every tokenizer call: off the event loop (a long prompt must not stall
        # the other requests' streams), and never two at once (fast tokenizers are not
        # thread-safe: "Already borrowed").
        self._tok = ThreadPoolExecutor(1, thread_name_prefix="trtspec-tokenizer")

    async def tokenized(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tok, fn, *args)

    def control(self, model: str) -> bool:
        if model == self.s.model:
            return False
        if model == self.s.model + CONTROL_SUFFIX:
            return True
        raise ApiError(
            404,
            f"model {model!r} does not exist; GET /v1/models lists {self.s.model!r} and {self.s.model + CONTROL_SUFFIX!r}",
            code="model_not_found",
        )

    def render(self, messages: list[dict[str, str]]) -> str:
        """Messages to prompt text through the target's chat template. The deployment encodes
        text with the tokenizer's special tokens, so a template that writes them as text (BOS)
        is stripped of that prefix; anything that would not re-encode to the template's ids is
        refused rather than sent differently."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        for candidate in (text, text.removeprefix(tok.bos_token or "")):
            if list(tok(candidate, add_special_tokens=True)["input_ids"]) == want:
                return candidate
        raise ApiError(
            400, "these messages do not re-encode to the chat template's tokens; send them as a single prompt to /v1/completions"
        )

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    async def generation(self, body, text: str, chat: bool, tenant: str = DEFAULT_TENANT) -> Generation:
        control = self.control(body.model)
        n_prompt = await self.tokenized(self.count_tokens, text)
        room = self.s.max_seq_len - n_prompt
        if room < 1:
            raise ApiError(
                400,
                f"the prompt has {n_prompt} tokens; this model holds {self.s.max_seq_len} in all",
                code="context_length_exceeded",
            )
        # Chat without a limit runs to the end of the context, as OpenAI's; a limit past it is
        # refused by the deployment with its own message.
        limit = body.limit(room) if chat else (body.max_tokens or 16)
        scope, cached = _checked(lambda: body.cache_scope(tenant))
        if not self.s.suffix_scopes:
            scope = None  # the deployment reads no scope: none is sent
        return Generation(
            text=text,
            max_tokens=limit,
            stop=_checked(body.stops),
            num_draft_tokens=body.num_draft_tokens,
            control=control,
            sampling=body.sampling(),
            processing=body.processing(),
            log_probs=body.wants_log_probs(),
            ignore_eos=body.ignore_eos,
            suffix_cache_scope=scope,
            suffix_cache=cached,
            capture=body.capture,
        )

    async def answer(self, body, g: Generation, chat: bool, request: Request | None = None):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            events = self.events(body, g, chat, rid, created)
            first = await anext(events)  # errors before the first byte become an HTTP error
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        pieces = await _unless_disconnected(request, self.choices(g, body.n))
        choices = []
        for i, piece in enumerate(pieces):
            text, stopped = _cut_at_stop(piece.text, g.stop)
            choice = {"index": i, "finish_reason": "stop" if stopped else _finish(piece), "logprobs": None}
            if g.log_probs:
                choice["logprobs"] = await self.tokenized(self.log_probs, piece, text, chat)
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        usage = _usage(pieces[0])
        if len(pieces) > 1:
            usage = _usage_of_all(pieces)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": body.model,
            "choices": choices,
            "usage": usage,
        }

    async def choices(self, g: Generation, n: int) -> list[Piece]:
        """n answers. Sampling: n calls at once, choice i with seed + i; the first to fail
        cancels the others. Greedy: one call, its answer n times."""
        if g.sampling is None:
            piece = await self.backend.complete(g)
            return [piece] * n
        tasks = [asyncio.ensure_future(self.backend.complete(_nth(g, i))) for i in range(n)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t for t in tasks if t in done and not t.cancelled() and t.exception()), None)
            if failed is not None:
                raise failed.exception()
            return [t.result() for t in tasks]
        finally:  # one failed, or the caller was cancelled (client gone): the others end too
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def log_probs(self, piece: Piece, text: str, chat: bool) -> dict:
        """OpenAI's logprobs object for the tokens of ``text`` (the answer, cut at a stop
        string): each token's text, its log prob under the target; no top alternatives."""
        lps = piece.log_probs or []
        tokens, offsets = token_texts(self.tokenizer, piece.token_ids or [], text)
        lps = lps[: len(tokens)]
        if chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []} for t, lp in zip(tokens, lps)
                ],
                "refusal": None,
            }
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

    async def events(self, body, g: Generation, chat: bool, rid: str, created: int) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, usage: dict | None = None, role: bool = False) -> bytes:
            choices = []
            if delta is not None or finish is not None:
                c = {"index": 0, "finish_reason": finish, "logprobs": None}
                if chat:
                    c["delta"] = ({"role": "assistant"} if role else {}) | ({"content": delta} if delta is not None else {})
                else:
                    c["text"] = delta or ""
                choices.append(c)
            event = {"id": rid, "object": kind, "created": created, "model": body.model, "choices": choices}
            if usage is not None:
                event["usage"] = usage
            return f"data: {json.dumps(event)}\n\n".encode()

        continuous = body.continuous_usage()
        pieces = self.backend.stream(g)
        try:
            first = await anext(pieces)
        except BaseException:
            await pieces.aclose()
            raise  # before the first byte: an HTTP error (DeploymentError -> its status)
        if chat:
            yield chunk("", None, role=True, usage=_running_usage(first) if continuous else None)
        # Hold back text that may be the start of a stop string until it cannot be.
        hold = max((len(s) for s in g.stop), default=1) - 1
        text, sent, last = "", 0, first
        try:
            piece = first
            while True:
                text += piece.text
                last = piece
                cut, stopped = _cut_at_stop(text, g.stop)
                end = len(cut) if (stopped or piece.final) else max(sent, len(text) - hold)
                if end > sent:
                    yield chunk(cut[sent:end], None, usage=_running_usage(piece) if continuous else None)
                    sent = end
                if stopped or piece.final:
                    break
                piece = await anext(pieces)
        except DeploymentError as err:  # mid-stream: an error event in OpenAI's shape, then done
            api = from_deployment(err)
            yield f"data: {json.dumps(error_body(api.message, api.kind, None, api.code or api.status))}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return
        finally:
            await pieces.aclose()
        finish = "stop" if stopped else _finish(last)
        final_usage = _usage(last) if last.final else _running_usage(last)
        yield chunk(None, finish, usage=final_usage if continuous else None)
        if body.include_usage():
            yield chunk(None, None, usage=final_usage)
        yield b"data: [DONE]\n\n"


def token_texts(tokenizer, ids: list[int], text: str) -> tuple[list[str], list[int]]:
    """Each token's piece of ``text`` (the decoded answer, maybe cut at a stop string) and its
    offset, decoding incrementally: each step decodes only the tokens since the last complete
    character, plus the token before them (so a tokenizer that drops a leading space at the
    start of a decode cannot shift the text), never the whole prefix again: O(n), not O(n^2).

    A token that ends inside a character adds no text; the character comes with the token
    that completes it (as streamed text holds it back)."""
    tokens, offsets, at = [], [], 0
    done = 0  # decoded text length of ids[:read]
    prefix, read = 0, 0  # ids[prefix:read] is the context window already turned into text
    for n in range(1, len(ids) + 1):
        if at >= len(text) and n > 1:
            break  # past the stop cut
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True) if read > prefix else ""
        window = tokenizer.decode(ids[prefix:n], skip_special_tokens=True)
        upto = done + len(window) - len(before)  # the length decode(ids[:n]) would have
        if window.endswith("\ufffd") and n < len(ids):
            end = at  # an unfinished character: keep decoding from the same window
        else:
            end = min(upto, len(text))
            done, prefix, read = upto, max(read, n - 1), n
        tokens.append(text[at:end])
        offsets.append(at)
        at = max(at, end)
    return tokens, offsets


async def _unless_disconnected(request: Request | None, work):
    """Await ``work``; if the HTTP client disconnects first, cancel it (its gRPC calls end
    with it) and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    if request is None:
        return await task

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise _ClientGone()
    return task.result()


def _running_usage(piece: Piece) -> dict:
    """vLLM's continuous usage: the counts so far, in every chunk."""
    return {
        "prompt_tokens": piece.prompt_tokens,
        "completion_tokens": piece.completion_tokens,
        "total_tokens": piece.prompt_tokens + piece.completion_tokens,
    }


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for item in rest:
        yield item


def _cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """Text up to the first stop string (excluded, as OpenAI returns it) and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def _nth(g: Generation, i: int) -> Generation:
    """Choice i of n: sampling seed + i, as TensorRT-LLM's child sequences draw."""
    if i == 0 or g.sampling is None:
        return g
    temperature, top_p, seed = g.sampling
    return replace(g, sampling=(temperature, top_p, (seed + i) % 2**63))


def _usage_of_all(pieces: list[Piece]) -> dict:
    """One prompt, n completions: completion tokens and draft counts summed over choices."""
    total = Piece(
        "",
        True,
        prompt_tokens=pieces[0].prompt_tokens,
        completion_tokens=sum(p.completion_tokens for p in pieces),
        draft_tokens=sum(p.draft_tokens for p in pieces),
        accepted_draft_tokens=sum(p.accepted_draft_tokens for p in pieces),
    )
    total.acceptance_rate = total.accepted_draft_tokens / total.draft_tokens if total.draft_tokens else 0.0
    return _usage(total)


def _finish(piece: Piece) -> str:
    return "length" if piece.finish_reason == "length" else "stop"


def _usage(piece: Piece) -> dict:
    rejected = piece.draft_tokens - piece.accepted_draft_tokens
    return {
        "prompt_tokens": piece.prompt_tokens,
        "completion_tokens": piece.completion_tokens,
        "total_tokens": piece.prompt_tokens + piece.completion_tokens,
        "completion_tokens_details": {
            "accepted_prediction_tokens": piece.accepted_draft_tokens,
            "rejected_prediction_tokens": rejected,
        },
        "speculative": {
            "draft_tokens": piece.draft_tokens,
            "accepted_draft_tokens": piece.accepted_draft_tokens,
            "acceptance_rate": piece.acceptance_rate,
        },
    }
