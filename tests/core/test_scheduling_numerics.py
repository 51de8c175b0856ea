"""What one engine publishes must not break the latency model for the rest: absurd,
overflowing or negative numbers are left out, a pick never raises, NaN never reaches the
picker, and a unit slip on one endpoint does not set every endpoint's price."""

from __future__ import annotations

import math

import pytest

from llmgw.calibration import pooled
from llmgw.errors import MetricsError
from llmgw.promtext import CONTRACTS, extract
from llmgw.registry import Registry
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.types import Engine, RequestInfo

from .helpers import FakeClock, config

VLLM = CONTRACTS[Engine.VLLM]


def build(n: int) -> tuple[Scheduler, FakeClock, list[str], LatencyScorer]:
    clock = FakeClock(1000.0)
    endpoints = [f"10.0.0.{i + 1}:8000" for i in range(n)]
    scheduler = Scheduler(
        config({"m": {"endpoints": endpoints, "strategy": "latency"}}), Registry(clock=clock)
    )
    scorer = scheduler.routers["m"].scorers[0][0]
    assert isinstance(scorer, LatencyScorer)
    return scheduler, clock, endpoints, scorer


def page(
    waiting: float = 0,
    running: float = 0,
    *,
    histograms: dict[str, tuple[float, float]] | None = None,
    counters: dict[str, float] | None = None,
    cache_info: tuple[tuple[str, str], ...] = (),
) -> str:
    lines = [
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}',
        f'vllm:num_requests_running{{model_name="m"}} {running}',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5',
    ]
    for name, value in (counters or {}).items():
        lines.append(f'vllm:{name}{{model_name="m"}} {value}')
    for name, (total, count) in (histograms or {}).items():
        lines += [f'vllm:{name}_sum{{model_name="m"}} {total}',
                  f'vllm:{name}_count{{model_name="m"}} {count}']  # fmt: skip
    for engine, (blocks, size) in enumerate(cache_info):
        lines.append(
            f'vllm:cache_config_info{{engine="{engine}",block_size="{size}",'
            f'num_gpu_blocks="{blocks}"}} 1.0'
        )
    return "\n".join(lines) + "\n"


def scrape(scheduler: Scheduler, endpoint: str, text: str) -> None:
    scheduler.registry.record_scrape("m", endpoint, extract(text, VLLM, model="m"))


def request(i: int) -> RequestInfo:
    prompt = "x" * 4000
    return RequestInfo(model="m", request_id=f"r{i}", prompt=prompt, prompt_tokens=1000)


def test_a_kv_size_that_overflows_when_summed_never_fails_a_pick() -> None:
    """Two cache_config_info series of 1e308 blocks each: their sum, inf, made every pick of
    the model raise (a 500 for every request), from one endpoint."""
    scheduler, clock, endpoints, _ = build(3)
    for endpoint in endpoints:
        scrape(scheduler, endpoint, page())
    scrape(scheduler, endpoints[0], page(cache_info=(("1e308", "1"), ("1e308", "1"))))
    for i in range(10):
        clock.advance(0.2)
        assert scheduler.pick(request(i)).endpoint.address in endpoints


def engine_pages(n: int, per_token: float, step: float, service: float) -> str:
    return page(
        8,
        8,
        counters={"prompt_tokens_total": n * 1000, "request_success_total": n},
        histograms={
            "request_prefill_time_seconds": (n * 1000 * per_token, n),
            "request_prefill_kv_computed_tokens": (n * 1000, n),
            "inter_token_latency_seconds": (n * 50 * step, n * 50),
            "request_inference_time_seconds": (n * service, n),
        },
    )


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"per_token": 1e-313}, "per_token"),  # a denormal: the model's minimum priced all
        ({"service": 2000.0}, "service"),  # milliseconds published for seconds
    ],
)
def test_one_endpoints_absurd_number_does_not_set_the_models_price(
    bad: dict[str, float], field: str
) -> None:
    scheduler, clock, endpoints, _ = build(4)
    sane = {"per_token": 1e-4, "step": 0.02, "service": 2.0}
    n = 0
    for _ in range(30):
        n += 10
        clock.advance(0.1)
        for i, endpoint in enumerate(endpoints):
            scrape(scheduler, endpoint, engine_pages(n, **(sane | bad if i == 3 else sane)))
    costs = pooled(s.calibration for s in scheduler.registry.states("m"))
    value = costs.per_token if field == "per_token" else costs.service
    assert value == pytest.approx(sane[field], rel=0.05)
    raw = scheduler.pick(request(0)).rationale.columns[0].raw
    assert min(raw) > 0.5  # equal engines look alike (it was 0.04 against 1.0)


