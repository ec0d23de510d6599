"""The FastAPI application: routes, authentication, body limit, CORS and error handling.

``/v1/*``, ``/tokenize``, ``/detokenize``, ``/docs`` and ``/openapi.json`` need the API key when
the server has one; ``/health``, ``/metrics`` and ``/version`` never do. Every error is OpenAI's
error object. CORS is the outermost layer, as in vLLM: a browser's preflight ``OPTIONS`` carries no
key and is answered there, and every answer (errors included) carries the CORS headers.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from modelrunner.engine.loop import STEP_TIMEOUT_ENV
from .auth import require_api_key
from .body_limit import BodyLimit
from .chat_completions import create_chat_completion
from .completions import create_completion
from .embeddings import embedding_routes
from .errors import APIError, CatchInternalErrors, from_validation_errors
from .responses_api import create_response
from .state import ServerState
from .tokenization import detokenize, tokenize


def _version() -> str:
    try:
        return version("modelrunner")
    except PackageNotFoundError:
        return "unknown"


def _state(request: Request) -> ServerState:
    return request.app.state.server


open_routes = APIRouter()
"""Routes that need no API key."""
model_routes = APIRouter(dependencies=[Depends(require_api_key)])
"""Routes that run the model (API key required when set)."""


@open_routes.get("/health", summary="200 once the model is loaded and the engine runs; 503 otherwise")
async def health(request: Request) -> JSONResponse:
    """Liveness and readiness in one: 503 while loading, shutting down, after a fatal engine error, or
    while the engine's current step has run longer than ``$MODELRUNNER_STEP_TIMEOUT`` (a blocked model
    or plugin call: requests are not advancing)."""
    state = _state(request)
    status, body = state.health()
    stuck_for = getattr(state.engine.loop, "stuck_for", None) if status == 200 and state.engine else None
    stuck = stuck_for() if stuck_for is not None else None
    if stuck is not None:
        status, body = 503, {"status": "stuck", "detail": f"the engine's current step has run for {stuck:.1f} s, "
                             f"more than {STEP_TIMEOUT_ENV}={state.engine.loop.step_timeout_s:g} s: a model or "
                             "plugin call is blocked, and no request advances until it returns"}
    return JSONResponse(body, status_code=status)


@open_routes.get("/version", summary="The server's version")
async def server_version() -> dict[str, str]:
    """``{"version": ...}`` of the modelrunner distribution."""
    return {"version": _version()}


@open_routes.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    """The Prometheus text exposition of the server's metrics."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    model = state.require_model()
    adapter = state.adapters.get(name)
    if adapter is not None:  # vLLM's card of a LoRA adapter: its path as root, the base model as parent
        return {"id": name, "object": "model", "created": model.created, "owned_by": "modelrunner",
                "root": adapter.lora_path, "parent": state.settings.model_name, "max_model_len": model.max_model_len}
    return {"id": name, "object": "model", "created": model.created, "owned_by": "modelrunner", "root": model.root,
            "parent": None, "max_model_len": model.max_model_len}


@model_routes.get("/v1/models", summary="The served model (one entry per served name) and its LoRA adapters")
async def list_models(request: Request) -> dict[str, Any]:
    """OpenAI's model list."""
    state = _state(request)
    names = [*state.settings.model_names, *state.adapters.names()]
    return {"object": "list", "data": [_model_card(state, name) for name in names]}


@model_routes.get("/v1/models/{model_id:path}", summary="One served model")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    """OpenAI's model object; 404 for a name not served here."""
    state = _state(request)
    state.check_model_name(model_id)
    return _model_card(state, model_id)


async def _lora_body(request: Request, state: ServerState) -> dict[str, Any]:
    if not state.settings.allow_runtime_lora_updating:
        raise APIError(404, f"{request.url.path} is off: start the server with --enable-lora "
                            "--allow-runtime-lora-updating to load and unload LoRA adapters at run time",
                       code="not_found")
    state.require_model()
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object with lora_name (and lora_path to load)",
                       code="invalid_value")
    return body


@model_routes.post("/v1/load_lora_adapter", summary="Serve a LoRA adapter by name (--allow-runtime-lora-updating)")
async def load_lora_adapter(request: Request) -> Response:
    """vLLM's route: ``{"lora_name", "lora_path"}`` → the adapter is served as ``model: lora_name``."""
    state = _state(request)
    body = await _lora_body(request, state)
    adapter = await state.adapters.load(state.engine, body.get("lora_name"), body.get("lora_path"),
                                        state.settings.model_names)
    return PlainTextResponse(f"Success: LoRA adapter '{adapter.lora_name}' added successfully.")


@model_routes.post("/v1/unload_lora_adapter", summary="Stop serving a LoRA adapter (--allow-runtime-lora-updating)")
async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's route: ``{"lora_name"}``; refused (400) while unfinished requests use the adapter."""
    state = _state(request)
    body = await _lora_body(request, state)
    await state.adapters.unload(state.engine, body.get("lora_name"))
    return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")


@model_routes.post("/v1/completions", summary="OpenAI completions (vLLM's extra sampling fields accepted)")
async def completions(request: Request) -> Response:
    """Generate from one or more prompts, streamed as server-sent events or not."""
    return await create_completion(request, _state(request))


@model_routes.post("/v1/chat/completions", summary="OpenAI chat completions through the model's chat template")
async def chat_completions(request: Request) -> Response:
    """Reply to a conversation, streamed as server-sent events or not."""
    return await create_chat_completion(request, _state(request))


@model_routes.post("/v1/responses", summary="OpenAI responses (plain text; text.format and tools not yet)")
async def responses(request: Request) -> Response:
    """Reply to ``input`` (text or messages) after ``instructions``, streamed as OpenAI's
    ``response.*`` events or not."""
    return await create_response(request, _state(request))


@model_routes.post("/tokenize", summary="Text or messages to token ids (vLLM's shape)")
async def tokenize_route(request: Request) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}``."""
    return await tokenize(request, _state(request))


@model_routes.post("/detokenize", summary="Token ids to text (vLLM's shape)")
async def detokenize_route(request: Request) -> dict[str, Any]:
    """``{"prompt": text}``."""
    return await detokenize(request, _state(request))


@model_routes.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request) -> JSONResponse:
    """The OpenAPI schema of this server (behind the API key: it describes what the key guards)."""
    return JSONResponse(request.app.openapi())


@model_routes.get("/docs", include_in_schema=False)
async def docs(request: Request) -> HTMLResponse:
    """Swagger UI over :func:`openapi_schema` (with a key set, the browser must send it too)."""
    return get_swagger_ui_html(openapi_url="/openapi.json", title="modelrunner - Swagger UI")


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return APIError(404, f"no route {request.method} {request.url.path} (see /docs)", code="not_found").response()
    if exc.status_code == 405:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed", headers=exc.headers).response()
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return from_validation_errors(exc.errors()).response()


def build_app(state: ServerState) -> FastAPI:
    """The application serving ``state`` (its model may still be loading)."""
    app = FastAPI(title="modelrunner", version=_version(), summary="An OpenAI-compatible server on modelrunner's "
                  "engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.include_router(open_routes)
    app.include_router(model_routes)
    app.include_router(embedding_routes)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(CatchInternalErrors)
    app.add_middleware(BodyLimit, max_bytes=state.settings.max_body_bytes)
    settings = state.settings
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                       allow_credentials=settings.allow_credentials)
    return app
