"""Request bodies of the OpenAI routes, with OpenAI's field names, validated strictly (wrong types are 400s).

The models are built per app by `request_models(max_tokens_limit)` so that the operator's cap on `max_tokens`
is part of the published OpenAPI schema (clients and fuzzers see the real bound). Unknown fields are refused,
as OpenAI refuses them; accepted-but-unsupported OpenAI fields only accept their neutral value.
"""

# (no `from __future__ import annotations`: FastAPI and pydantic read these annotations at runtime)

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from oval_edge.runtime.engine.sampling import MAX_STOP_STRINGS

MAX_TOP_K = 1_000_000  # larger than any vocabulary; 0 = off


def _valid_unicode(text: str) -> str:
    # JSON may carry "\ud800" (a lone surrogate): valid JSON, but not text a tokenizer can take.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains an unpaired UTF-16 surrogate at character {exc.start}; send valid Unicode text")
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
PromptText = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
StopString = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_valid_unicode)]


def _integral(value):
    # JSON Schema counts 1.0 as an integer; accept it as 1, but not 1.5 and not the string "1".
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[Int, Field(ge=0, le=2**31 - 1)]
Probability = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
# Penalties are not implemented: the schema publishes 0 as the only value, the validator explains why.
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False, json_schema_extra={"minimum": 0, "maximum": 0})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Text, list[TextPart], None] = None
    name: Annotated[str, Field(max_length=64)] | None = None

    def for_template(self) -> dict:
        """The dict the model's chat template takes (developer is OpenAI's new name for system)."""
        if isinstance(self.content, list):
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """Fields both routes share. Extensions beyond OpenAI (as vLLM names them): top_k, ignore_eos."""

    model: Annotated[str, Field(max_length=256)] | None = Field(None, description="the served model id (or omit)")
    temperature: Temperature | None = Field(None, description="0 = greedy; default 1.0 as in the OpenAI API")
    top_p: Probability | None = None
    top_k: Annotated[Int, Field(ge=0, le=MAX_TOP_K)] | None = Field(None, description="extension; 0 = off")
    n: Literal[1] | None = Field(None, description="only one choice per request is supported")
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None] = None
    seed: Annotated[Int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-sequence token")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value):
        if value not in (None, 0, 0.0):
            raise ValueError("penalties are not supported by this server; omit it or send 0")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def request_models(max_tokens_limit: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """(ChatCompletionRequest, CompletionRequest) with max_tokens bounded by the server's cap."""
    MaxTokens = Annotated[Int, Field(ge=1, le=max_tokens_limit)]

    class ChatCompletionRequest(_Generation):
        messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
            ..., description="at least one message; roles system, developer, user, assistant; text content only"
        )
        max_tokens: MaxTokens | None = None
        max_completion_tokens: MaxTokens | None = Field(None, description="newer OpenAI name of max_tokens")
        logprobs: Literal[False] | None = Field(None, description="log probabilities are not supported")
        top_logprobs: Literal[0] | None = None

        @property
        def limit_tokens(self) -> int | None:
            return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    class CompletionRequest(_Generation):
        prompt: Union[
            PromptText,
            Annotated[list[TokenId], Field(min_length=1)],
            Annotated[list[PromptText], Field(min_length=1, max_length=1)],
        ] = Field(..., description="text, or a list of token ids, or a list with exactly one text")
        max_tokens: MaxTokens | None = Field(None, description="default 16, as in the OpenAI API")
        echo: Literal[False] | None = Field(None, description="echo is not supported")
        suffix: None = Field(None, description="suffix is not supported")
        best_of: Literal[1] | None = None
        logprobs: Literal[0] | None = Field(None, description="log probabilities are not supported")

        @property
        def limit_tokens(self) -> int | None:
            return self.max_tokens

    return ChatCompletionRequest, CompletionRequest
