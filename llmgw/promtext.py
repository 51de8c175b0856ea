"""Prometheus text exposition: a fast scanner, a full parser, and engine metric contracts.

`prometheus_client.parser` needs ~11 ms for a 400-line vLLM page; routing needs three
numbers from it, 10 times a second, from every endpoint. `scan` looks only at the lines
whose metric name is wanted (~0.1 ms for the same page), so it stays off the CPU budget.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

from llmgw.errors import MetricsError
from llmgw.types import Engine, EngineMetrics

Labels = dict[str, str]


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _parse_value(text: str, line_no: int) -> float:
    token = text.split(None, 1)[0] if text.strip() else ""
    if not token:
        raise MetricsError(f"line {line_no}: sample has no value")
    try:
        return float(token)  # float() accepts NaN, +Inf, -Inf as Prometheus writes them
    except ValueError:
        raise MetricsError(f"line {line_no}: value {token[:40]!r} is not a number") from None


def _parse_labels(line: str, start: int, line_no: int) -> tuple[Labels, int]:
    """Parse `{a="x",b="y"}` starting at line[start] == '{'; return labels and the index after '}'."""
    labels: Labels = {}
    i = start + 1
    n = len(line)
    while True:
        while i < n and line[i] in " ,":
            i += 1
        if i >= n:
            raise MetricsError(f"line {line_no}: unterminated label set")
        if line[i] == "}":
            return labels, i + 1
        eq = line.find("=", i)
        if eq < 0:
            raise MetricsError(f"line {line_no}: label without '='")
        key = line[i:eq].strip()
        quote = eq + 1
        while quote < n and line[quote] == " ":  # `a = "x"` is valid exposition text
            quote += 1
        if not key or quote >= n or line[quote] != '"':
            raise MetricsError(f"line {line_no}: label {key!r} value must be quoted")
        j = quote + 1
        chunks: list[str] = []
        while True:
            k = line.find('"', j)
            b = line.find("\\", j)
            if k < 0:
                raise MetricsError(f"line {line_no}: unterminated label value for {key!r}")
            if 0 <= b < k:
                chunks.append(line[j:b])
                if b + 1 >= n:
                    raise MetricsError(f"line {line_no}: dangling escape in label {key!r}")
                chunks.append(_ESCAPES.get(line[b + 1], "\\" + line[b + 1]))
                j = b + 2
                continue
            chunks.append(line[j:k])
            i = k + 1
            break
        labels[key] = "".join(chunks)


def _split_sample(line: str, line_no: int) -> tuple[str, Labels, float]:
    brace = line.find("{")
    space = line.find(" ")
    if brace >= 0 and (space < 0 or brace < space):
        name = line[:brace]
        labels, end = _parse_labels(line, brace, line_no)
        return name, labels, _parse_value(line[end:], line_no)
    if space < 0:
        raise MetricsError(f"line {line_no}: sample {line[:60]!r} has no value")
    return line[:space], {}, _parse_value(line[space + 1 :], line_no)


def iter_samples(text: str, names: Collection[str] | None = None) -> Iterator[Sample]:
    """Samples of the page, only those named in `names` when given (the fast path)."""
    if names is not None:
        yield from _iter_named(text, names)
        return
    for line_no, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        name, labels, value = _split_sample(line, line_no)
        yield Sample(name, labels, value)


# Per set of wanted names: a pattern that finds them where a sample's name can end (at
# `{`, a space, or the line's end), then the rest of that line. Splitting and stripping
# every line in Python first took ~50 ms of the event loop for an 8 MB page (80,000
# series of a metric nobody reads); the regex engine skips to the wanted names' first
# letters in C (~3 ms).
_SELECTORS: dict[frozenset[str], re.Pattern[str]] = {}


def _selector(names: Collection[str]) -> re.Pattern[str]:
    key = names if isinstance(names, frozenset) else frozenset(names)
    pattern = _SELECTORS.get(key)
    if pattern is None:
        if len(_SELECTORS) >= 64:  # contracts are few; config reloads may make more
            _SELECTORS.clear()
        # Longest first: a name that is another's prefix (`x` and `x_sum`) is tried last.
        alternatives = "|".join(re.escape(n) for n in sorted(key, key=lambda n: (-len(n), n)))
        pattern = re.compile(rf"(?:{alternatives})(?=[{{ ]|[^\S\n]*$).*", re.MULTILINE)
        _SELECTORS[key] = pattern
    return pattern


def _iter_named(text: str, names: Collection[str]) -> Iterator[Sample]:
    """The samples named in `names`, as a line-by-line reading finds them: a line is one
    of theirs when, stripped, its name (up to `{` or a space) is one of `names`."""
    if not names:
        return
    line_no, counted = 1, 0
    for match in _selector(names).finditer(text):
        start = match.start()
        line_start = text.rfind("\n", 0, start) + 1
        # The name must begin the line (after blanks): not a label value, a comment's text
        # (`# TYPE name gauge`) or the tail of a longer name.
        if line_start < start and not text[line_start:start].isspace():
            continue
        line_no += text.count("\n", counted, start)
        counted = start
        name, labels, value = _split_sample(match.group().rstrip(), line_no)
        yield Sample(name, labels, value)


def parse(text: str) -> list[Sample]:
    """Every sample of a page (counters, gauges, histogram buckets...)."""
    return list(iter_samples(text))


# Optional roles: counters and histogram bases (`_sum`/`_count` are read) the latency model
# calibrates from. A page without them still routes, on configured defaults.
OPTIONAL_ROLES = (
    "prefill_time",
    "computed_tokens",
    "prompt_tokens",
    "cached_tokens",
    "step_time",
    "service_time",
    "ttft_time",
    "queue_time",
    "cache_info",
)
_HISTOGRAM_ROLES = (
    "prefill_time",
    "computed_tokens",
    "step_time",
    "service_time",
    "ttft_time",
    "queue_time",
)


@dataclass(frozen=True, slots=True)
class MetricContract:
    """Which metric names carry queue, running and KV usage for one engine.

    Each field is a tuple of names tried in order (the first present wins), so a renamed
    metric can keep its deprecated name as a fallback. The optional roles name histograms
    (by base name) and counters for the latency model's calibration.
    """

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]
    finished: tuple[str, ...] = ()
    model_label: str = "model_name"
    prefill_time: tuple[str, ...] = ()
    computed_tokens: tuple[str, ...] = ()
    prompt_tokens: tuple[str, ...] = ()
    cached_tokens: tuple[str, ...] = ()
    step_time: tuple[str, ...] = ()
    service_time: tuple[str, ...] = ()  # a request's time in the batch (scheduled to done)
    # Time to first token and time queued: their difference is the prefill's time where an
    # engine publishes no prefill histogram (vLLM look-alikes, SGLang).
    ttft_time: tuple[str, ...] = ()
    queue_time: tuple[str, ...] = ()
    # An info metric whose labels give the KV cache size: num_gpu_blocks x block_size.
    cache_info: tuple[str, ...] = ()
    # Where the engine serves the Prometheus text (trtllm-serve's /metrics is JSON).
    path: str = "/metrics"

    def names(self) -> frozenset[str]:
        hist = [
            f"{n}{suffix}"
            for role in _HISTOGRAM_ROLES
            for n in getattr(self, role)
            for suffix in ("_sum", "_count")
        ]
        plain = (
            *self.waiting,
            *self.running,
            *self.kv_usage,
            *self.finished,
            *self.prompt_tokens,
            *self.cached_tokens,
            *self.cache_info,
        )
        return frozenset((*plain, *hist))

    def with_overrides(self, overrides: Mapping[str, str]) -> MetricContract:
        """A copy with some names replaced by config (`waiting`, `running`, `kv_usage`...)."""
        fields: dict[str, tuple[str, ...] | str] = {
            "waiting": self.waiting,
            "running": self.running,
            "kv_usage": self.kv_usage,
            "finished": self.finished,
            "model_label": self.model_label,
            "path": self.path,
            **{role: getattr(self, role) for role in OPTIONAL_ROLES},
        }
        for key, value in overrides.items():
            if key not in fields:
                raise ValueError(f"unknown metric role {key!r} (allowed: {', '.join(fields)})")
            fields[key] = value if key in ("model_label", "path") else (value,)
        return MetricContract(**fields)  # type: ignore[arg-type]


CONTRACTS: dict[Engine, MetricContract] = {
    Engine.VLLM: MetricContract(
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        finished=("vllm:request_success_total",),
        prefill_time=("vllm:request_prefill_time_seconds",),
        computed_tokens=("vllm:request_prefill_kv_computed_tokens",),
        prompt_tokens=("vllm:prompt_tokens_total",),
        cached_tokens=("vllm:prefix_cache_hits_total",),
        step_time=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        service_time=("vllm:request_inference_time_seconds",),
        ttft_time=("vllm:time_to_first_token_seconds",),
        queue_time=("vllm:request_queue_time_seconds",),
        cache_info=("vllm:cache_config_info",),
    ),
    Engine.SGLANG: MetricContract(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_usage=("sglang:token_usage",),
        finished=("sglang:num_requests_total",),
        prompt_tokens=("sglang:prompt_tokens_total",),
        cached_tokens=("sglang:cached_tokens_total",),
        step_time=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        ttft_time=("sglang:time_to_first_token_seconds",),
        queue_time=("sglang:queue_time_seconds",),
    ),
    Engine.TRTLLM: MetricContract(
        waiting=("trtllm_num_requests_waiting",),
        running=("trtllm_num_requests_running",),
        kv_usage=("trtllm_kv_cache_utilization",),
        finished=("trtllm_request_success_total",),
        path="/prometheus/metrics",
    ),
}


# Model label values that name no model: trtllm-serve labels every series
# `model_name="undefined"`, whatever it serves.
_NO_MODEL = frozenset({"", "undefined"})


def select(text: str, contract: MetricContract) -> list[Sample]:
    """The page's samples the contract reads, every model's (for `extract_samples`)."""
    return list(iter_samples(text, contract.names()))


def extract(text: str, contract: MetricContract, model: str | None = None) -> EngineMetrics:
    """Read the contract's numbers from a /metrics page (`extract_samples` of `select`)."""
    return extract_samples(select(text, contract), contract, model)


