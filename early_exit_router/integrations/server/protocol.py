"""The OpenAI-compatible request bodies the server accepts, validated with pydantic, and its error bodies.

Fields the OpenAI API defines but this server does not implement (several choices, log-probabilities, penalties,
echo, tools) are refused with a 400 that names them, rather than silently ignored. `early_exit` is this server's
extension: per-request routing (mode and thresholds), passed by the `openai` client as `extra_body`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
)


class EarlyExitOptions(BaseModel):
    """Per-request routing: the mode, and any of `REQUEST_ROUTING_FIELDS`."""

    model_config = ConfigDict(extra="forbid")

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

    def overrides(self) -> dict[str, Any]:
        """The router fields this request sets."""
        return {name: getattr(self, name) for name in REQUEST_ROUTING_FIELDS if getattr(self, name) is not None}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")  # unknown fields are checked in `unsupported`, not by pydantic

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: Any = None
    early_exit: EarlyExitOptions | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def unsupported(self) -> list[str]:
        """Set fields this server does not implement (a 400 names them)."""
        names = list(self.model_extra or {})
        if self.n != 1:
            names.append("n")
        if self.logprobs not in (None, False):
            names.append("logprobs")
        if self.presence_penalty or self.frequency_penalty:
            names.append("presence_penalty/frequency_penalty")
        return names


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)  # the OpenAI default for completions
    echo: bool = False

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.echo:
            names.append("echo")
        return names


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The message's text: a string, or its text parts joined (other part types are refused upstream)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content)

    def non_text_parts(self) -> list[str]:
        if isinstance(self.content, str):
            return []
        return [str(part.get("type")) for part in self.content if part.get("type") != "text"]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        names += [f"messages[].content type {t!r}" for m in self.messages for t in m.non_text_parts()]
        return names


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
