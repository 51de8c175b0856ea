"""One simulated engine server: routes, engines per served model, metrics and faults."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from llmgw.sim.kvpublish import KvEventPublisher

from llmgw.sim import api
from llmgw.sim.driver import ChangeSignal, EngineDriver, SeqHandle
from llmgw.sim.faults import Faults, FaultSpecError, FaultState
from llmgw.sim.http import ConnectionClosedError, HttpConnection, Request, Response, serve
from llmgw.sim.metrics import ENGINES, ModelObservations, ServedModel, make_registry, render
from llmgw.sim.model import (
    EngineConfig,
    EngineModel,
    QueueFullError,
    RequestTooLargeError,
    SeqRequest,
    Sequence,
)
from llmgw.sim.tokens import (
    OutputText,
    block_hashes,
    count_tokens,
    id_block_hashes,
    token_ids,
)

_NOT_FOUND = Response(404, b'{"detail":"Not Found"}')
_NOT_ALLOWED = Response(405, b'{"detail":"Method Not Allowed"}')
_GARBAGE_METRICS = b"<html><body>502 Bad Gateway</body></html>\n\x00\xff{not: prometheus"
_PROM_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


@dataclass(frozen=True)
class ReplicaOptions:
    """Everything a replica needs; one value can configure a whole fleet."""

    models: tuple[str, ...] = ("m1",)
    engine: str = "vllm"
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0
    faults: Faults = field(default_factory=Faults)
    # Output length range of a chat request without max_tokens (finish_reason "stop"); a
    # completion without it gets 16, as on vLLM.
    default_output_tokens: tuple[int, int] = (16, 64)
    # CLI: a crash fault exits the process; in-process fleets drop sockets instead.
    crash_exits_process: bool = False
    # Publish vLLM KV-cache events on this ZMQ port (0: any free port; None: off), the
    # first served model's; `GET /kv_event_sources` says where. Needs pyzmq and msgpack.
    kv_events_port: int | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model is required")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
        low, high = self.default_output_tokens
        if not 1 <= low <= high:
            raise ValueError("default_output_tokens must be 1 <= low <= high")


@dataclass
class _Served:
    name: str
    driver: EngineDriver
    observations: ModelObservations


class Replica:
    """A server on host:port (0 = ephemeral); `start()` binds, `port` is then known."""

    def __init__(
        self, options: ReplicaOptions, index: int = 0, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.options = options
        self.index = index
        self.host = host
        self.port = port
        self.crashed = False
        self._faults = FaultState(options.faults, seed=options.seed * 7919 + index)
        self._text = OutputText(options.seed * 104729 + index)
        self._served: dict[str, _Served] = {}
        self.kv_publisher: KvEventPublisher | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[HttpConnection] = set()
        self._hung: asyncio.Event | None = None
        self._ids = 0
        self.hung_requests = 0
        self.signal = ChangeSignal()
        self._created = int(time.time())
        self._registry = make_registry(
            options.engine,
            [self._served_model(name) for name in options.models],
        )

    def _served_model(self, name: str) -> ServedModel:
        events = self.options.kv_events_port is not None and not self._served
        config = self.options.engine_config
        model = EngineModel(replace(config, kv_events=True) if events else config)
        model.slowdown = self.options.faults.slowdown
        observations = ModelObservations(self.options.engine, config.max_model_len)
        driver = EngineDriver(
            model,
            on_finish=observations.observe,
            on_first_token=observations.first_token,
            signal=self.signal,
            on_schedule=(lambda: self._publish(model)) if events else None,
        )
        self._served[name] = _Served(name, driver, observations)
        return ServedModel(name, model, observations)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def faults(self) -> Faults:
        return self._faults.faults

    def engine(self, model: str | None = None) -> EngineModel:
        """The engine model serving `model` (default: the first), for white-box tests."""
        return self._served[model or self.options.models[0]].driver.model

    async def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait for a state (e.g. `lambda: len(r.engine().running) == 2`), not for time."""
        await self.signal.wait_until(predicate, timeout)

    def _publish(self, model: EngineModel) -> None:
        events = model.drain_kv_events()
        if self.kv_publisher is not None:
            self.kv_publisher.publish(events)

    async def start(self) -> None:
        if self.options.kv_events_port is not None and self.kv_publisher is None:
            from llmgw.sim.kvpublish import KvEventPublisher  # noqa: PLC0415 (optional extra)

            # A new publisher per start: a restarted engine counts from sequence 0 again,
            # with an empty prefix cache (freed blocks are dropped; nothing runs yet).
            for served in self._served.values():
                served.driver.model.reset_prefix_cache()
                served.driver.model.drain_kv_events()
            self.kv_publisher = KvEventPublisher(self.host, self.options.kv_events_port)
            self.kv_publisher.start()
        self._hung = asyncio.Event()
        for served in self._served.values():
            served.driver.start()
        self._server, state = await serve(
            self._handle, self.host, self.port, [("x-sim-replica", str(self.index))]
        )
        self._connections = state.connections
        self.port = self._server.sockets[0].getsockname()[1]
        self.crashed = False
        if self.faults.crash:
            self._crash()

    async def stop(self) -> None:
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
            self.kv_publisher = None
        if self._server is not None:
            self._server.close()
            for connection in list(self._connections):
                connection.abort()
            await self._server.wait_closed()
            self._server = None
        for served in self._served.values():
            await served.driver.stop()

    def set_faults(self, **changes: Any) -> Faults:
        """Update some faults (same fields as POST /admin/faults); returns all of them."""
        faults = self.faults.updated(changes)
        self._apply(faults)
        return faults

    def reset(self) -> None:
        """Clear faults, release hung requests (503) and drop the free prefix cache."""
        self._apply(Faults())
        if self._hung is not None:
            self._hung.set()
            self._hung = asyncio.Event()
        for served in self._served.values():
            served.driver.model.reset_prefix_cache()

    def _apply(self, faults: Faults) -> None:
        self._faults.faults = faults
        for served in self._served.values():
            served.driver.model.slowdown = faults.slowdown
        if faults.crash:
            self._crash()

    def _crash(self) -> None:
        if self.options.crash_exits_process:
            # A real engine crash: no cleanup, no goodbye.
            os._exit(70)
        self.crashed = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.abort()

    # routing

    async def _handle(self, request: Request, conn: HttpConnection) -> Response | None:
        path, method = request.path, request.method
        if path in {"/v1/chat/completions", "/v1/completions"}:
            if method != "POST":
                return _NOT_ALLOWED
            kind = api.CHAT if path == "/v1/chat/completions" else api.COMPLETION
            return await self._inference(kind, request, conn)
        if path == "/health":
            status = self.faults.health_status
            return Response(status or 200, b"")
        if path == "/metrics":
            return self._metrics()
        if path == "/kv_event_sources":
            sources = self.kv_publisher.sources() if self.kv_publisher is not None else {}
            return Response(200, orjson.dumps(sources))
        if path == "/v1/models":
            config = self.options.engine_config
            body = api.models_body(list(self.options.models), self._created, config.max_model_len)
            return Response(200, body)
        if path == "/admin/faults":
            if method == "GET":
                return Response(200, orjson.dumps(self.faults.to_json()))
            if method != "POST":
                return _NOT_ALLOWED
            try:
                changes = orjson.loads(request.body or b"{}")
                faults = self.faults.updated(changes)
            except (orjson.JSONDecodeError, FaultSpecError) as exc:
                return Response(400, api.error_body(400, str(exc)))
            # Answer first: a crash fault drops this very connection.
            conn.send(Response(200, orjson.dumps(faults.to_json())), keep_alive=True)
            self._apply(faults)
            return None
        if path == "/admin/reset":
            if method != "POST":
                return _NOT_ALLOWED
            self.reset()
            return Response(200, orjson.dumps(self.faults.to_json()))
        return _NOT_FOUND

    def _metrics(self) -> Response:
        mode = self.faults.metrics
        if mode == "error":
            return Response(500, b"Internal Server Error", "text/plain")
        if mode == "garbage":
            return Response(200, _GARBAGE_METRICS, _PROM_CONTENT_TYPE)
        return Response(200, render(self._registry), _PROM_CONTENT_TYPE)

    async def _inference(
        self, kind: str, request: Request, conn: HttpConnection
    ) -> Response | None:
        faults = self.faults
        if faults.hang:
            assert self._hung is not None
            self.hung_requests += 1
            self.signal.notify()
            try:
                await self._hung.wait()
            finally:
                self.hung_requests -= 1
            return Response(503, api.error_body(503, "The replica was reset while hanging."))
        failure = self._faults.inference_failure()
        if failure is not None:
            headers = [("retry-after", "1")] if failure in (429, 503) else []
            message = f"Injected fault: HTTP {failure}."
            return Response(failure, api.error_body(failure, message), headers=headers)
        try:
            # vLLM's validate_json_request: any other media type (or none) is a 400.
            media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
            if media != "application/json":
                raise api.ApiError(
                    400, "Unsupported Media Type: Only 'application/json' is allowed"
                )
            call = api.parse_call(kind, request.body)
            if not call.model:  # absent or null: the default (first served) model
                call = dataclasses.replace(call, model=next(iter(self._served)))
            served = self._served.get(call.model)
            if served is None:
                raise api.ApiError(404, f"The model `{call.model}` does not exist.", "model")
            seq_request = self._seq_request(call)
            try:
                handle = served.driver.submit(seq_request, every_token=call.stream)
            except QueueFullError as exc:
                raise api.ApiError(429, str(exc)) from None
            except RequestTooLargeError as exc:
                raise api.ApiError(400, str(exc)) from None
        except api.ApiError as exc:
            headers = [("retry-after", "1")] if exc.status == 429 else []
            return Response(exc.status, exc.body(), headers=headers)
        self._ids += 1
        prefix = "chatcmpl-" if kind == api.CHAT else "cmpl-"
        response_id = f"{prefix}{(self.index << 48) | self._ids:016x}"
        created = int(time.time())
        try:
            if call.stream:
                await self._stream(call, handle, response_id, created, conn)
                return None
            seq = await handle.wait_finished()
        finally:
            if not handle.seq.finished:
                served.driver.abort(handle)
        return self._full(call, seq, response_id, created)

    def _seq_request(self, call: api.CompletionCall) -> SeqRequest:
        config = self.options.engine_config
        caching, events = config.enable_prefix_caching, self.options.kv_events_port is not None
        given = call.prompt_token_ids
        if given is not None:  # token ids: hashed and published as they are, as vLLM does
            prompt_tokens = len(given)
            hashes = id_block_hashes(given, config.block_size) if caching else ()
            ids = given if events else ()
        else:
            prompt_tokens = count_tokens(call.prompt)
            hashes = block_hashes(call.prompt, config.block_size) if caching else ()
            ids = token_ids(call.prompt) if events else ()
        if call.max_tokens is not None:
            # vLLM (get_max_tokens): max_tokens over the context is a 400; else it is cut to
            # the room the prompt leaves (a 200 ending "length"), not refused.
            if call.max_tokens > config.max_model_len:
                raise api.ApiError(
                    400,
                    f"max_tokens ({call.max_tokens}) cannot be greater than the model's "
                    f"maximum context length ({config.max_model_len})",
                    "max_tokens",
                )
            room = config.max_model_len - prompt_tokens
            wanted = min(call.max_tokens, room) if room > 0 else call.max_tokens
            return SeqRequest(prompt_tokens, wanted, hashes, token_ids=ids)
        low, high = self.options.default_output_tokens
        room = max(1, config.max_model_len - prompt_tokens)
        drawn = min(self._text.length(low, high), room)
        return SeqRequest(prompt_tokens, drawn, hashes, natural_stop=True, token_ids=ids)

    def _full(
        self, call: api.CompletionCall, seq: Sequence, response_id: str, created: int
    ) -> Response:
        text = "".join(self._text.pieces(seq.output_tokens))
        body = api.full_response(
            call,
            response_id,
            created,
            text,
            seq.finish_reason or "stop",
            seq.request.prompt_tokens,
            seq.output_tokens,
            seq.cached_tokens,
        )
        return Response(200, body, headers=[("x-sim-cached-tokens", str(seq.cached_tokens))])

    async def _stream(
        self,
        call: api.CompletionCall,
        handle: SeqHandle,
        response_id: str,
        created: int,
        conn: HttpConnection,
    ) -> None:
        cut_after = self.faults.crash_after_chunks
        chunks = 0

        async def emit(data: bytes) -> None:
            nonlocal chunks
            if cut_after is not None and chunks >= cut_after:
                conn.cut()
                raise ConnectionClosedError
            await conn.write_chunk(data)
            chunks += 1

        conn.start_stream(200, _SSE_CONTENT_TYPE)
        seq = handle.seq
        # vLLM sends the headers at once but the role chunk only with the first token, after
        # prefill: a client timing TTFT to the first chunk must see queueing and prefill.
        await handle.wait_tokens(0)
        first = api.first_chunk(call, response_id, created)
        if first is not None:
            await emit(first)
        sent = 0
        while sent < seq.output_tokens or not seq.finished:
            available = await handle.wait_tokens(sent)
            pieces = self._text.pieces(available - sent)
            for offset, piece in enumerate(pieces):
                last = seq.finished and sent + offset + 1 == available
                reason = seq.finish_reason if last else None
                await emit(api.token_chunk(call, response_id, created, piece, reason))
            sent = available
            if seq.finished and sent == seq.output_tokens:
                break
        if call.include_usage:
            prompt_tokens = seq.request.prompt_tokens
            await emit(api.usage_chunk(call, response_id, created, prompt_tokens, sent))
        await emit(api.SSE_DONE)
        conn.end_stream()
