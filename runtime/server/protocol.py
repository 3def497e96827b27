"""Request bodies of the OpenAI routes, with OpenAI's field names, validated strictly (wrong types are 400s).

The models are built per app by `request_models(max_tokens_limit)` so that the operator's cap on `max_tokens`
is part of the published OpenAPI schema (clients and fuzzers see the real bound).

Every field of OpenAI's current request objects is accepted, because a user cannot edit what LangChain or an agent
framework sends. Those this server does not act on are listed in each model's IGNORED; a field no model declares
is accepted too (as vLLM and llama.cpp's server accept them), unless `serve --strict-requests`. `ignored_fields`
names both kinds for the X-Ignored-Fields header. A name one typo away from a real field (`max_token`) is a 400
with "did you mean", since the client surely meant the real one. Fields whose value would change what the answer
is (`echo`, `suffix`, `best_of`, SGLang's extensions) accept only their neutral value.
"""

# (no `from __future__ import annotations`: FastAPI and pydantic read these annotations at runtime)

from typing import Annotated, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

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
Label = Annotated[str, Field(max_length=512), AfterValidator(_valid_unicode)]  # an ignored field's short text
IGNORED_HEADER = "X-Ignored-Fields"


class _Strict(BaseModel):
    """Strict types; unknown fields kept in model_extra (named by ignored_fields), near misses refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    IGNORED: ClassVar[frozenset[str]] = frozenset()  # OpenAI fields accepted and not acted on

    @model_validator(mode="after")
    def _no_near_misses(self):
        names = [info.alias or name for name, info in type(self).model_fields.items()]
        for key in self.model_extra or ():
            known = near_miss(key, names)
            if known is not None:
                raise PydanticCustomError(
                    "unknown_field", "unknown field '{field}': did you mean '{known}'? Fix the name (unknown fields "
                    "are otherwise ignored, and this one would change nothing)", {"field": key, "known": known})
        return self


def near_miss(name: str, known: list[str]) -> str | None:
    """The field `name` surely meant: the same once case and separators are dropped (maxTokens), or, for names of
    6+ characters, one edit away (max_token, temprature, a swapped pair). Shorter names and two edits (min_tokens,
    vLLM's extension, against max_tokens) are other fields, not typos."""
    flat = name.replace("_", "").replace("-", "").lower()
    for field in known:
        if field.replace("_", "").lower() == flat or (len(name) >= 6 and _one_edit(name, field)):
            return field
    return None


def _one_edit(a: str, b: str) -> bool:
    """Whether a and b differ by one insertion, deletion, substitution or swap of neighbours (a != b)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    start = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if len(a) == len(b):
        return a[start + 1:] == b[start + 1:] or (a[start + 2:] == b[start + 2:] and a[start:start + 2] ==
                                                    b[start:start + 2][::-1])
    return (a[start + 1:] == b[start:]) if len(a) > len(b) else (a[start:] == b[start + 1:])


def ignored_fields(body: BaseModel) -> tuple[list[str], list[str]]:
    """(OpenAI fields present, not null, that this server does not act on; fields no model declares), each as its
    path in the body ("store", "messages[1].refusal", "stream_options.include_obfuscation")."""
    ignored: list[str] = []
    unknown: list[str] = []

    def walk(node, path: str) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}[{i}]")
            return
        if not isinstance(node, BaseModel):
            return
        at = (path + ".") if path else ""
        unknown.extend(at + key for key in node.model_extra or ())
        for name, info in type(node).model_fields.items():
            value = getattr(node, name)
            if name in node.IGNORED and value is not None:
                ignored.append(at + (info.alias or name))
            elif value is not None:
                walk(value, at + (info.alias or name))

    walk(body, "")
    return ignored, unknown


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
    IGNORED = frozenset({"refusal", "audio", "function_call"})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[TextPart], None] = None
    name: Annotated[str, Field(max_length=64)] | None = None
    # Which role may carry which field is checked per request (tool_calls.check_messages), so that the 400 names
    # the field itself (messages[i].tool_call_id); a model validator here could only name the message.
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages only: the calls it made")
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None, description="tool messages only (required there): the id of the call this message answers")
    refusal: Text | None = Field(None, description="ignored (an earlier assistant refusal)")
    audio: dict | None = Field(None, description="ignored (an earlier assistant audio reply)")
    function_call: dict | None = Field(None, description="ignored (deprecated by OpenAI for tool_calls)")

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
    IGNORED = frozenset({"include_obfuscation"})

    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description="ignored: chunks are never padded")


class _Generation(_Strict):
    """Fields both routes share. Extensions beyond OpenAI (as vLLM names them): top_k, min_p, repetition_penalty,
    stop_token_ids, ignore_eos. `user` is accepted and ignored (as OpenAI's newer safety_identifier)."""

    IGNORED = frozenset({"user"})

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
        # OpenAI fields this server accepts and does not act on (named in the X-Ignored-Fields header): storage,
        # billing and caching hints, other modalities, reasoning controls, and the deprecated function calling.
        IGNORED = _Generation.IGNORED | {
            "audio", "function_call", "functions", "metadata", "modalities", "moderation", "prediction",
            "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
            "safety_identifier", "service_tier", "store", "verbosity", "web_search_options"}
        audio: dict | None = Field(None, description="ignored: text output only")
        function_call: Union[Label, dict, None] = Field(None, description="ignored (deprecated: use tool_choice)")
        functions: list[dict] | None = Field(None, description="ignored (deprecated: use tools)")
        metadata: dict[str, Label] | None = Field(None, description="ignored: nothing is stored")
        modalities: list[Label] | None = Field(None, description="ignored: text output only")
        moderation: dict | None = Field(None, description="ignored")
        prediction: dict | None = Field(None, description="ignored (predicted output)")
        prompt_cache_key: Label | None = Field(None, description="ignored: the prefix cache matches by tokens")
        prompt_cache_options: dict | None = Field(None, description="ignored")
        prompt_cache_retention: Label | None = Field(None, description="ignored")
        reasoning_effort: Label | None = Field(None, description="ignored")
        safety_identifier: Label | None = Field(None, description="ignored")
        service_tier: Label | None = Field(None, description="ignored: one tier")
        store: bool | None = Field(None, description="ignored: nothing is stored")
        verbosity: Label | None = Field(None, description="ignored")
        web_search_options: dict | None = Field(None, description="ignored: no web search")
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
