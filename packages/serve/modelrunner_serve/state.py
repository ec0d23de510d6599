"""What every handler sees: the settings, the server's phase, the served model and its engine.

The phase moves ``loading`` → ``ready`` → ``stopping`` (or ``loading`` → ``failed``); a fatal
engine error keeps the phase but makes the engine report itself dead. Handlers only read this
state; the model owner thread and the shutdown sequence change it.
"""

from __future__ import annotations

from typing import Any

import attrs

from modelrunner.engine.loop import LoopSnapshot
from modelrunner.executor import WorkerFailedError
from modelrunner.model_info import describe_model
from modelrunner.sampling.params import SamplingParams
from .async_engine import (RETRY_AFTER_S, AdapterRetired, AsyncEngine, EngineStopped, Generation, NeverFits,
                           Overloaded, PromptRejected)
from .errors import APIError, bad_request, leading_field
from .lora import ServedAdapters
from .metrics import ServerMetrics
from .responses import now
from .sampling import PASSED_THROUGH
from .settings import ServeSettings

LOADING_RETRY_AFTER_S = 5
"""What ``Retry-After`` tells clients while the model loads."""


@attrs.frozen
class ServedModel:
    """The loaded model as the handlers use it."""

    llm: Any
    """The :class:`~modelrunner.LLM` (its engine belongs to the engine loop)."""
    tokenizer: Any
    """The checkpoint's tokenizer."""
    max_model_len: int
    """Longest sequence (prompt + output)."""
    root: str
    """Where the checkpoint lives (``/v1/models``' ``root``)."""
    defaults: dict[str, Any]
    """Sampling defaults from the checkpoint's ``generation_config.json``."""
    image_token: str | None
    """The text of the image placeholder token (None: the model takes no images)."""
    created: int
    """When it finished loading (seconds since the epoch)."""

    @classmethod
    def from_replicas(cls, llm: Any) -> ServedModel:
        """Describe a :class:`~modelrunner_data_parallel.DataParallelLLM` from what replica 0 reported."""
        info = llm.info
        return cls(llm=llm, tokenizer=info["tokenizer"], max_model_len=info["max_model_len"], root=info["root"],
                   defaults=info["defaults"], image_token=info["image_token"], created=now())

    @classmethod
    def from_llm(cls, llm: Any) -> ServedModel:
        """Describe a freshly loaded ``llm``."""
        info = describe_model(llm)
        return cls(llm=llm, tokenizer=info.tokenizer, max_model_len=info.max_model_len, root=info.root,
                   defaults=info.defaults, image_token=info.image_token, created=now())


