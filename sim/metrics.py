"""Prometheus /metrics with each real engine's metric names and label sets.

Names are written out here on purpose, apart from the router's contracts: a typo on
either side must make a test fail, not agree with itself. Sources: a real vLLM 0.32.0
page (engine="0", model_name), SGLang's SchedulerMetricsCollector (model_name,
engine_type, tp_rank, pp_rank, moe_ep_rank) and TokenizerMetricsCollector (model_name),
TensorRT-LLM's MetricsCollector (model_name, engine_type="trtllm").

Values are read from the engine model at scrape time by a custom collector, so serving a
request costs only a few histogram bucket increments.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

from llmgw.sim.model import FINISH_ABORT, EngineModel, Sequence

ENGINES = ("vllm", "sglang", "trtllm")

# Bucket bounds copied from vLLM 0.32.0's /metrics page (tests/fixtures checks them).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vLLM's request-latency buckets: e2e, queue, prefill, decode and inference time.
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's inter-token latency and per-request time per output token.
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# SGLang's TokenizerMetricsCollector defaults (python/sglang/srt/metrics/collector.py).
SGLANG_TTFT_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
    200.0, 400.0,
)  # fmt: skip
SGLANG_E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
    200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0,
)  # fmt: skip
SGLANG_ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
# (ttft, e2e, itl) bounds per engine; TensorRT-LLM keeps vLLM's.
BUCKETS: dict[str, tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]] = {
    "vllm": (TTFT_BUCKETS, E2E_BUCKETS, ITL_BUCKETS),
    "sglang": (SGLANG_TTFT_BUCKETS, SGLANG_E2E_BUCKETS, SGLANG_ITL_BUCKETS),
    "trtllm": (TTFT_BUCKETS, E2E_BUCKETS, ITL_BUCKETS),
}
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's bounds for per-request token counts (build_1_2_5_buckets): 1, 2, 5, 10, ...
    up to `max_model_len`."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


@dataclass
class LatencyHistogram:
    """Cumulative-free bucket counts; rendered as Prometheus cumulative buckets."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((str(float(bound)), float(running)))
        out.append(("+Inf", float(running + self.counts[-1])))
        return out


class ModelObservations:
    """Per-model latency histograms, fed as vLLM feeds them: time to first token when the
    first token comes (`first_token`), the rest when a sequence finishes (`observe`; queue =
    scheduled - arrival, prefill = first token - scheduled, decode = last token - first
    token, inference = last token - scheduled; computed = prompt - cached tokens). A scrape
    in between sees a request's time to first token and not yet its prefill or queue time,
    as on vLLM."""

    def __init__(self, engine: str = "vllm", max_model_len: int = 8192) -> None:
        ttft, e2e, itl = BUCKETS[engine]
        self.computed = LatencyHistogram(token_buckets(max_model_len))
        self.ttft = LatencyHistogram(ttft)
        self.e2e = LatencyHistogram(e2e)
        self.queue = LatencyHistogram(e2e)
        self.prefill = LatencyHistogram(e2e)
        self.decode = LatencyHistogram(e2e)
        self.inference = LatencyHistogram(e2e)
        self.itl = LatencyHistogram(itl)
        self.tpot = LatencyHistogram(itl)
        self.created = time.time()

    def first_token(self, seq: Sequence) -> None:
        if seq.first_token_time is not None:
            self.ttft.observe(seq.first_token_time - seq.arrival_time)

    def observe(self, seq: Sequence) -> None:
        # vLLM observes inter-token latencies as the tokens come, so an aborted request's
        # count; the rest is recorded for finished requests only (an abort drops its stats).
        for gap in seq.token_intervals:
            self.itl.observe(gap)
        if seq.finish_reason == FINISH_ABORT:
            return
        scheduled, first, last = seq.scheduled_time, seq.first_token_time, seq.last_token_time
        if scheduled is not None:
            self.queue.observe(scheduled - seq.arrival_time)
        if seq.finished_time is not None:
            self.e2e.observe(seq.finished_time - seq.arrival_time)
        self.computed.observe(seq.request.prompt_tokens - seq.cached_tokens)
        if scheduled is not None and first is not None and last is not None:
            self.prefill.observe(first - scheduled)
            self.decode.observe(last - first)
            self.inference.observe(last - scheduled)
            if seq.output_tokens > 1:
                self.tpot.observe((last - first) / (seq.output_tokens - 1))


@dataclass
class ServedModel:
    """What the collector needs for one served model."""

    name: str
    engine: EngineModel
    observations: ModelObservations


def _histogram(
    name: str, doc: str, labels: dict[str, str], hist: LatencyHistogram
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), hist.buckets(), hist.total)
    family.samples.append(Sample(name + "_created", labels, hist.created))
    return family


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(
    name: str, doc: str, labels: dict[str, str], value: float, created: float
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value, created=created)
    return family


def _hit_rate(engine: EngineModel) -> float:
    queries = engine.stats.prefix_queries_tokens
    return engine.stats.prefix_hits_tokens / queries if queries else 0.0


