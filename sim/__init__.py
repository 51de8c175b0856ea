"""Engine simulator: a vLLM-faithful fake model server for tests, the demo and benchmarks.

It imports nothing from the router core (`llmgw.*` outside `llmgw.sim`): it stands for
engines nobody here wrote, so metric names are spelled out here independently.

What a replica serves: `POST /v1/chat/completions`, `POST /v1/completions` (streaming
SSE shaped like vLLM 0.32, `stream_options.include_usage`), `GET /v1/models`,
`GET /health`, `GET /metrics` (vLLM, SGLang or TensorRT-LLM names and labels, chosen by
`engine`), `GET|POST /admin/faults`, `POST /admin/reset`. Every response carries
`x-sim-replica: <index>`; non-streamed answers also carry `x-sim-cached-tokens`.
One choice per request (`n` must be 1). Without `max_tokens` a completion gets vLLM's 16
(finish_reason "length"); a chat request a length drawn from `default_output_tokens`
(finish_reason "stop").
Errors are `{"error": {"message", "type", "param", "code"}}`: 400 bad JSON, missing
`model`, wrong types or too long; 404 unknown model; 429 waiting queue full.

Behaviour (`model.py`, pure, tested with an injected clock): continuous batching of at
most `max_num_seqs`, a FIFO queue of at most `max_queue`, `kv_blocks` blocks of
`block_size` tokens (4 characters a token) reserved for prompt + output, a chained-hash
prefix cache with LRU eviction (a hit is whole blocks and stops before the prompt's last
token, as vLLM's: a prompt of exactly n cached blocks hits n - 1). TTFT = queue wait + prefill of the *uncached* prompt
tokens (`prefill_us_per_token`); then one token per `decode_ms`, growing by
`decode_batch_factor` per extra running sequence. All latencies are multiplied by
`time_scale` (0 = no latency at all) and by the `slowdown` fault. Deterministic given
`seed` and the order of requests.

In-process (async tests), ephemeral ports::

    from llmgw.sim import SimFleet

    async with SimFleet(replicas=4, model="m1", decode_ms=1, time_scale=1) as fleet:
        fleet.urls            # ["http://127.0.0.1:41231", ...]
        fleet.ports
        fleet.replicas[2].set_faults(status=503)     # same fields as POST /admin/faults
        fleet.replicas[2].reset()
        fleet.replicas[0].engine().kv.usage()        # white-box view of the engine model

Keyword options are `build_options()`'s: `model` / `models`, `engine`
("vllm" | "sglang" | "trtllm"), `seed`, `faults` (a `Faults` or a dict),
`default_output_tokens`, plus any `EngineConfig` field (`max_num_seqs`, `max_queue`,
`kv_blocks`, `block_size`, `prefill_us_per_token`, `decode_ms`, `decode_batch_factor`,
`time_scale`, `enable_prefix_caching`, `max_model_len`).

In a background thread (sync tests)::

    with SimFleet.start_in_thread(replicas=2, model="m1", time_scale=0) as fleet:
        httpx.get(fleet.urls[0] + "/health")
        fleet.set_faults(1, error_rate=0.5)          # runs on the fleet's own loop
        fleet.reset(1)

In a child process (what `llmgw sim` runs; a crash fault really exits it)::

    from llmgw.sim.fleet import spawn

    with spawn(["--replicas", "3", "--base-port", "0", "--time-scale", "0"]) as sim:
        sim.urls                                     # read from the --ready-file

Faults (`faults.py`): `error_rate` (share answered 500), `status` (every inference
request answers e.g. 503 or 429), `hang` (accepted, never answered until reset),
`slowdown` (latency multiplier), `metrics` ("error" = 500, "garbage" = unparsable),
`health_status`, `crash` and `crash_after_chunks` (a stream is cut after k chunks).
A crash exits the process in the CLI (exit code 70); in an in-process fleet the replica
closes its listening socket and aborts every connection instead (connections are then
refused), since exiting would kill the test runner. `reset()` / `POST /admin/reset`
clears faults, answers hung requests with 503 and drops the free prefix cache; it does
not re-open a crashed replica's socket.
"""

from llmgw.sim.faults import Faults
from llmgw.sim.fleet import SimFleet, SimProcess, ThreadedFleet, build_options, spawn
from llmgw.sim.model import EngineConfig
from llmgw.sim.replica import Replica, ReplicaOptions

__all__ = [
    "EngineConfig",
    "Faults",
    "Replica",
    "ReplicaOptions",
    "SimFleet",
    "SimProcess",
    "ThreadedFleet",
    "build_options",
    "spawn",
]