class ServerState:
    """The server's state, shared by the handlers (read) and the lifecycle code (written).

    :param settings: what the server was asked to do.
    """

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.phase = "loading"
        """``loading``, ``ready``, ``failed`` or ``stopping``."""
        self.detail: str | None = None
        """Why the model failed to load."""
        self.model: ServedModel | None = None
        self.engine: AsyncEngine | None = None
        self.metrics = ServerMetrics(settings.model_name, self._snapshot)
        """The Prometheus metrics."""
        self.adapters = ServedAdapters()
        """The LoRA adapters served by name."""

    def _snapshot(self) -> LoopSnapshot | None:
        return self.engine.loop.snapshot if self.engine is not None else None

    # -- lifecycle (written from the owner thread or the shutdown sequence) -----------------------

    def set_ready(self, model: ServedModel, engine: AsyncEngine) -> None:
        """The model is loaded and its engine loop runs."""
        self.model, self.engine = model, engine
        if self.phase == "loading":
            self.phase = "ready"

    def set_failed(self, message: str) -> None:
        """The model could not be loaded."""
        self.detail = message
        self.phase = "failed"

    def set_stopping(self) -> None:
        """Shutdown began: new requests get 503."""
        if self.phase in ("loading", "ready"):
            self.phase = "stopping"

    # -- what handlers call -----------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        """``GET /health``: 200 when requests can be served, 503 with the reason otherwise."""
        if self.phase == "ready" and self.engine is not None:
            failures = getattr(self.engine.loop, "failures", ())  # data-parallel replicas that failed
            if failures and self.engine.loop.error is None:
                return 503, {"status": "degraded", "detail": "; ".join(str(f) for f in failures) +
                             " (the other replicas serve; restart the server to bring it back)"}
            if self.engine.loop.error is not None:
                error = self.engine.loop.error
                return 503, {"status": "error", "detail": f"the engine stopped after a fatal error: "
                                                          f"{type(error).__name__}: {error}"}
            return 200, {"status": "ok"}
        detail = {"loading": "the model is loading", "stopping": "the server is shutting down",
                  "failed": f"the model failed to load: {self.detail}"}[self.phase]
        return 503, {"status": self.phase, "detail": detail}

    def require_model(self) -> ServedModel:
        """The served model, when requests can be served.

        :raises APIError: 503 while loading or shutting down or after a parallel worker died, 500 after
            another fatal engine error.
        """
        if self.phase == "loading":
            raise APIError(503, "the model is still loading; retry shortly (GET /health answers 200 once ready)",
                           code="model_loading", headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        if self.phase == "stopping":
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.phase == "failed" or self.model is None or self.engine is None:
            raise APIError(500, f"the model failed to load: {self.detail}", code="model_failed")
        try:
            self.engine.check_alive()
        except EngineStopped as e:
            raise self._engine_dead(e) from None
        return self.model

    def _engine_dead(self, error: EngineStopped) -> APIError:
        """500 after a fatal engine error; 503 when a parallel worker died (the message names the rank
        and how it ended): nothing here can serve until the server is restarted."""
        cause = self.engine.loop.error if self.engine is not None else None
        return APIError(503 if isinstance(cause, WorkerFailedError) else 500, str(error), code="engine_dead")

    def check_model_name(self, name: str | None) -> Any:
        """The LoRA adapter a request's ``model`` names (None: the base model).

        :raises APIError: 404 ``model_not_found`` when ``name`` is neither the base model's nor an
            adapter's name (as OpenAI and vLLM answer; OpenAI's client raises ``NotFoundError``)."""
        adapter = self.adapters.get(name)
        if adapter is not None:
            return adapter
        if name is not None and name not in self.settings.model_names:
            served = ", ".join(repr(n) for n in [*self.settings.model_names, *self.adapters.names()])
            raise APIError(404, f"model {name!r} is not served here; accepted: {served} (or leave model out)",
                           param="model", code="model_not_found")
        return None

    def reported_name(self, adapter: Any) -> str:
        """The ``model`` a response reports: the adapter's name, else the base model's."""
        return self.settings.model_name if adapter is None else adapter.lora_name

    async def generate(self, request_id: str, prompts: list[Any], params: SamplingParams,
                       prompt_param: str, stream: bool = True, lora_request: Any = None) -> Generation:
        """Submit ``prompts`` to the engine (see :meth:`AsyncEngine.generate`).

        :param prompt_param: the request field the prompts came from (named by a prompt's error).
        :param stream: the handler reads every step (False: only the final outputs).
        :param lora_request: the adapter to run with (:meth:`check_model_name`'s answer).
        :raises APIError: 400 for a prompt the engine refuses or more prompts than it can ever hold,
            503 (with Retry-After) when overloaded, 500 when the engine is dead (503 when a worker died),
            409 when the LoRA adapter ``lora_request`` was unloaded since it was looked up.
        """
        engine = self.engine
        assert engine is not None  # require_model() came first
        try:
            return await engine.generate(request_id, prompts, params, stream=stream, lora_request=lora_request)
        except NeverFits as e:
            raise bad_request(f"{prompt_param}: {e}", param=prompt_param, code="too_many_prompts") from None
        except Overloaded as e:
            raise APIError(503, str(e), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineStopped as e:
            raise self._engine_dead(e) from None
        except PromptRejected as e:
            raise engine_refusal(e, prompt_param, len(prompts)) from None
        except AdapterRetired as e:
            raise APIError(409, str(e), param="model", code="adapter_unloaded") from None


def engine_refusal(error: PromptRejected, prompt_param: str, count: int) -> APIError:
    """The 400 for a request the engine refused: the sampling field its message names, else the prompt."""
    message = str(error)
    if message.startswith("request '"):  # the engine names its own request id, which the client never saw
        message = message.split("': ", 1)[-1]
    field = leading_field(message)
    if field in PASSED_THROUGH:
        return bad_request(message, param=field)
    param = f"{prompt_param}[{error.index}]" if count > 1 else prompt_param
    code = "context_length_exceeded" if "max_model_len" in message else "invalid_value"
    if not message.startswith(f"{param} "):
        message = f"{param}: {message}"
    return bad_request(message, param=param, code=code)