def extract_samples(
    samples: Iterable[Sample], contract: MetricContract, model: str | None = None
) -> EngineMetrics:
    """Read the contract's numbers from a /metrics page's samples.

    With `model`, only samples whose model label equals it (or names no model: `_NO_MODEL`)
    count (a server may serve several models). Queue and running are summed over the remaining series (several
    engines behind one server); KV usage is their mean. A page missing any of the
    three required metrics raises MetricsError naming it.
    """
    found: dict[str, list[float]] = {}
    kv_tokens: float | None = None
    prefix_caching: bool | None = None
    for sample in samples:
        if model is not None:
            label = sample.labels.get(contract.model_label)
            if label is not None and label != model and label not in _NO_MODEL:
                continue
        if not math.isfinite(sample.value):  # NaN or ±Inf: no usable reading
            continue
        if sample.name in contract.cache_info:
            kv_tokens = _kv_tokens(sample.labels, kv_tokens)
            said = _PREFIX_CACHING.get(sample.labels.get("enable_prefix_caching", ""))
            if said is not None:  # on if any engine of the page caches
                prefix_caching = said or bool(prefix_caching)
            continue
        found.setdefault(sample.name, []).append(sample.value)

    def first(names: tuple[str, ...]) -> list[float] | None:
        for name in names:
            if name in found:
                return found[name]
        return None

    waiting, running, kv = (
        first(contract.waiting),
        first(contract.running),
        first(contract.kv_usage),
    )
    missing = [
        names[0]
        for names, values in (
            (contract.waiting, waiting),
            (contract.running, running),
            (contract.kv_usage, kv),
        )
        if values is None
    ]
    if missing or waiting is None or running is None or kv is None:
        scope = f" for model {model!r}" if model is not None else ""
        raise MetricsError(f"metrics page lacks {', '.join(missing)}{scope}")

    def total(names: tuple[str, ...], suffix: str = "") -> float | None:
        values = first(tuple(n + suffix for n in names)) if names else None
        if values is None:
            return None
        summed = sum(values)
        # Finite series whose sum overflows, or a negative count or sum (counters and
        # histograms only grow from 0): read as absent.
        if not math.isfinite(summed) or summed < 0:
            return None
        return summed

    waiting_total, running_total = sum(waiting), sum(running)
    if not (math.isfinite(waiting_total) and math.isfinite(running_total)):
        raise MetricsError("metrics page's waiting or running requests sum past a float")
    if not (0 <= waiting_total <= _MAX_REQUESTS and 0 <= running_total <= _MAX_REQUESTS):
        # A negative or absurd gauge (an unsigned underflow in a look-alike): one such read
        # set the endpoint's peak batch to 1.8e19, and its full-batch wait was gone for good.
        raise MetricsError(
            f"metrics page's requests waiting ({waiting_total:g}) or running "
            f"({running_total:g}) is not a count of requests"
        )
    return EngineMetrics(
        waiting=waiting_total,
        running=running_total,
        # The mean over ranks: their cache sizes are summed (`kv_tokens`), so usage x size
        # reads the tokens in use (the fullest rank's 0.95 over two of 16k read 31k of
        # 32k in use where 16k were free; vLLM's front end sends work to the emptier rank).
        kv_usage=min(1.0, max(0.0, math.fsum(kv) / len(kv))),
        finished_total=total(contract.finished),
        prefill_seconds_sum=total(contract.prefill_time, "_sum"),
        prefill_count=total(contract.prefill_time, "_count"),
        computed_tokens_sum=total(contract.computed_tokens, "_sum"),
        prompt_tokens_total=total(contract.prompt_tokens),
        cached_tokens_total=total(contract.cached_tokens),
        step_seconds_sum=total(contract.step_time, "_sum"),
        step_count=total(contract.step_time, "_count"),
        service_seconds_sum=total(contract.service_time, "_sum"),
        service_count=total(contract.service_time, "_count"),
        kv_tokens=kv_tokens,
        prefix_caching=prefix_caching,
        ttft_seconds_sum=total(contract.ttft_time, "_sum"),
        ttft_count=total(contract.ttft_time, "_count"),
        queue_seconds_sum=total(contract.queue_time, "_sum"),
    )


_MAX_REQUESTS = 1e7  # requests one engine has waiting or running, at most
# vLLM's cache_config_info writes the flag as Python prints a bool.
_PREFIX_CACHING = {"True": True, "true": True, "False": False, "false": False}


def _kv_tokens(labels: Mapping[str, str], before: float | None) -> float | None:
    """KV cache size in tokens from an info metric's labels (summed over engines)."""
    try:
        tokens = float(labels["num_gpu_blocks"]) * float(labels["block_size"])
    except (KeyError, ValueError):  # "None" before the engine sized its cache
        return before
    if not math.isfinite(tokens) or tokens <= 0:
        return before
    summed = tokens + (before or 0.0)
    return summed if math.isfinite(summed) else before
