"""The OpenAI-compatible request bodies the server accepts, validated with pydantic, and its error bodies.

Fields the OpenAI API defines but this server does not implement (several choices, log-probabilities, penalties,
echo, tools) are refused with a 400 that names them, rather than silently ignored, unless they are null or ask for
nothing (`NOTHING_ASKED`); a null where OpenAI types a field "or null" asks for its default (`NULL_IS_DEFAULT`).
`early_exit` is this server's extension: per-request routing (mode and thresholds), passed by the `openai` client
as `extra_body`.

Types are strict (`max_tokens: "8"` or `use_gate: "yes"` is refused, not coerced), floats must be finite (JSON's
`NaN` and `Infinity` are refused for every float), text must be valid Unicode (a lone surrogate such as `"\\ud800"`
is refused before it reaches the tokenizer), and `seed` must fit a signed 64-bit integer.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

# Router fields a request may set for itself; everything else stays the server's (heads, exits, cost model).
REQUEST_ROUTING_FIELDS = (
    "high_conf_threshold",
    "low_conf_threshold",
    "entropy_threshold",
    "gate_threshold",
    "use_gate",
    "max_pending",
    "ngram_tier",
    "policy",
    "check_fraction",
    "holdback",
)
# Fields this server does not implement, at the values that ask for nothing (SDKs send some of them at every call;
# vLLM's sampling extras at their neutral values): accepted, as null is for any field.
NOTHING_ASKED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "logit_bias": ({},),
    "top_logprobs": (0,),
    "response_format": ({"type": "text"},),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),  # without tools, either asks for nothing
    "store": (False,),
    "repetition_penalty": (1.0,),
    "top_k": (-1, 0),  # vLLM's "all tokens"
    "min_p": (0.0,),
}
# Fields OpenAI types "or null" with a default: null asks for the default (clients that serialize every field send it).
NULL_IS_DEFAULT = ("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "echo")
# Below this temperature, sampling is greedy decoding (as vLLM treats it): dividing logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer, as OpenAI documents `seed` (torch takes no wider)
STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # no coercion of "8" to 8, no NaN or infinity


def _valid_unicode(text: str) -> str:
    """Text the tokenizer can take: JSON may carry a lone surrogate (`"\\ud800"`), which is no character at all."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        raise ValueError(
            f"the text holds a lone surrogate (\\u{ord(bad):04x} at character {error.start}), which is not valid "
            "Unicode: send UTF-8 text, with every \\ud800-\\udbff escape followed by its \\udc00-\\udfff pair"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class EarlyExitOptions(BaseModel):
    """Per-request routing: the mode, and any of `REQUEST_ROUTING_FIELDS`."""

    model_config = ConfigDict(**STRICT, extra="forbid")

    mode: Literal["exit", "verify"] | None = None
    high_conf_threshold: float | None = Field(None, ge=0.0, le=1.0)
    low_conf_threshold: float | None = Field(None, ge=0.0, le=1.0)
    entropy_threshold: float | None = Field(None, ge=0.0)
    gate_threshold: float | None = Field(None, ge=0.0, le=1.0)
    use_gate: bool | None = None
    max_pending: int | None = Field(None, ge=1, le=64)
    ngram_tier: bool | None = None
    policy: Literal["cost", "fixed"] | None = None
    check_fraction: float | None = Field(None, ge=0.0, le=1.0)
    holdback: int | None = Field(None, ge=0, le=64)  # exit mode: tokens streamed before their check (null: none)

    def overrides(self) -> dict[str, Any]:
        """The router fields this request sets."""
        return {name: getattr(self, name) for name in REQUEST_ROUTING_FIELDS if getattr(self, name) is not None}


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


def _asks_nothing(name: str, value: Any) -> bool:
    """Whether `value` is one of `name`'s values that ask for nothing (JSON's true is no 1 here, nor 0 false)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in NOTHING_ASKED.get(name, ()))


class _Common(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(**STRICT, extra="allow")  # unknown fields are checked in `unsupported`, not by pydantic

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: Any = None
    early_exit: EarlyExitOptions | None = None
    null_is_default: ClassVar[tuple[str, ...]] = NULL_IS_DEFAULT

    @model_validator(mode="before")
    @classmethod
    def _nulls_ask_for_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.null_is_default}
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: StreamOptions | None, info: Any) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        # torch's generators take no wider seed: out of range, it would fail inside the worker, not here
        low, high = SEED_RANGE
        if value is not None and not low <= value <= high:
            raise ValueError(f"seed must be a signed 64-bit integer, in [{low}, {high}]; got {value}")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def unsupported(self) -> list[str]:
        """Set fields this server does not implement (a 400 names them)."""
        extra = (self.model_extra or {}).items()
        names = [k for k, v in extra if v is not None and not _asks_nothing(k, v)]
        if self.n != 1:
            names.append("n")
        if self.logprobs is not None and self.logprobs is not False:  # completions' 0 asks for the chosen tokens'
            names.append("logprobs")
        if self.presence_penalty or self.frequency_penalty:
            names.append("presence_penalty/frequency_penalty")
        return names


class CompletionRequest(_Common):
    prompt: Text | list[Text] | list[int]
    max_tokens: int = Field(16, ge=1)  # the OpenAI default for completions, which a null asks for too
    null_is_default: ClassVar[tuple[str, ...]] = (*NULL_IS_DEFAULT, "max_tokens")
    echo: bool = False

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.echo:
            names.append("echo")
        return names


class ContentPart(BaseModel):
    """One part of a message's content: text parts are read, other types are refused (see `unsupported`)."""

    model_config = ConfigDict(**STRICT, extra="allow")

    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(**STRICT, extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[ContentPart]

    @field_validator("content")
    @classmethod
    def _check_text_parts(cls, value: str | list[ContentPart]) -> str | list[ContentPart]:
        if not isinstance(value, str) and any(p.type == "text" and p.text is None for p in value):
            raise ValueError("a content part of type 'text' needs a 'text' string")
        return value

    def text(self) -> str:
        """The message's text: a string, or its text parts one per line, as vLLM joins them for a chat template that
        takes a string (other part types are refused upstream)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content if part.type == "text")

    def non_text_parts(self) -> list[str]:
        if isinstance(self.content, str):
            return []
        return [part.type for part in self.content if part.type != "text"]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        names += [f"messages[].content type {t!r}" for m in self.messages for t in m.non_text_parts()]
        return names


# What a field that takes several shapes takes, for the message when a value matches none of them.
SHAPES = {
    "prompt": "a string, a list of one string, or a list of token ids (integers)",
    "content": "a string or a list of content parts ({'type': 'text', 'text': ...})",
    "stop": "a string or a list of at most 4 strings",
}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
