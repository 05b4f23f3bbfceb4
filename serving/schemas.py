"""The OpenAI-compatible API declared once with pydantic: request models (validation), response models, the error
shape, and the OpenAPI document built from them.

Requests allow unknown fields (clients such as LangChain send fields a server may ignore; the app logs them), reject
NaN and infinity, and bound every number so absurd values are a 400, never an allocation or a 500.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

MAX_N = 128  # choices per request (OpenAI's limit)
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs)
MAX_STOP = 64  # stop strings / stop token ids per request
INT64 = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class APIError(Exception):
    """An error answered in OpenAI's shape {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=INT64)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[int, Field(ge=-INT64 - 1, le=INT64)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT64)] = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs (kiln.serving.structured_api): vLLM's object and its older names
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    suffix: str | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    response_format: dict[str, Any] | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. `messages` is rendered with the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    """POST /tokenize: either `prompt` (plain text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


# ---- responses ----------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser (kiln.serving.reasoning)
    tool_calls: list[dict[str, Any]] | None = None  # [{id, type: "function", function: {name, arguments}}]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each call whole, with its index


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (a streamed completion's events are CompletionResponses
    holding the new text, as OpenAI's are)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kiln"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    """/health: 200 {"status": "ok"} once the engine is ready; 503 while loading, draining or after a failure."""

    status: Literal["ok", "loading", "stopping", "engine_dead"]


# ---- OpenAPI ------------------------------------------------------------------------------------------------------

ROUTES: list[tuple[str, str, str, type[BaseModel] | None, type[BaseModel] | None]] = [
    # (method, path, summary, request model, response model)
    ("post", "/v1/completions", "Create a completion (SSE when stream is true).", CompletionRequest,
     CompletionResponse),
    ("post", "/v1/chat/completions", "Create a chat completion (SSE when stream is true).", ChatCompletionRequest,
     ChatCompletionResponse),
    ("get", "/v1/models", "List the served model.", None, ModelList),
    ("post", "/tokenize", "Tokenize a prompt or chat messages.", TokenizeRequest, TokenizeResponse),
    ("post", "/detokenize", "Turn token ids back into text.", DetokenizeRequest, DetokenizeResponse),
    ("get", "/version", "The server version.", None, VersionResponse),
    ("get", "/health", "200 once the engine is ready; 503 while loading, stopping or after an engine failure.", None,
     HealthResponse),
    ("get", "/metrics", "Prometheus metrics (vLLM's names).", None, None),
]  # fmt: skip
# the server-sent events of streamed responses
STREAM_EVENTS: dict[str, type[BaseModel]] = {"/v1/completions": CompletionResponse,
                                             "/v1/chat/completions": ChatCompletionChunk}  # fmt: skip


def openapi_schema(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API, generated from the pydantic models above."""
    models = {m for _, _, _, req, resp in ROUTES for m in (req, resp) if m is not None}
    models |= {ErrorResponse, *STREAM_EVENTS.values()}
    pairs = [(m, "validation" if m.__name__.endswith("Request") else "serialization") for m in models]
    _, defs = models_json_schema(pairs, ref_template="#/components/schemas/{model}")
    ref = lambda m: {"$ref": f"#/components/schemas/{m.__name__}"}
    error = {
        "description": "An error in OpenAI's shape.",
        "content": {"application/json": {"schema": ref(ErrorResponse)}},
    }
    paths: dict[str, Any] = {}
    for method, path, summary, req, resp in ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {"default": error}}
        op["responses"]["200"] = {"description": "OK"}
        if resp is not None:
            op["responses"]["200"]["content"] = {"application/json": {"schema": ref(resp)}}
        if path in STREAM_EVENTS:  # each event's data is a chunk, or an error that ends the stream
            either = {"anyOf": [ref(STREAM_EVENTS[path]), ref(ErrorResponse)]}
            op["responses"]["200"]["content"]["text/event-stream"] = {"schema": either}
        if req is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(req)}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "kiln", "version": version, "description": "OpenAI-compatible LLM inference server."},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
