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
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from trtspec.errors import RequestError
from trtspec.openai.schemas import ChatBody, CompletionBody
from trtspec.openai.triton import Generation, Piece, TritonText

CONTROL_SUFFIX = "-target-only"


@dataclass(frozen=True)
class FrontSettings:
    model: str  # the spec's name
    max_seq_len: int
    created: int


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def create_app(backend: TritonText, tokenizer, settings: FrontSettings) -> FastAPI:
    app = FastAPI(title="trtspec OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    front = _Front(backend, tokenizer, settings)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return JSONResponse(error_body(err.message, err.kind, err.param, err.code), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        if first.get("type") == "extra_forbidden":
            message = f"{where} is not supported by trtspec; leave it out"
        return JSONResponse(error_body(message, "invalid_request_error", where or None), status_code=400)

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
    async def completions(body: CompletionBody):
        prompt = _checked(body.check)
        g = front.generation(body, prompt, chat=False)
        return await front.answer(body, g, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        messages = _checked(body.check)
        g = front.generation(body, front.render(messages), chat=True)
        return await front.answer(body, g, chat=True)

    return app


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

    def generation(self, body, text: str, chat: bool) -> Generation:
        control = self.control(body.model)
        n_prompt = len(self.tokenizer(text, add_special_tokens=True)["input_ids"])
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
        return Generation(
            text=text,
            max_tokens=limit,
            stop=_checked(body.stops),
            num_draft_tokens=body.num_draft_tokens,
            control=control,
            sampling=body.sampling(),
            processing=body.processing(),
            log_probs=body.wants_log_probs(),
        )

    async def answer(self, body, g: Generation, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            events = self.events(body, g, chat, rid, created)
            first = await anext(events)  # errors before the first byte become an HTTP error
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream")
        try:
            # n choices: n requests at once, choice i sampling with seed + i (greedy: all alike)
            pieces = await asyncio.gather(*(self.backend.complete(_nth(g, i)) for i in range(body.n)))
        except RequestError as err:
            raise ApiError(400, str(err)) from None
        except RuntimeError as err:
            raise ApiError(500, str(err), kind="server_error") from None
        choices = []
        for i, piece in enumerate(pieces):
            text, stopped = _cut_at_stop(piece.text, g.stop)
            choice = {"index": i, "finish_reason": "stop" if stopped else _finish(piece), "logprobs": None}
            if g.log_probs:
                choice["logprobs"] = self.log_probs(piece, text, chat)
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

    def log_probs(self, piece: Piece, text: str, chat: bool) -> dict:
        """OpenAI's logprobs object for the tokens of ``text`` (the answer, cut at a stop
        string): each token's text, its log prob under the target; no top alternatives."""
        ids, lps = piece.token_ids or [], piece.log_probs or []
        tokens, offsets, at = [], [], 0
        for n in range(1, len(ids) + 1):
            if at >= len(text) and n > 1:
                break  # past the stop cut
            upto = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            # A token that ends inside a character adds no text; the character comes with the
            # token that completes it (as streamed text holds it back).
            end = at if upto.endswith("\ufffd") and n < len(ids) else min(len(upto), len(text))
            tokens.append(text[at:end])
            offsets.append(at)
            at = max(at, end)
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

        try:
            pieces = self.backend.stream(g)
            first = await anext(pieces)
        except RequestError as err:
            raise ApiError(400, str(err)) from None
        except RuntimeError as err:
            raise ApiError(500, str(err), kind="server_error") from None
        if chat:
            yield chunk("", None, role=True)
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
                    yield chunk(cut[sent:end], None)
                    sent = end
                if stopped or piece.final:
                    break
                piece = await anext(pieces)
        except (RequestError, RuntimeError) as err:  # mid-stream: an error event, then done
            yield f"data: {json.dumps(error_body(str(err), 'server_error'))}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return
        finally:
            await pieces.aclose()
        finish = "stop" if stopped else _finish(last)
        yield chunk(None, finish)
        if body.include_usage():
            yield chunk(None, None, usage=_usage(last) if last.final else None)
        yield b"data: [DONE]\n\n"


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
