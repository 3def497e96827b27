"""Request bodies of the OpenAI routes, with OpenAI's field names, validated strictly (wrong types are 400s).

The models are built per app by `request_models(max_tokens_limit)` so that the operator's cap on `max_tokens`
is part of the published OpenAPI schema (clients and fuzzers see the real bound). Unknown fields are refused,
as OpenAI refuses them; accepted-but-unsupported OpenAI fields only accept their neutral value.
"""

# (no `from __future__ import annotations`: FastAPI and pydantic read these annotations at runtime)

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from oval_edge.runtime.engine.sampling import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS

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
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
MAX_CHOICES = 8  # n: each choice is a row of the batch; more would crowd out other clients
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
JsonSchema = Union[dict, bool]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: Text = Field(..., description="the arguments as a JSON text (an object)")


class ToolCall(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Annotated[str, Field(max_length=64)] | None = None
    # Which role may carry which field is checked per request (tool_calls.check_messages), so that the 400 names
    # the field itself (messages[i].tool_call_id); a model validator here could only name the message.
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages only: the calls it made")
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None, description="tool messages only (required there): the id of the call this message answers")

    def for_template(self) -> dict:
        """The dict the model's chat template takes (developer is OpenAI's new name for system); tool calls carry
        their arguments parsed, as transformers' chat templates expect."""
        if isinstance(self.content, list):
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str):
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: Text | None = None
    schema_: JsonSchema = Field(default_factory=dict, alias="schema", description="a JSON Schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object: {\"name\": ..., \"schema\": {...}}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only allowed with type 'json_schema', not '{self.type}'")
        return self


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    parameters: JsonSchema = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """Fields both routes share. Extensions beyond OpenAI (as vLLM names them): top_k, min_p, repetition_penalty,
    stop_token_ids, ignore_eos."""

    model: Annotated[str, Field(max_length=256)] | None = Field(None, description="the served model id (or omit)")
    temperature: Temperature | None = Field(None, description="0 = greedy; default 1.0 as in the OpenAI API")
    top_p: Probability | None = None
    top_k: Annotated[Int, Field(ge=0, le=MAX_TOP_K)] | None = Field(None, description="extension; 0 = off")
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = Field(
        None, description="extension: drop tokens below min_p x the top token's probability")
    n: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] | None = Field(None, description="choices; they share the prompt")
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description="extension: token ids that end the completion")
    seed: Annotated[Int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = Field(None, description="[-2, 2], over the generated tokens")
    frequency_penalty: Penalty | None = Field(None, description="[-2, 2], per occurrence in the generated tokens")
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)] | None = Field(
        None, description="extension (vLLM's): over prompt + output; 1 = off, above 1 discourages repeats")
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                               Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")
    response_format: ResponseFormat | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-sequence token")
    # SGLang's router (sglang-router) re-serializes each request with its own extensions at their defaults; each is
    # accepted only at the value that describes what this server does anyway.
    no_stop_trim: Literal[False] | None = Field(None, description="SGLang extension; only false (stops are trimmed)")
    skip_special_tokens: Literal[True] | None = Field(None, description="SGLang extension; only true")
    return_hidden_states: Literal[False] | None = Field(None, description="SGLang extension; only false")

    def field_problems(self) -> tuple[str, str] | None:
        return None

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
        logprobs: bool | None = Field(None, description="return each output token's log probability")
        top_logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
            None, description="with logprobs: the most likely alternatives per token")
        tools: Annotated[list[Tool], Field(max_length=128)] | None = None
        tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = None
        parallel_tool_calls: bool | None = None
        # More of SGLang's router defaults (see _Generation); the reasoning ones act only with a reasoning parser.
        continue_final_message: Literal[False] | None = Field(None, description="SGLang extension; only false")
        separate_reasoning: Literal[True] | None = Field(None, description="SGLang extension; only true")
        stream_reasoning: Literal[True] | None = Field(None, description="SGLang extension; only true")

        def field_problems(self) -> tuple[str, str] | None:
            """(param, message) for a combination of fields that cannot be served, else None (the route answers it
            with a 400 naming the param; a pydantic model validator could not name one)."""
            if self.top_logprobs is not None and not self.logprobs:
                return "top_logprobs", "top_logprobs needs logprobs: true"
            if isinstance(self.tool_choice, NamedToolChoice):
                names = [t.function.name for t in self.tools or ()]
                if self.tool_choice.function.name not in names:
                    return "tool_choice", (f"tool_choice names the function '{self.tool_choice.function.name}', "
                                           f"which is not among tools ({', '.join(names) or 'none given'})")
            elif self.tool_choice == "required" and not self.tools:
                return "tool_choice", "tool_choice 'required' needs at least one entry in tools"
            if self.tools and self.response_format is not None and self.response_format.type != "text":
                return "response_format", "response_format and tools cannot be combined; send one of them"
            return None

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
        best_of: Annotated[Int, Field(ge=1, le=MAX_CHOICES)] | None = Field(
            None, description="only 1: ranking candidates server-side is not supported (use n and pick)")
        logprobs: Annotated[Int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = Field(
            None, description="return each token's log probability and this many top alternatives")

        @field_validator("best_of")
        @classmethod
        def _best_of_one(cls, value):
            if value not in (None, 1):
                raise ValueError("best_of > 1 is not supported by this server (it does not rank candidates); send n "
                                 "with logprobs and pick on the client")
            return value

        @property
        def limit_tokens(self) -> int | None:
            return self.max_tokens

    return ChatCompletionRequest, CompletionRequest