def vllm_metrics(served: ServedModel) -> Iterator[Metric]:
    engine, obs = served.engine, served.observations
    stats, created = engine.stats, obs.created
    labels = {"engine": "0", "model_name": served.name}
    yield _gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        labels,
        len(engine.running),
    )
    yield _gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        labels,
        len(engine.waiting),
    )
    yield _gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        labels,
        engine.kv.usage(),
    )
    yield _counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        labels,
        stats.prefix_queries_tokens,
        created,
    )
    yield _counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        labels,
        stats.prefix_hits_tokens,
        created,
    )
    yield _counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        labels,
        stats.prompt_tokens,
        created,
    )
    yield _counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        labels,
        stats.generation_tokens,
        created,
    )
    yield _counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        labels,
        stats.preemptions,
        created,
    )
    success = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=["engine", "finished_reason", "model_name"],
    )
    for reason in VLLM_FINISH_REASONS:
        success.add_metric(["0", reason, served.name], stats.finished.get(reason, 0), created)
    yield success
    yield _histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        labels,
        obs.ttft,
    )
    yield _histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        labels,
        obs.e2e,
    )
    yield _histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        labels,
        obs.queue,
    )
    yield _histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        labels,
        obs.prefill,
    )
    yield _histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        labels,
        obs.decode,
    )
    yield _histogram(
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        labels,
        obs.inference,
    )
    yield _histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        labels,
        obs.itl,
    )
    yield _histogram(
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        labels,
        obs.tpot,
    )
    yield _histogram(
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        labels,
        obs.computed,
    )
    config = engine.config
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"],
    )
    info.add_metric(
        [
            str(config.block_size),
            str(config.enable_prefix_caching),
            "0",
            str(config.kv_blocks),
        ],
        1.0,
    )
    yield info


def sglang_metrics(served: ServedModel) -> Iterator[Metric]:
    engine, obs = served.engine, served.observations
    stats, created = engine.stats, obs.created
    scheduler = {
        "model_name": served.name,
        "engine_type": "unified",
        "tp_rank": "0",
        "pp_rank": "0",
        "moe_ep_rank": "0",
    }
    tokenizer = {"model_name": served.name}
    yield _gauge(
        "sglang:num_running_reqs",
        "The number of running requests.",
        scheduler,
        len(engine.running),
    )
    yield _gauge(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        scheduler,
        len(engine.waiting),
    )
    yield _gauge("sglang:token_usage", "The token usage.", scheduler, engine.kv.usage())
    yield _gauge(
        "sglang:num_used_tokens",
        "The number of used tokens.",
        scheduler,
        engine.kv.used_blocks * engine.config.block_size,
    )
    yield _gauge(
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        scheduler,
        engine.config.kv_blocks * engine.config.block_size,
    )
    yield _gauge(
        "sglang:cache_hit_rate", "The prefix cache hit rate.", scheduler, _hit_rate(engine)
    )
    yield _counter(
        "sglang:prompt_tokens",
        "Number of prefill tokens processed.",
        tokenizer,
        stats.prompt_tokens,
        created,
    )
    yield _counter(
        "sglang:generation_tokens",
        "Number of generation tokens processed.",
        tokenizer,
        stats.generation_tokens,
        created,
    )
    yield _counter(
        "sglang:cached_tokens",
        "Number of cached prompt tokens.",
        tokenizer,
        stats.prefix_hits_tokens,
        created,
    )
    yield _counter(
        "sglang:num_requests",
        "Number of requests processed.",
        tokenizer,
        sum(stats.finished.values()),
        created,
    )
    yield _histogram(
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        tokenizer,
        obs.ttft,
    )
    yield _histogram(
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        tokenizer,
        obs.e2e,
    )
    yield _histogram(
        "sglang:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        tokenizer,
        obs.itl,
    )


def trtllm_metrics(served: ServedModel) -> Iterator[Metric]:
    engine, obs = served.engine, served.observations
    stats, created = engine.stats, obs.created
    labels = {"model_name": served.name, "engine_type": "trtllm"}
    yield _gauge(
        "trtllm_num_requests_waiting",
        "Number of requests waiting in the queue.",
        labels,
        len(engine.waiting),
    )
    yield _gauge(
        "trtllm_num_requests_running",
        "Number of requests currently running.",
        labels,
        len(engine.running),
    )
    yield _gauge(
        "trtllm_kv_cache_utilization",
        "KV cache utilization (0 to 1).",
        labels,
        engine.kv.usage(),
    )
    yield _gauge("trtllm_kv_cache_hit_rate", "KV cache hit rate.", labels, _hit_rate(engine))
    success = CounterMetricFamily(
        "trtllm_request_success",
        "Count of successfully processed requests.",
        labels=["model_name", "engine_type", "finished_reason"],
    )
    for reason in ("stop", "length", "abort"):
        success.add_metric([served.name, "trtllm", reason], stats.finished.get(reason, 0), created)
    yield success
    yield _histogram(
        "trtllm_time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        labels,
        obs.ttft,
    )
    yield _histogram(
        "trtllm_e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
        labels,
        obs.e2e,
    )
    yield _histogram(
        "trtllm_request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        labels,
        obs.queue,
    )


FAMILIES: dict[str, Callable[[ServedModel], Iterator[Metric]]] = {
    "vllm": vllm_metrics,
    "sglang": sglang_metrics,
    "trtllm": trtllm_metrics,
}


class EngineCollector:
    """prometheus_client collector reading the engine models of one replica."""

    def __init__(self, engine_kind: str, served: Iterable[ServedModel]) -> None:
        if engine_kind not in FAMILIES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}")
        self._families = FAMILIES[engine_kind]
        self._served = list(served)

    def collect(self) -> Iterator[Metric]:
        # One family per name, even with several models, or the exposition repeats HELP;
        # a series without a model label (vllm:cache_config_info) is served once.
        merged: dict[str, Metric] = {}
        for served in self._served:
            for family in self._families(served):
                into = merged.get(family.name)
                if into is None:
                    merged[family.name] = family
                    continue
                seen = {(s.name, tuple(sorted(s.labels.items()))) for s in into.samples}
                into.samples.extend(
                    s
                    for s in family.samples
                    if (s.name, tuple(sorted(s.labels.items()))) not in seen
                )
        yield from merged.values()


def make_registry(engine_kind: str, served: Iterable[ServedModel]) -> CollectorRegistry:
    """One registry per replica, so replicas in one process never share a metric."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine_kind, served))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
