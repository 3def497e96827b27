"""POST /tokenize and POST /detokenize, in vLLM's shape (llama.cpp's server answers the same fields):

/tokenize   {"model"?, "prompt": "text", "add_special_tokens"?} or {"model"?, "messages": [...],
            "add_generation_prompt"?}  ->  {"tokens": [ids], "count": N, "max_model_len": M}
/detokenize {"model"?, "tokens": [ids]}  ->  {"prompt": "text"}
Both run the tokenizer on the app's tokenize worker, as the generation routes do.
"""

# (no `from __future__ import annotations`: FastAPI and pydantic read these annotations at runtime)

from typing import Annotated

from fastapi import FastAPI
from pydantic import Field, model_validator

from .errors import ApiError
from .protocol import ChatMessage, PromptText, TokenId, _Strict
from .tool_use.tool_calls import check_messages

MAX_TOKENS_LISTED = 1 << 17


class TokenizeRequest(_Strict):
    model: Annotated[str, Field(max_length=256)] | None = None
    prompt: PromptText | None = Field(None, description="text to tokenize (or send messages)")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        None, description="a conversation, tokenized through the model's chat template")
    add_special_tokens: bool = Field(True, description="with prompt: the tokenizer's BOS etc., as generation adds")
    add_generation_prompt: bool = Field(True, description="with messages: open the assistant's turn")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (text) or messages (a conversation)")
        return self


class DetokenizeRequest(_Strict):
    model: Annotated[str, Field(max_length=256)] | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKENS_LISTED)]


def _tokenize(engine, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        return list(engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    messages = [m.for_template() for m in body.messages]
    template = {"chat_template": engine.chat_template} if engine.chat_template is not None else {}
    ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                               tokenize=True, **template)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def install_token_routes(app: FastAPI, state, responses: dict) -> None:
    @app.post("/tokenize", summary="token ids of a prompt or a conversation", responses=responses)
    async def tokenize(body: TokenizeRequest) -> dict:
        engine = state.require_ready("tokenize")
        state.check_model(body.model)
        if body.messages is not None:
            check_messages(body.messages)
        try:
            ids = await state.off_loop(_tokenize, engine, body)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is about these messages (jinja raises many)
            raise ApiError(400, f"the model's chat template rejected these messages: {exc}", "messages") from exc
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.token_limit()}

    @app.post("/detokenize", summary="the text of token ids", responses=responses)
    async def detokenize(body: DetokenizeRequest) -> dict:
        engine = state.require_ready("detokenize")
        state.check_model(body.model)
        vocab = engine.loaded.config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"tokens: token id {bad[0]} is outside the vocabulary (ids 0..{vocab - 1})",
                           "tokens", "invalid_value")
        text = await state.off_loop(engine.tokenizer.decode, list(body.tokens))
        return {"prompt": text}