def test_non_finite_costs_never_reach_the_picker() -> None:
    """A NaN anywhere made every score NaN, and the picker took list order."""
    scheduler, _, endpoints, scorer = build(3)
    for endpoint in endpoints:
        scrape(scheduler, endpoint, page())
    scorer.speeds_override = {endpoints[0]: math.inf}
    for i in range(10):
        decision = scheduler.pick(request(i))
        raw = decision.rationale.columns[0].raw
        assert all(math.isfinite(v) for v in raw)
        assert decision.endpoint.address != endpoints[0]


@pytest.mark.parametrize("running", ["18446744073709551615", "-5"])
def test_a_gauge_that_is_no_count_of_requests_is_refused(running: str) -> None:
    """An unsigned underflow set the endpoint's peak batch to 1.8e19 for good."""
    with pytest.raises(MetricsError, match="is not a count of requests"):
        extract(page(running=float(running)), VLLM, model="m")


def test_a_first_token_count_that_jumps_past_a_float_does_not_fail_the_scrape() -> None:
    """A count from -1e308 to 1e308: the delta, inf, raised on every scrape thereafter."""
    scheduler, clock, endpoints, _ = build(2)
    histogram = "time_to_first_token_seconds"
    registry = scheduler.registry
    registry.record_scrape("m", endpoints[0], extract(page(), VLLM, model="m"))
    for count in (1.0, 1e300, 1e308):
        clock.advance(0.1)
        scrape(scheduler, endpoints[0], page(histograms={histogram: (1.0, count)}))
    state = registry.get("m", endpoints[0])
    assert state is not None and state.metrics is not None


def full_batch_page(n: int, running: float = 8) -> str:
    """A full batch of 8 with 6 waiting, a request's service 2 s; `running` as published."""
    return (
        engine_pages(n, per_token=1e-4, step=0.02, service=2.0)
        .replace('vllm:num_requests_waiting{model_name="m"} 8', 'vllm:num_requests_waiting{model_name="m"} 6')
        .replace('vllm:num_requests_running{model_name="m"} 8', f'vllm:num_requests_running{{model_name="m"}} {running}')
    )  # fmt: skip


def scrape_twins_one_glitching(scheduler: Scheduler, clock: FakeClock) -> None:
    """Two engines publish the same full-batch pages for 4 s; once, halfway, the second's
    running gauge reads 65535 (a 16-bit underflow, under the gauge's sanity cap)."""
    a, b = (s.id for s in scheduler.registry.states("m"))
    n = 0
    for k in range(40):
        n += 10
        clock.advance(0.1)
        for endpoint in (a, b):
            running = 65535 if endpoint == b and k == 20 else 8
            scrape(scheduler, endpoint, full_batch_page(n, running))


def test_one_glitched_running_gauge_does_not_change_an_endpoints_price_for_good() -> None:
    """One scrape's running gauge became the endpoint's peak batch until a restart: its
    batch-slot and full-queue waits were never priced again (found by a review helper)."""
    scheduler, clock, _, scorer = build(2)
    scrape_twins_one_glitching(scheduler, clock)
    scheduler.pick(request(0))
    a, b = scorer.terms()["ttft_s"]
    assert b >= 0.8 * a


def test_after_one_glitched_scrape_equal_engines_still_share_new_requests() -> None:
    """Since that glitch the engine looked free of batch-slot waits: it drew every new
    request while its twin stood idle (found by a review helper)."""
    scheduler, clock, endpoints, _ = build(2)
    scrape_twins_one_glitching(scheduler, clock)
    registry = scheduler.registry
    sent = dict.fromkeys(endpoints, 0)
    for i in range(20):  # 20 new requests within one scrape interval, each kept in flight
        prompt = f"{i:06d}" + "x" * 3994
        info = RequestInfo(model="m", request_id=f"r{i}", prompt=prompt, prompt_tokens=1000)
        decision = scheduler.pick(info)
        chosen = decision.endpoint.address
        registry.acquire("m", chosen)
        registry.add_prefill("m", chosen, 1000.0, ready_at=decision.ready_at)
        sent[chosen] += 1
    assert sent[endpoints[0]] >= 5, sent
