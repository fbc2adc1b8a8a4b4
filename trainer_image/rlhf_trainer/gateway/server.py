"""The gateway's HTTP face: `/v1/chat/completions` and `/v1/models`, served by vLLM's own
OpenAI chat serving (`OpenAIServingChat`: the model's chat template, tools through
vLLM's tool parser, streaming, n, stop, max_tokens, temperature) over the rollout
engine's AsyncLLM, in the engine's process and on its event loop.

Written here only the recording and the gate: the key binds a call to its episode
(records.EpisodeBook, which refuses past a limit), and `_RecordingEngine` stands between
vLLM's serving code and the AsyncLLM: every request it generates is read on the way
through (prompt ids, sampled ids, log-probs, weight versions), whatever the agent asked
to see. The engine's weight syncs pause the gateway's requests with the others
(`pause_generation(mode="keep")`), and each token keeps the version that sampled it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from rlhf_trainer.api.agents import SERVED_MODEL
from rlhf_trainer.gateway.exact import Contexts
from rlhf_trainer.gateway.records import (
    EPISODE_TIMEOUT,
    CallLimits,
    CallRecord,
    EpisodeBook,
    EpisodeRecords,
    Refused,
    SampledChoice,
)

log = logging.getLogger(__name__)

REQUEST_PREFIX = "agent-"  # vLLM request ids of the gateway's calls: agent-<n>


@dataclass
class _Choice:
    """A choice as its outputs arrive (deltas when streamed, else the whole)."""

    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    spans: tuple[tuple[int, int], ...] = ()
    finish_reason: str | None = None


class _RecordingEngine:
    """The AsyncLLM, as vLLM's serving code sees it, with `generate` recording what each
    of the gateway's requests sampled. Everything else is the AsyncLLM's own."""

    def __init__(self, llm: Any, gateway: Gateway) -> None:
        self._llm = llm
        self._gateway = gateway

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        """The AsyncLLM's generate, recorded; bound to its call here, as vLLM's serving
        code calls it (a stream is read later, once the response is sent)."""
        key, index = self._gateway.calls.pop(_call_id(request_id))
        if sampling_params.logprobs is None:
            sampling_params.logprobs = 0  # the sampled token's log-prob, always recorded
        kwargs["lora_request"] = self._gateway.lora()  # LoRA RL: the served adapter
        self._gateway.book.started(key, request_id)
        return self._recorded(key, index, prompt, sampling_params, request_id, kwargs)

    async def _recorded(
        self,
        key: str,
        index: int,
        prompt: Any,
        sampling_params: Any,
        request_id: str,
        kwargs: dict[str, Any],
    ) -> AsyncGenerator[Any, None]:
        from vllm.sampling_params import RequestOutputKind

        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        book, contexts = self._gateway.book, self._gateway.contexts
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        prompt_ids: list[int] = []
        choices: dict[int, _Choice] = {}
        try:
            async for output in self._llm.generate(prompt, sampling_params, request_id, **kwargs):
                prompt_ids = list(output.prompt_token_ids or prompt_ids)
                for completion in output.outputs:
                    _take(choices.setdefault(completion.index, _Choice()), completion, delta)
                yield output
        finally:
            book.record(key, request_id, _record(index, prompt_ids, choices))
            for choice in choices.values():
                contexts.add(key, text, prompt_ids, choice.ids)


def _take(choice: _Choice, completion: Any, delta: bool) -> None:
    ids = list(completion.token_ids)
    log_probs = [
        float(at[token].logprob) for token, at in zip(ids, completion.logprobs or (), strict=False)
    ]
    if delta:
        choice.ids += ids
        choice.log_probs += log_probs
    else:
        choice.ids, choice.log_probs = ids, log_probs
    if completion.weight_versions:
        choice.spans = tuple((int(s.version), s.start) for s in completion.weight_versions)
    choice.finish_reason = completion.finish_reason or choice.finish_reason


def _record(index: int, prompt_ids: list[int], choices: dict[int, _Choice]) -> CallRecord | None:
    sampled = [
        SampledChoice(i, c.ids, c.log_probs, c.spans, c.finish_reason)
        for i, c in sorted(choices.items())
        if c.ids and c.spans and len(c.log_probs) == len(c.ids)  # an abort before any token
    ]
    return CallRecord(index, prompt_ids, tuple(sampled)) if sampled else None


def _call_id(request_id: str) -> str:
    """vLLM's request id of a call (`chatcmpl-<ours>`, `_<i>` for sub-prompts) -> ours."""
    return request_id.removeprefix("chatcmpl-").split("_")[0]


