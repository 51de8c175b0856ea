"""List + watch one Kubernetes query and keep its objects current (client-go's reflector).

List, then watch from the list's resourceVersion with bookmarks on; when a watch ends
(the server's `timeoutSeconds`), watch again from the last version seen (bookmarks keep
it fresh); on 410 Gone (the version expired) list again; a refused watch (403, 405) polls
the list for a while instead; on any other error, and on a watch that ends at once with no
event, back off (exponential, jittered, capped) and list again. The back-off starts over
once a watch works (an event, or a watch the server ended in time) or a polled list
answers: a good list between failing watches does not reset it. While the API cannot be
reached the last objects are kept and `stale_since` says since when.

The official client is synchronous: calls run on a thread pool the owner passes in, so
long-lived watches never hold the loop's default executor (which DNS lookups need).
Objects are the API's JSON (camelCase dicts), never the client's model classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from llmgw.runtime.controlplanes import StartError
from llmgw.runtime.kube import DISCOVERY_RBAC, forbidden, status_message, unreachable

log = logging.getLogger("llmgw.k8s")

_WatchBase: Any = k8s_watch.Watch  # untyped in the client (mypy --strict)
SHORT_WATCH = 1.0  # seconds: a watch ended sooner with no event failed (client-go's rule)


def _server_trouble(exc: ApiException) -> bool:
    """429 (throttled) or 5xx: the API server cannot answer now; a retry may succeed."""
    return isinstance(exc.status, int) and (exc.status == 429 or exc.status >= 500)


class _RawWatch(_WatchBase):  # type: ignore[misc]
    """A Watch that hands out the raw JSON events: no model classes (custom resources
    have none), and the resourceVersion is tracked by the reflector itself."""

    def get_return_type(self, func: Any) -> None:
        return None


@dataclass(frozen=True, slots=True)
class Query:
    """One namespaced list: a client list function, its leading arguments and selectors."""

    list_fn: Callable[..., Any]
    args: tuple[Any, ...]
    resource: str  # "endpointslices.discovery.k8s.io": for messages
    namespace: str
    label_selector: str | None = None
    field_selector: str | None = None

    def kwargs(self) -> dict[str, str]:
        out = {}
        if self.label_selector:
            out["label_selector"] = self.label_selector
        if self.field_selector:
            out["field_selector"] = self.field_selector
        return out

    def describe(self) -> str:
        selectors = ",".join(s for s in (self.label_selector, self.field_selector) if s)
        return f"{self.resource} in {self.namespace!r}" + (f" ({selectors})" if selectors else "")


OnChange = Callable[[Mapping[str, dict[str, Any]]], None]


class Reflector:
    def __init__(
        self,
        query: Query,
        on_change: OnChange,
        *,
        pool: ThreadPoolExecutor,
        api_client: Any,
        what: str,
        request_timeout: float = 10.0,
        watch_timeout: int = 60,
        backoff: tuple[float, float] = (0.2, 30.0),
        watch: bool = True,
        poll_interval: float = 1.0,
        watch_retry: float = 60.0,
        on_forbidden: Callable[[str, ApiException], StartError] | None = None,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.query = query
        # Without watch (or while the server refuses it) the list is polled instead.
        self.use_watch = watch
        self.poll_interval = poll_interval
        self.watch_retry = watch_retry
        self._watch_retry_at = 0.0
        self.mode = "idle"  # idle | list | watch
        self._on_error = on_error  # told of every failure (a start waiting may give up)
        self._on_forbidden = on_forbidden or (
            lambda verb, exc: forbidden(verb, query.resource, query.namespace, exc)
        )
        self.on_change = on_change
        self.what = what  # "model chat (service models/vllm-chat)": for log lines
        self.request_timeout = request_timeout
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self.items: dict[str, dict[str, Any]] = {}
        self.version: str | None = None
        self.stale_since: float | None = None  # wall clock of the first failed contact
        self._stale_mono: float | None = None
        self.last_error: str | None = None
        # RBAC refused the list, or the API does not serve it (no CRD): a startup error.
        self.forbidden: StartError | None = None
        # The first list answered, or failed for good (`forbidden`): a start waits for it.
        # Other failures (429, 500, the API unreachable) are retried: a start keeps waiting.
        self.listed = asyncio.Event()
        self.lists = 0
        self.watches = 0
        self.expired = 0  # 410s seen
        self._pool = pool
        self._api_client = api_client
        self._failures = 0
        self._stopping = asyncio.Event()
        self._stopped = threading.Event()  # read by the watch thread
        self._watch: Any = None
        self._watch_thread: Future[int] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"reflect {self.what}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping.set()
        self._stopped.set()
        # Watch.stop() shuts the stream's socket down once the request is made: repeat it
        # until the watch thread has returned (bounded), so no thread lingers.
        deadline = time.monotonic() + self.request_timeout
        while self._watch_thread is not None and not self._watch_thread.done():
            if self._watch is not None:
                self._watch.stop()
            if time.monotonic() > deadline:
                log.warning("watch of %s did not stop within %gs", self.what, self.request_timeout)
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        self.mode = "idle"

    def stale_seconds(self) -> float:
        """Seconds since contact with the API was lost (0: in contact)."""
        return 0.0 if self._stale_mono is None else time.monotonic() - self._stale_mono

    # -- the loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._list()
            except Exception as exc:  # API errors; connection refused, timeouts: API away
                self._failed(exc)
                if self.forbidden is not None:
                    self.listed.set()
                await self._back_off()
                continue
            self.listed.set()
            if not self.use_watch or time.monotonic() < self._watch_retry_at:
                self.mode = "list"
                self._failures = 0
                await self._pause(self.poll_interval)
                continue
            self.mode = "watch"
            while not self._stopping.is_set():
                opened = time.monotonic()
                try:
                    events = await self._watch_once()
                except ApiException as exc:
                    if exc.status == 410:  # our version expired: list again, at once
                        self.expired += 1
                        log.info("watch of %s expired (410): listing again", self.what)
                    elif _server_trouble(exc):  # not a refusal: back off, list, watch again
                        self._failed(exc, verb="watch")
                        await self._back_off()
                    else:
                        # Refused (403: a Role granting list but not watch; 405: a proxy):
                        # poll the list for a while instead. Retried at the back-off, each
                        # good list reset it: ten requests and an ERROR line a second.
                        self._watch_refused(exc)
                    break
                except Exception as exc:
                    if self._stopping.is_set():
                        return
                    self._failed(exc, verb="watch")
                    await self._back_off()
                    break
                if self._stopping.is_set():
                    return
                if events == 0 and time.monotonic() - opened < SHORT_WATCH:
                    # Ended at once with nothing (a proxy cutting long requests): opened
                    # again at once, it made a busy loop of requests.
                    self._short_watch()
                    await self._back_off()
                    break
                self._failures = 0  # the server ended it in time: watches work

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _list(self) -> None:
        query = self.query
        response = await self._call(
            query.list_fn,
            *query.args,
            **query.kwargs(),
            _preload_content=False,
            _request_timeout=self.request_timeout,
        )
        status = int(getattr(response, "status", 200))
        if not 200 <= status < 300:
            raise ApiException(status=status, reason=response.reason, http_resp=response)
        body = json.loads(response.data)
        self.lists += 1
        self.items = {
            str(item["metadata"]["name"]): item
            for item in body.get("items") or []
            if (item.get("metadata") or {}).get("name")
        }
        self.version = (body.get("metadata") or {}).get("resourceVersion")
        self._in_contact()
        self.forbidden = None
        self.on_change(self.items)

    async def _watch_once(self) -> int:
        """One watch request, until the server ends it; events are applied on the loop.
        Returns how many events (bookmarks included) it brought."""
        loop = asyncio.get_running_loop()
        watch = self._watch = _RawWatch()
        stopped = self._stopped
        query = self.query
        version = self.version

        def run() -> int:
            events = 0
            stream = watch.stream(
                query.list_fn,
                *query.args,
                **query.kwargs(),
                resource_version=version,
                timeout_seconds=self.watch_timeout,
                allow_watch_bookmarks=True,
                _request_timeout=self.watch_timeout + self.request_timeout,
            )
            for event in stream:
                if stopped.is_set():
                    watch.stop()
                    break
                events += 1
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
                    loop.call_soon_threadsafe(self._on_event, event["type"], event["raw_object"])
            return events

        self.watches += 1
        self._watch_thread = self._pool.submit(run)
        try:
            return await asyncio.wrap_future(self._watch_thread)
        finally:
            self._watch = None

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        if self._stopped.is_set() or not isinstance(obj, dict):
            return
        metadata = obj.get("metadata") or {}
        if metadata.get("resourceVersion"):
            self.version = str(metadata["resourceVersion"])
        self._in_contact()
        self._failures = 0  # the watch works
        name = metadata.get("name")
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not name:
            return  # BOOKMARK: only the version moved
        if kind == "DELETED":
            self.items.pop(name, None)
        else:
            self.items[name] = obj
        self.on_change(self.items)

    # -- contact and errors ---------------------------------------------------------------
    def _in_contact(self) -> None:
        if self._stale_mono is not None:
            log.warning(
                "Kubernetes API reachable again for %s after %.1fs without it: caught up",
                self.what,
                time.monotonic() - self._stale_mono,
            )
        self.stale_since = self._stale_mono = None
        self.last_error = None

    def _failed(self, exc: BaseException, verb: str = "list") -> None:
        self._failures += 1
        if isinstance(exc, ApiException):
            if exc.status in (401, 403):
                error = self._on_forbidden(verb, exc)
                self.forbidden = error
                message = str(error)
            elif exc.status == 404 and verb == "list":  # the collection is not served
                message = (
                    f"the Kubernetes API does not serve {self.query.describe()} (404): is its "
                    "CustomResourceDefinition installed? (InferencePool: GIE's CRDs, API "
                    f"group inference.networking.k8s.io/v1) ({status_message(exc)})"
                )
                self.forbidden = StartError(message)  # like RBAC: a start error, not a wait
            else:
                message = f"API error {exc.status} on {verb} {self.query.describe()}: " + (
                    status_message(exc)
                )
        else:
            message = unreachable(exc, self._api_client)
        self.last_error = message
        if self._on_error is not None:
            self._on_error()
        if self._stale_mono is None:
            self._stale_mono = time.monotonic()
            self.stale_since = time.time()
            since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.stale_since))
            log.log(
                logging.ERROR if self.forbidden is not None else logging.WARNING,
                "Kubernetes API lost for %s since %s: keeping the last %d known objects "
                "and retrying: %s",
                self.what,
                since,
                len(self.items),
                message,
                extra={"since": since},
            )
        else:
            log.debug("%s: still failing: %s", self.what, message)

    def _short_watch(self) -> None:
        self._failures += 1
        log.log(
            logging.WARNING if self._failures == 1 else logging.DEBUG,
            "watch of %s ended at once with no event (a proxy cutting long requests?): "
            "backing off, then listing again",
            self.what,
        )

    def _watch_refused(self, exc: ApiException) -> None:
        hint = ""
        if exc.status == 403:
            hint = f"; grant `watch` on it ({DISCOVERY_RBAC})"
        elif exc.status == 401:
            hint = "; the credentials were rejected (token or kubeconfig)"
        log.warning(
            "watching %s refused (%s %s): listing every %gs for %gs%s",
            self.what,
            exc.status,
            status_message(exc),
            self.poll_interval,
            self.watch_retry,
            hint,
        )
        self.mode = "list"
        self._watch_retry_at = time.monotonic() + self.watch_retry

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if the reflector is stopped meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    async def _back_off(self) -> None:
        first, cap = self.backoff
        delay = min(cap, first * 2 ** min(self._failures - 1, 16))
        delay *= random.uniform(0.8, 1.2)  # retries of many routers do not line up
        await self._pause(delay)
