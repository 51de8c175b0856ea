"""Online calibration of the latency model from what engines publish: seconds of prefill
per computed prompt token, seconds per engine step (time between tokens) for a batch of
one, and prompt tokens computed per request.

Pure: counters arrive through `on_scrape`. Each estimate is a ratio of decayed sums (sum of
seconds / sum of tokens over recent scrapes), so a scrape window that saw one short request
does not swing it. The scorer uses one set of costs per model (`pooled`): replicas
of one model share hardware and per-token costs, while one replica's own numbers also carry
its load (a busy engine's prefills share steps with others and look slower per token), and
routing on those would feed back into them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from llmgw.types import EngineMetrics

_DECAY = 0.9  # per scrape that carried new data: ~10 scrapes of memory
_MIN_TOKENS = 16.0  # a window with fewer computed tokens says little about per-token cost


def _delta(new: float | None, old: float | None) -> float | None:
    """Counter increase, or None when unknown or reset (engine restart)."""
    if new is None or old is None or new < old:
        return None
    return new - old


class Calibration:
    """Per-endpoint latency estimates; None until the endpoint has published or served enough."""

    __slots__ = (
        "_pending",
        "_prefill_den",
        "_prefill_num",
        "_prev",
        "_service_den",
        "_service_num",
        "_step_den",
        "_step_num",
        "_tokens_den",
        "_tokens_num",
        "kv_tokens",
        "prefill_s_per_token",
        "service_s",
        "step_s",
        "tokens_per_prefill",
    )

    def __init__(self) -> None:
        self._prev: EngineMetrics | None = None
        # Deltas not yet folded in: engines count prompt tokens when a request is admitted
        # but observe its prefill time when it finishes, so one scrape window can hold one
        # without the other; folding only windows with both would drop seconds (a bias).
        self._pending = [0.0, 0.0, 0.0]  # prefill seconds, computed tokens, prefills
        self._prefill_num = 0.0  # decayed prefill seconds
        self._prefill_den = 0.0  # decayed computed tokens
        self._step_num = 0.0  # decayed step seconds, normalised to a batch of one
        self._step_den = 0.0  # decayed steps
        self._tokens_num = 0.0  # decayed computed tokens ...
        self._tokens_den = 0.0  # ... per decayed prefills
        # Plain attributes, not properties: read per endpoint on every pick.
        self.prefill_s_per_token: float | None = None
        self.step_s: float | None = None  # one engine step for a batch of one
        self.tokens_per_prefill: float | None = None  # prompt tokens computed per request
        self._service_num = 0.0  # decayed seconds requests spent in the batch ...
        self._service_den = 0.0  # ... per decayed requests
        self.service_s: float | None = None  # mean time a request holds its batch slot
        self.kv_tokens: float | None = None  # the engine's KV cache size, if it says

    def on_scrape(self, m: EngineMetrics, batch_factor: float = 0.02) -> None:
        prev, self._prev = self._prev, m
        if m.kv_tokens is not None:
            self.kv_tokens = m.kv_tokens
        if prev is None:
            return
        tokens = _delta(m.computed_tokens_sum, prev.computed_tokens_sum)
        if tokens is None:
            prompt = _delta(m.prompt_tokens_total, prev.prompt_tokens_total)
            cached = _delta(m.cached_tokens_total, prev.cached_tokens_total)
            if prompt is not None:
                tokens = prompt - (cached or 0.0)
        prefill = _delta(m.prefill_seconds_sum, prev.prefill_seconds_sum)
        prefills = _delta(m.prefill_count, prev.prefill_count)
        pending = self._pending
        if tokens is not None and prefill is not None and prefills is not None:
            pending[0] += prefill
            pending[1] += tokens
            pending[2] += prefills
        else:  # a counter went missing or was reset: what is pending no longer pairs up
            pending[:] = [0.0, 0.0, 0.0]
        seconds, tokens_in, count = pending
        if tokens_in >= _MIN_TOKENS and seconds > 0 and count >= 1:
            pending[:] = [0.0, 0.0, 0.0]
            self._prefill_num = self._prefill_num * _DECAY + seconds
            self._prefill_den = self._prefill_den * _DECAY + tokens_in
            self.prefill_s_per_token = self._prefill_num / self._prefill_den
            self._tokens_num = self._tokens_num * _DECAY + tokens_in
            self._tokens_den = self._tokens_den * _DECAY + count
            self.tokens_per_prefill = self._tokens_num / self._tokens_den
        steps = _delta(m.step_count, prev.step_count)
        step_time = _delta(m.step_seconds_sum, prev.step_seconds_sum)
        if steps and step_time is not None:
            batch = max(1.0, (m.running + prev.running) / 2)
            self._step_num = self._step_num * _DECAY + step_time / (1 + batch_factor * (batch - 1))
            self._step_den = self._step_den * _DECAY + steps
            self.step_s = self._step_num / self._step_den
        served = _delta(m.service_count, prev.service_count)
        service = _delta(m.service_seconds_sum, prev.service_seconds_sum)
        if served and service is not None:
            self._service_num = self._service_num * _DECAY + service
            self._service_den = self._service_den * _DECAY + served
            self.service_s = self._service_num / self._service_den


class Costs(NamedTuple):
    """A model's latency costs, from its endpoints' calibrations (None: not published)."""

    per_token: float | None  # seconds per computed prefill token
    step: float | None  # seconds per engine step, batch of one
    tokens_per_prefill: float | None  # prompt tokens computed per request
    service: float | None  # seconds a request holds its batch slot


def pooled(cals: Iterable[Calibration]) -> Costs:
    """A model's costs over its endpoints. Per-token and per-step costs are upper bounds on
    each engine (a request's prefill time covers the whole step it shared with other
    prefills and decodes; the time between tokens includes steps stalled by prefills), so
    the lowest endpoint's is the tightest. The means are pooled ratios (busier endpoints,
    more data, weigh more)."""
    per_token: float | None = None
    step: float | None = None
    sums = [0.0, 0.0, 0.0, 0.0]
    for c in cals:
        p, s = c.prefill_s_per_token, c.step_s
        if p is not None and (per_token is None or p < per_token):
            per_token = p
        if s is not None and (step is None or s < step):
            step = s
        sums[0] += c._tokens_num
        sums[1] += c._tokens_den
        sums[2] += c._service_num
        sums[3] += c._service_den
    return Costs(
        per_token,
        step,
        sums[0] / sums[1] if sums[1] > 0 else None,
        sums[2] / sums[3] if sums[3] > 0 else None,
    )