def _exact_chat_class() -> type:
    """vLLM's OpenAIServingChat, its rendered prompts made token-exact (exact.py)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    class ExactChat(OpenAIServingChat):  # type: ignore[misc]  # vLLM is untyped here
        gateway: Gateway

        async def render_chat_request(self, request: Any) -> Any:
            rendered = await super().render_chat_request(request)
            if isinstance(rendered, ErrorResponse):
                return rendered
            conversation, inputs = rendered
            key, _ = self.gateway.calls[request.request_id]
            return conversation, [self._exact(key, engine_input) for engine_input in inputs]

        def _exact(self, key: str, engine_input: Any) -> Any:
            if engine_input.get("type") != "token":
                return engine_input  # multimodal: as vLLM rendered it
            ids = list(engine_input["prompt_token_ids"])
            text = engine_input.get("prompt")
            if text is None:
                return engine_input
            return {
                **engine_input,
                "prompt_token_ids": self.gateway.contexts.prompt_ids(key, text, ids),
            }

    return ExactChat


class Gateway:
    """vLLM's chat serving over `llm` (the engine's AsyncLLM), gated by an EpisodeBook.
    Build and use it on the engine's loop. `lora()` gives the LoRA request the engine
    serves now (None: the base)."""

    def __init__(
        self,
        llm: Any,
        *,
        chat_template: str | None = None,
        tool_parser: str | None = None,
        lora: Callable[[], Any] = lambda: None,
        book: EpisodeBook | None = None,
    ) -> None:
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers.online_renderer import OnlineRenderer

        self.book = book or EpisodeBook()
        self.lora = lora
        self.calls: dict[str, tuple[str, int]] = {}  # our call id -> (key, call index)
        self._deadlines: dict[str, asyncio.TimerHandle] = {}
        self._aborts: set[asyncio.Future[None]] = set()  # kept until done (asyncio's advice)
        self._ids = itertools.count()
        self._llm = llm
        engine = _RecordingEngine(llm, self)
        path = str(llm.model_config.model)
        models = OpenAIServingModels(engine, [BaseModelPath(SERVED_MODEL, path)])
        tools = {
            "enable_auto_tools": tool_parser is not None,
            "tool_parser": tool_parser,
            "chat_template": chat_template,
            "chat_template_content_format": "auto",
        }
        renderer = OnlineRenderer(
            llm.model_config, llm.renderer, request_logger=None, **tools
        )  # fmt: skip
        self.models = models
        self.contexts = Contexts(llm.renderer.tokenizer)
        self.chat = _exact_chat_class()(
            engine, models, "assistant", online_renderer=renderer, request_logger=None, **tools
        )
        self.chat.gateway = self
        self._server: Any = None
        self._serving: asyncio.Task[None] | None = None

    # The trainer's side (the rollout worker calls these on the engine's loop).

    def open_episode(self, key: str, limits: CallLimits) -> None:
        self.book.open(key, limits)
        self.contexts.open(key)
        # The deadline cuts the calls in flight too, not only later ones.
        self._deadlines[key] = asyncio.get_running_loop().call_later(
            limits.episode_seconds, lambda: self._stop(self.book.cut(key, EPISODE_TIMEOUT))
        )

    async def close_episode(self, key: str) -> EpisodeRecords:
        """Close `key`'s episode: its calls' records; its calls in flight are aborted."""
        records, in_flight = self.book.close(key)
        self.contexts.close(key)
        self._deadlines.pop(key).cancel()
        if in_flight:
            await self._llm.abort(in_flight)
        return records

    def _stop(self, request_ids: list[str]) -> None:
        if request_ids:
            self._aborts.add(task := asyncio.ensure_future(self._llm.abort(request_ids)))
            task.add_done_callback(self._aborts.discard)

    # HTTP

    def app(self) -> FastAPI:
        app = FastAPI(title="rlhf gateway")

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse((await self.models.show_available_models()).model_dump())

        @app.post("/v1/chat/completions")
        async def chat(raw: Request) -> Response:
            try:
                return await self._complete(raw)
            except Refused as refused:
                return JSONResponse(refused.body(), status_code=refused.status)

        return app

    async def _complete(self, raw: Request) -> Response:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        key = _bearer(raw.headers.get("authorization"))
        self.book.check(key)
        try:
            request = ChatCompletionRequest.model_validate(await raw.json())
        except (ValidationError, ValueError) as invalid:
            raise _invalid(invalid) from None
        # max_tokens is OpenAI's deprecated name for it (read without its warning).
        asked = request.model_dump(include={"max_tokens", "max_completion_tokens"})
        index, max_tokens = self.book.admit(
            key, asked["max_completion_tokens"] or asked["max_tokens"]
        )
        request.max_completion_tokens = max_tokens
        call_id = f"{REQUEST_PREFIX}{next(self._ids)}"
        request.request_id = call_id
        self.calls[call_id] = (key or "", index)
        try:
            result = await self.chat.create_chat_completion(request, None)
        finally:
            self.calls.pop(call_id, None)  # refused before it reached the engine
        if isinstance(result, ErrorResponse):
            error = result.error
            refused = Refused(error.code, error.type, None, error.message, error.param)
            return JSONResponse(refused.body(), status_code=error.code)
        if request.stream:
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump())

    async def serve(self, host: str, port: int) -> int:
        """Serve on host:port (0: a free port) on the running loop; returns the port. The
        socket listens on return: calls made from then on wait to be accepted."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving


def _bearer(header: str | None) -> str | None:
    scheme, _, token = (header or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _invalid(invalid: Exception) -> Refused:
    """A body vLLM's request model refuses, as OpenAI's error, naming the field."""
    from pydantic import ValidationError

    errors = invalid.errors() if isinstance(invalid, ValidationError) else []
    if not errors:
        message = f"the body is not a JSON object: {invalid}"
        return Refused(400, "invalid_request_error", "invalid_request", message)
    where = ".".join(str(part) for part in errors[0]["loc"]) or None
    message = f"{where or 'the body'}: {errors[0]['msg']}"
    return Refused(400, "invalid_request_error", "invalid_request", message, where)
