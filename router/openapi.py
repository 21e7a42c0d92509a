"""The router's OpenAPI document, true to what the server answers: the request bodies from the
pydantic models (the routes parse them themselves, see request_body.py), every status a route really
gives with the OpenAI error body (never FastAPI's 422), `text/event-stream` for streams, `text/plain`
for /metrics, and the API key where one is configured."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from router.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REQUEST_BODIES = {("/v1/completions", "post"): CompletionRequest, ("/v1/chat/completions", "post"): ChatCompletionRequest,
                  ("/tokenize", "post"): TokenizeRequest, ("/detokenize", "post"): DetokenizeRequest}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
ERROR_WHEN = {400: "the body is not valid JSON, or does not fit the request's schema or the model's limits",
              401: "the API key is missing or wrong", 404: "the model is not the one served",
              413: "the body is larger than the cap (4 MiB), however it is framed",
              429: "too many completions in flight through this router (--max-pending)",
              503: "no worker of a role is alive, or the prefill queue would not reach the prompt before "
                   "the deadline", 504: "the request ran past the server's deadline (--request-timeout)"}
RETRY_AFTER = (429, 503)  # these carry Retry-After, in seconds

CHOICES = {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"],
                                      "properties": {"index": {"type": "integer"}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {name: {"type": "integer"} for name in ("prompt_tokens", "completion_tokens", "total_tokens")}}
COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
              "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "created": {"type": "integer"},
                             "model": {"type": "string"}, "choices": CHOICES, "usage": USAGE}}
STREAM = {"type": "string", "description": "Server-sent events: `data: <chunk JSON>` per event, then `data: [DONE]`; "
                                           "an error after the stream started is a `data: {\"error\": ...}` event"}
ANSWERS = {
    ("/v1/completions", "post"): (COMPLETION, [400, 404, 413, 429, 503, 504]),
    ("/v1/chat/completions", "post"): (COMPLETION, [400, 404, 413, 429, 503, 504]),
    ("/tokenize", "post"): ({"type": "object", "required": ["tokens", "count", "max_model_len"], "properties": {
        "tokens": {"type": "array", "items": {"type": "integer"}}, "count": {"type": "integer"},
        "max_model_len": {"type": "integer"}}}, [400, 404, 413]),
    ("/detokenize", "post"): ({"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                              [400, 404, 413]),
    ("/v1/models", "get"): ({"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"]}}}}, []),
}
HEALTH = {"type": "object", "required": ["status"], "properties": {
    "status": {"enum": ["ok", "degraded", "unhealthy"]}, "missing": {"type": "array", "items": {"type": "string"}}}}


def openapi_document(app: FastAPI, api_key: bool, metrics_without_key: bool) -> dict:
    """The document for `app`'s routes; `api_key`: one is configured (every route but /health, and
    /metrics with `metrics_without_key`, answers 401 without it)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["ErrorResponse"] = ERROR
    for (path, method), model in REQUEST_BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        doc["paths"][path][method]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    for (path, method), (body, errors) in ANSWERS.items():
        content = {"application/json": {"schema": body}}
        if method == "post" and path.startswith("/v1/"):
            content["text/event-stream"] = {"schema": STREAM}
        doc["paths"][path][method]["responses"] = {"200": _answer("OK", content), **_errors(errors)}
    doc["paths"]["/health"]["get"]["responses"] = {
        "200": _answer("a prefill-capable and a decode-capable worker answer (degraded: decode workers prefill)",
                       {"application/json": {"schema": HEALTH}}),
        "503": _answer("no decode worker answers", {"application/json": {"schema": HEALTH}})}
    doc["paths"]["/metrics"]["get"]["responses"] = {
        "200": _answer("Prometheus text format", {"text/plain": {"schema": {"type": "string"}}})}
    if api_key:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path, operations in doc["paths"].items():
            if path == "/health" or (path == "/metrics" and metrics_without_key):
                continue
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]
                operation["responses"].update(_errors([401]))
    return doc


def _answer(description: str, content: dict, headers: dict | None = None) -> dict:
    every = {"X-Request-Id": {"description": "the request's id (echoed from the request, else generated)",
                              "required": True, "schema": {"type": "string"}}}
    return {"description": description, "headers": every | (headers or {}), "content": content}


def _errors(statuses: list[int]) -> dict:
    retry = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                             "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return {str(status): _answer(ERROR_WHEN[status], {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
                                 retry if status in RETRY_AFTER else None) for status in statuses}
