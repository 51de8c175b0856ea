"""Runs the activation state machines: asks the control plane to start/stop, makes callers wait."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from llmgw.activation import Action, ActivationSettings, ActivationState, ModelActivation
from llmgw.config import Config, ModelMode, model_mode
from llmgw.gateway import ConfigSource, config_source
from llmgw.registry import Registry
from llmgw.runtime.controlplanes import ControlPlane, FindsRunning, FollowsEndpoints, StartError
from llmgw.types import Endpoint

STOP_RETRY_S = 10.0  # a failed stop (scale to 0) is tried again this often while off

log = logging.getLogger("llmgw.activator")


class Activator:
    def __init__(
        self,
        config: Config | ConfigSource,
        registry: Registry,
        control_plane: ControlPlane,
        *,
        clock: Callable[[], float] = time.monotonic,
        failure_backoff: float = 10.0,
    ) -> None:
        self._config = config_source(config)
        self.registry = registry
        self.control_plane = control_plane
        self.clock = clock
        self.machines: dict[str, ModelActivation] = {}
        for name, spec in self.config.models.items():
            mode = model_mode(spec)
            if mode in (ModelMode.ON_DEMAND, ModelMode.ALWAYS_ON):
                assert spec.scaling is not None and spec.launch is not None
                self.machines[name] = ModelActivation(
                    name,
                    ActivationSettings(
                        idle_timeout=spec.scaling.idle_timeout,
                        expected_start_seconds=spec.launch.expected_start_seconds,
                        max_waiting_requests=spec.scaling.max_waiting_requests,
                        failure_backoff=failure_backoff,
                        always_on=mode is ModelMode.ALWAYS_ON,
                    ),
                )
        self._ready: dict[str, asyncio.Event] = {m: asyncio.Event() for m in self.machines}
        self._starts: dict[str, asyncio.Task[None]] = {}
        self._ticker: asyncio.Task[None] | None = None
        # Per model, the latest time (registry clock) a peer was seen using it at a pass.
        self._peer_use_seen: dict[str, float] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        # Models whose stop failed: when to try again (while they stay off).
        self._stop_retry_at: dict[str, float] = {}
        control_plane.on_crash(self._on_crash)
        if isinstance(control_plane, FollowsEndpoints):
            control_plane.on_endpoints(self._on_endpoints)

    @property
    def config(self) -> Config:
        """The current config snapshot (timeouts are read per wait, so a reload applies)."""
        return self._config.config

    def manages(self, model: str) -> bool:
        return model in self.machines

    async def start(self, tick: float = 0.5) -> None:
        for name, machine in self.machines.items():
            if machine.settings.always_on:
                self._request(name)
        if isinstance(self.control_plane, FindsRunning):
            self._track(self._adopt(self.control_plane), "adopt running models")
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick_loop(tick), name="activator tick")

    async def stop(self) -> None:
        starting = list(self._starts)
        tasks = [
            t for t in (self._ticker, *self._starts.values(), *self._cleanups) if t is not None
        ]
        self._ticker = None
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        # Requests waiting for a start that will not finish: a failed start now, not a wait
        # that finds the model still starting (woken again and again, or not at all if the
        # start was cancelled before it ran) until their activation_timeout.
        for model in starting:
            machine = self.machines[model]
            if not (machine.running or machine.failed):
                machine.start_failed("the router is stopping", self.clock())
            self._ready[model].set()
        await self.control_plane.close()

    async def _adopt(self, plane: FindsRunning) -> None:
        """Models a previous router process left running: started here too (their start
        finds the replicas up and only follows them), so their idle timeout applies; left
        alone, they kept their GPUs until a request for them came."""
        try:
            running = await plane.running_models()
        except Exception:
            log.exception("cannot tell which models are already running")
            return
        for model in running:
            machine = self.machines.get(model)
            if machine is not None and machine.state is ActivationState.OFF:
                log.info("model %s is already up (left by a previous llmgw?): adopted", model)
                self._request(model)

    def _request(self, model: str) -> None:
        if self.machines[model].request(self.clock()) is Action.START:
            self._launch(model)

    def _launch(self, model: str) -> None:
        # The start belongs to the activator, not to any waiter: a waiter giving up
        # (timeout, client gone) must not cancel it.
        self._ready[model].clear()
        self._stop_retry_at.pop(model, None)  # started again: no stop is owed
        self._starts[model] = asyncio.create_task(self._start(model), name=f"start {model}")

    async def _start(self, model: str) -> None:
        machine = self.machines[model]
        try:
            endpoints = await self.control_plane.want(model)
        except StartError as exc:
            log.warning("start of %s failed: %s", model, exc)
            machine.start_failed(str(exc), self.clock())
        except Exception as exc:  # a control-plane bug must not leave waiters hanging
            log.exception("start of %s crashed", model)
            machine.start_failed(f"{type(exc).__name__}: {exc}", self.clock())
        except asyncio.CancelledError:  # the router stops: its waiters' start has failed
            machine.start_failed("the router is stopping", self.clock())
            raise
        else:
            if not endpoints:  # nothing to route to: a failed start, said so, not a wait
                machine.start_failed("the control plane started it with no replica", self.clock())
                log.warning("start of %s failed: the control plane returned no replica", model)
                return
            self.registry.set_endpoints(model, endpoints, fresh=True)
            machine.started(self.clock())
            log.info("model %s ready after %.2fs", model, machine.last_start_seconds or 0.0)
        finally:
            self._starts.pop(model, None)
            self._ready[model].set()  # wake waiters: ready or failed, they re-check

    async def ensure_ready(self, model: str) -> None:
        """Wait until the model has a ready replica, at most `activation_timeout`.

        Raises ModelLoading (503 + Retry-After) on timeout, ModelFailed when the start
        failed, NoCapacity when too many requests already wait.
        """
        machine = self.machines[model]
        if machine.running and self.registry.states(model):
            return
        self._request(model)
        if machine.failed:
            # In its backoff: said so before the waiter cap, which still counts a failed
            # start's waiters until they run again (this request got 429 then).
            raise machine.not_ready_error(self.clock())
        machine.begin_wait(self.clock())
        try:
            deadline = self.clock() + self.config.activation_timeout
            poll = self.config.activation_poll_interval
            while not (machine.running and self.registry.states(model)):
                if machine.failed:
                    raise machine.not_ready_error(self.clock())
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise machine.not_ready_error(self.clock())
                ready = self._ready[model]
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(poll, remaining)):
                        await ready.wait()
                if ready.is_set():
                    # Woken, and the model is still not ready here (a start that ended
                    # neither way, or running with no replica in the registry): a set event
                    # does not suspend the next wait, and this loop would hold the event
                    # loop to its deadline (found by a review helper).
                    ready.clear()
        finally:
            machine.end_wait()

    def use_begin(self, model: str) -> None:
        machine = self.machines.get(model)
        if machine is not None:
            machine.use_begin(self.clock())

    def use_end(self, model: str) -> None:
        machine = self.machines.get(model)
        if machine is not None:
            machine.use_end(self.clock())

    def _on_endpoints(self, model: str, endpoints: list[Endpoint]) -> None:
        """A running model's replicas changed after its start (an autoscaler, a rollout):
        the registry follows through the one update path; state of those that stay is kept."""
        machine = self.machines.get(model)
        if machine is not None and machine.running and model not in self._starts:
            self.registry.set_endpoints(model, endpoints)

    def _on_crash(self, model: str, reason: str) -> None:
        machine = self.machines.get(model)
        if machine is None:
            return
        log.warning("model %s crashed: %s", model, reason)
        self.registry.set_endpoints(model, [])
        machine.crashed(reason, self.clock())
        # Release what is left (a crash-looping Deployment would otherwise keep its GPU);
        # the next request after the backoff starts the model again.
        self._track(self._release(model, "crashed"), f"release {model}")

    def _track(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(work, name=name)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _release(self, model: str, why: str) -> None:
        try:
            await self.control_plane.stop(model)
        except Exception as exc:  # tried again (the API server away, say)
            if isinstance(exc, StartError):  # says what went wrong: no traceback
                log.warning("stopping %s model %s failed: %s (retrying)", why, model, exc)
            else:
                log.exception("stopping %s model %s failed", why, model)
            self._stop_retry_at[model] = self.clock() + STOP_RETRY_S
        else:
            self._stop_retry_at.pop(model, None)

    async def tick(self) -> None:
        """One pass over the models; returns once the idle stops it began have ended."""
        for task in self._pass():
            await task

    def _pass(self) -> list[asyncio.Task[None]]:
        """Starts and idle stops due now. A stop runs as its own task (a Deployment's pods
        may take `stop_timeout` to drain): awaited here, it held every other model's idle
        stop and crash restart for that long."""
        stops = []
        for model, machine in self.machines.items():
            # Requests the peer router replicas have in flight there (`peers:`): scaling the
            # model to 0 would cut them off. One that began and ended since the last pass
            # left only its time (`remote_busy_at`): it restarts the idle timer too.
            states = self.registry.states(model)
            elsewhere = any(s.remote_inflight > 0 for s in states)
            busy_at = max((s.remote_busy_at for s in states), default=-math.inf)
            if busy_at > self._peer_use_seen.get(model, -math.inf):
                self._peer_use_seen[model] = busy_at
                elsewhere = True
            action = machine.tick(self.clock(), elsewhere)
            if action is Action.START:
                self._launch(model)
            elif action is Action.STOP:
                log.info("model %s idle for %.0fs: stopping", model, machine.settings.idle_timeout)
                self.registry.set_endpoints(model, [])
                stops.append(self._track(self._release(model, "idle"), f"stop {model}"))
            elif (
                machine.state is ActivationState.OFF
                and self._stop_retry_at.get(model, math.inf) <= self.clock()
            ):  # a stop that failed: the model reads off, its replicas must be too
                self._stop_retry_at[model] = math.inf  # until this try says
                stops.append(self._track(self._release(model, "off"), f"stop {model}"))
        return stops

    async def _tick_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                self._pass()
            except Exception:
                log.exception("activator tick failed")

    def status(self) -> dict[str, dict[str, object]]:
        now = self.clock()
        return {
            m: {**machine.status(now), "control_plane": self.control_plane.status(m)}
            for m, machine in self.machines.items()
        }
