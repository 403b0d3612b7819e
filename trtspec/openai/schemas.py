"""OpenAI request bodies (the fields of /v1/completions and /v1/chat/completions) and what
trtspec does with each: used, or refused by name. Unknown fields are refused too (extra="forbid"), so nothing is silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trtspec.errors import RequestError
from trtspec.speculative.requests import MAX_SCOPE_BYTES, check_scope
from trtspec.triton.request import INT32_MAX  # counts travel as int32 tensors: refused here beyond it


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    # Extensions trtllm-serve and vLLM accept too (TensorRT-LLM's SamplingParams names).
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    # vLLM / SGLang / trtllm-serve extension: do not stop at the end token, generate exactly
    # max_tokens (the end token is then a token like any other); fixed-length benchmarks send it.
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    # OpenAI's end-user id: narrows the scope of suffix decoding's cache of earlier responses
    # the request reads and feeds to tenant/user, inside its API key's tenant (never beyond it).
    user: str | None = None
    # trtspec: draft length for this request (the deployment's default when absent)
    num_draft_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    # trtspec: false keeps the request out of suffix decoding's cache (neither read nor fed,
    # whatever user says)
    suffix_cache: bool = True
    # trtspec: false keeps the request out of serve.capture (docs/capture.md)
    capture: bool = True

    def cache_scope(self, tenant: str) -> tuple[str | None, bool]:
        """(suffix_cache_scope, suffix_cache) as the deployment takes them: the tenant's scope,
        narrowed to tenant/user where the body names a user (checked to fit the scope's
        MAX_SCOPE_BYTES with the tenant); no scope where suffix_cache is false."""
        if not self.suffix_cache:
            return None, False
        user = check_scope(self.user, "user", MAX_SCOPE_BYTES - len(tenant.encode()) - 1)
        return (f"{tenant}/{user}" if user else tenant), True

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise RequestError("stop strings must not be empty")
        if len(stops) > 4:
            raise RequestError(f"stop takes at most 4 strings; got {len(stops)}")
        return tuple(stops)

    def sampling(self) -> tuple[float, float, int] | None:
        """(temperature, top_p, seed) when the request samples, None for greedy decoding.
        OpenAI's default temperature is 1; trtspec's is 0 (greedy, what verify certifies),
        so a request samples only when it sends temperature > 0."""
        if not self.temperature:
            return None
        return (self.temperature, self.top_p if self.top_p is not None else 1.0, self.seed or 0)

    def processing(self) -> tuple[tuple[str, float], ...]:
        """The deployment's logits-processing inputs (upstream BLS names) this body asks for.
        Penalties count prompt tokens too, as TensorRT-LLM (and so trtllm-serve) applies them."""
        out = []
        if self.presence_penalty:
            out.append(("presence_penalty", self.presence_penalty))
        if self.frequency_penalty:
            out.append(("frequency_penalty", self.frequency_penalty))
        if self.repetition_penalty is not None and self.repetition_penalty != 1:
            out.append(("repetition_penalty", self.repetition_penalty))
        if self.min_tokens:
            out.append(("min_tokens", self.min_tokens))
        return tuple(out)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage", False))

    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage (counts so far) in every chunk."""
        return bool((self.stream_options or {}).get("continuous_usage_stats", False))

    def check_common(self) -> None:
        """Refuse what trtspec does not implement, naming the field."""
        if self.n > 1 and self.stream:
            raise RequestError(f"n={self.n} with stream is not supported by trtspec; send n 1 to stream, or stream false")
        if self.n > 16:
            raise RequestError(f"n={self.n} is more than trtspec answers at once (16); send fewer")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must be in 0..2**63-1 (got {self.seed})")
        if self.logit_bias:
            raise RequestError(
                "logit_bias (token ids) is not supported by trtspec; the Triton endpoints take "
                "embedding_bias_words / embedding_bias_weights (text) instead; leave it out here"
            )
        if self.wants_log_probs() and self.stream:
            raise RequestError("logprobs with stream is not supported by trtspec; send stream false to get logprobs")
        if self.stream_options and not self.stream:
            raise RequestError("stream_options needs stream true")
        unknown = set(self.stream_options or {}) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise RequestError(
                f"stream_options.{sorted(unknown)[0]} is not supported; only include_usage and continuous_usage_stats are"
            )


class CompletionBody(_Body):
    prompt: str | list[str]
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def wants_log_probs(self) -> bool:
        return self.logprobs is not None

    def check(self) -> str:
        self.check_common()
        if self.echo:
            raise RequestError("echo is not supported by trtspec; send echo false")
        if self.logprobs:
            raise RequestError(
                f"logprobs={self.logprobs} asks for top alternatives, which trtspec does not return; "
                "send logprobs 0 for the chosen tokens' log probs"
            )
        if self.best_of not in (None, 1):
            raise RequestError("best_of is not supported: greedy decoding has one answer; send 1 or leave it out")
        if self.suffix:
            raise RequestError("suffix (insertion) is not supported by trtspec; leave it out")
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(prompts) != 1:
            raise RequestError(f"send one prompt per request (got {len(prompts)}); batch by sending requests concurrently")
        if not prompts[0].strip():
            raise RequestError("prompt is empty; send the prompt text")
        return prompts[0]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise RequestError(f"message content of type {part.get('type')!r} is not supported; send text parts")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def wants_log_probs(self) -> bool:
        return self.logprobs

    def check(self) -> list[dict[str, str]]:
        self.check_common()
        if self.top_logprobs:
            raise RequestError(
                "top_logprobs asks for top alternatives, which trtspec does not return; send 0 or leave it out "
                "(logprobs true gives the chosen tokens' log probs)"
            )
        if self.tools or self.tool_choice not in (None, "none"):
            raise RequestError("tool calling (tools / tool_choice) is not supported by trtspec; leave it out")
        if self.response_format and self.response_format.get("type") != "text":
            raise RequestError("response_format other than text (structured output) is not supported by trtspec")
        if self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens differ; send one of them")
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default
