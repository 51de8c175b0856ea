"""Workloads for the cross-check (`bench/crosscheck.py`), generated apart from
`bench/workloads/grid.py`: their own text, lengths, think times and rates.

Lengths are in the cross-check engine's tokens (`bench.xsim.engine.tokenize`, ~3
characters a token). Every conversation draws its own words, so only what the workload
means to share (a system prompt, a user's context, earlier turns) is a common prefix.

- `chat-moderate`: multi-turn chat, `x-session-id` per conversation, 4-8 turns, one shared
  ~300-token system prompt, user turns 50-300 tokens, scripted replies 100-400, lognormal
  think time with mean ~1 s, Poisson conversation starts; replicas about half busy.
- `chat-busy`: the same shape at ~1.8x the rate.
- `hot-sessions`: 30 users with Zipf(1.2) popularity, each with a 2-6k-token personal
  context; 2-5 turn conversations keyed by the user id.
- `shared-system`: no session header; single requests opening with one of 8 system
  prompts of 1-3k tokens, then a unique 30-150-token question; Poisson arrivals; on the
  small-cache fleet, where a replica holds about half of the prompts.
- `pressure-chat`: `chat-moderate`'s traffic on a fleet whose KV cache holds about half
  of the histories that are live at once (run on the small-cache fleet).
- `chat-anonymous`: `chat-moderate` without the session header (clients that send none):
  only the growing prompt says which replica holds a conversation.
- `chat-unstreamed`: `chat-moderate`'s traffic where 40 % of the conversations ask for
  `"stream": false` and long answers (`max_tokens` 150-400: batch jobs, agents): their
  first response byte is their last token, so a router that takes it for the first token
  counts their prefill as queued until the answer ends. TTFT is the streamed ones'.
- `chat-bursty` / `shared-bursty`: `chat-moderate` / `shared-system` at the same mean
  rate, but starts come in bursts (Poisson bursts of a geometric number of arrivals, mean
  6, within 250 ms), as in production traces: several new sessions land between two
  metric scrapes, so a router must count what it just sent.
- `agent-loop` / `agent-anonymous`: tool-calling agents (session 29). One of 3 agent
  prompts (1-2k tokens of instructions and tool specs), a 100-300-token task, then 6-16
  steps, each a short tool call (`max_tokens` 20-80) answered by a 200-1,500-token tool
  result after 0.05-0.4 s of tool time: contexts grow to 5-20k tokens within seconds, so a
  step that leaves its replica re-prefills thousands of tokens. `agent-anonymous` sends
  no session header (most agent frameworks send none).
- `chat-docs` (session 30): `chat-moderate`'s shape at 1.4 conversations a second, and
  beside it 0.35 a second of single unstreamed requests over a 3-6k-token document of
  their own (`max_tokens` 100-250, no session header): batch jobs whose prefill holds a
  replica's step budget for ~5 steps and whose decode holds a batch slot for seconds.
  TTFT is the chat's.
- `rag-shared` (session 30): no session header; each request is one of 4 app prompts
  (500-1,000 tokens), then one of 40 documents of 1,000-2,500 tokens (Zipf(1.1)
  popularity, each document belongs to one app), then a question of its own; 10 a second
  on the small-cache fleet, where the documents do not all fit: prefixes shared at two
  depths.
- `chat-degraded` (session 30): `chat-moderate`'s traffic while replica 1 runs every
  step 3x slower from 10 s to 30 s (the engine's `--degrade`: a throttled GPU, a noisy
  neighbour); its gauges and histograms show it, nothing else does.
- `chat-long-answers` (session 31): `chat-moderate`'s conversations with the answers
  real chat gets (150-450 tokens streamed, not 16-48) at 0.7 conversations a second: each
  turn holds a batch slot for seconds of decode, so batch slots, not prefill, decide
  where a turn waits; a session that stays put may find its replica's slots full.
- `chat-mixed-gpu`, `shared-mixed-gpu` (session 31): a fleet of two hardware generations:
  replicas 2 and 3 run every step 2x slower for the whole run (`--degrade` with no end),
  so the fleet has 3/4 of the capacity of four fast ones; `chat-moderate`'s and
  `shared-system`'s shapes at 3/4 of their rates. Nothing says which replicas are slow
  but their gauges and histograms.
- `chat-stop` (session 32): `chat-long-answers`' conversations at 1.2 a second, where
  users press stop: 40 % of turns are read for 3-40 tokens, then the client closes the
  connection (aiperf's request cancellation does the same). The engine aborts a request
  whose client has gone, as vLLM does; a router or proxy that keeps reading a cancelled
  answer, or keeps counting it, leaves its batch slot or its load with a replica that is
  free (if nothing aborted, the slots would fill as in `chat-long-answers` at 1.7x).
- `chat-crash` (session 32): `chat-moderate`'s traffic while replica 1 dies 10 s into the
  run (its port refuses connections, open streams are cut, its /metrics is gone) and
  restarts 15 s later with an empty cache and every counter back at zero, as a restarted
  vLLM does. A router must stop sending there without losing requests that have not
  started, and use the replica again once it is back.
- `decode-long`: no session, no shared text, short prompts (100-400 tokens) and long
  answers (`max_tokens` 150-400) at about half the fleet's decode capacity: batch slots and
  decode load decide, not caching.
- `mixed-tenants` (session 34): three applications on one fleet at once, as a shared
  gateway sees them: `chat-moderate`'s conversations at half its rate, `rag-shared`'s
  sessionless retrieval at 4 a second over 24 documents of its own, and tool-calling agents
  with a session header at 0.3 a second. No single regime decides: a router has to keep
  sessions home, keep documents where they are cached, and place the growing agent
  contexts, all against the same queues.
- `chat-surge` (session 34): `chat-moderate`'s conversations, but the rate of new ones
  climbs linearly from 0.5x to 2.5x `chat-moderate`'s over the window (a traffic surge, a
  launch): load the router was calibrated at early on is not the load at the end, and the
  last third runs busier than `chat-busy`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from bench.workloads import Conversation, Turn, Workload
from bench.xsim.engine import tokenize

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


class Words:
    """Seeded pseudo-words of 2-11 letters (word pieces split them unevenly)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def word(self) -> str:
        n = self.rng.choice((1, 1, 2, 2, 2, 3, 3, 4, 5))
        return "".join(self.rng.choice(_CONSONANTS) + self.rng.choice(_VOWELS) for _ in range(n))

    def text(self, tokens: int) -> str:
        out: list[str] = []
        count = 0
        while count < tokens:
            w = self.word()
            if self.rng.random() < 0.08:
                w += self.rng.choice(".,;?")
            out.append(w)
            count += len(tokenize(w))
        return " ".join(out)


@dataclass(frozen=True)
class Spec:
    name: str
    fleet: str  # "roomy" | "small": which KV size the driver runs it on
    window_s: float
    note: str
    # The engine's `--degrade REPLICA:FROM:UNTIL:FACTOR` (run on a fleet of its own), if any.
    degrade: str | None = None
    # The engine's `--outage REPLICA:FROM:UNTIL` (a replica dies, then restarts empty), if any.
    outage: str | None = None

    def engine_args(self) -> tuple[str, ...]:
        """The engine's fault flags: workloads with the same flags (and fleet) share one."""
        return (("--degrade", self.degrade) if self.degrade else ()) + (
            ("--outage", self.outage) if self.outage else ()
        )


# Two of the replicas are an older generation: every step 2x as long, for good.
_OLD_GPUS = "2:0:inf:2,3:0:inf:2"

SPECS = {
    "chat-moderate": Spec("chat-moderate", "roomy", 45, "multi-turn chat, moderate load"),
    "chat-busy": Spec("chat-busy", "roomy", 40, "multi-turn chat, busy"),
    "hot-sessions": Spec("hot-sessions", "roomy", 45, "few hot users, long contexts"),
    "shared-system": Spec("shared-system", "small", 35, "8 long system prompts, no session"),
    "pressure-chat": Spec("pressure-chat", "small", 45, "chat, KV cache < live histories"),
    "chat-anonymous": Spec("chat-anonymous", "roomy", 45, "multi-turn chat, no session header"),
    "decode-long": Spec("decode-long", "roomy", 36, "short prompts, long answers"),
    "chat-unstreamed": Spec("chat-unstreamed", "roomy", 45, "chat, 40 % not streamed"),
    "chat-bursty": Spec("chat-bursty", "roomy", 45, "multi-turn chat, starts in bursts"),
    "shared-bursty": Spec("shared-bursty", "small", 35, "shared system prompts in bursts"),
    "agent-loop": Spec("agent-loop", "roomy", 40, "tool-calling agents, fast-growing contexts"),
    "agent-anonymous": Spec("agent-anonymous", "roomy", 40, "agents without a session header"),
    "chat-docs": Spec("chat-docs", "roomy", 45, "chat beside unstreamed long-document jobs"),
    "rag-shared": Spec("rag-shared", "small", 35, "4 app prompts x 40 Zipf documents, no session"),
    "chat-degraded": Spec(
        "chat-degraded", "roomy", 45, "chat; one replica 3x slower for 20 s", degrade="1:10:30:3"
    ),
    "chat-long-answers": Spec(
        "chat-long-answers", "roomy", 45, "multi-turn chat, answers of 150-450 tokens"
    ),
    "chat-crash": Spec(
        "chat-crash",
        "roomy",
        45,
        "chat; replica 1 dies 10-25 s, restarts empty",
        outage="1:10:25",
    ),
    "chat-stop": Spec("chat-stop", "roomy", 45, "long chat answers, 40 % stopped early"),
    "chat-mixed-gpu": Spec(
        "chat-mixed-gpu", "roomy", 45, "chat; replicas 2, 3 always 2x slower", degrade=_OLD_GPUS
    ),
    "shared-mixed-gpu": Spec(
        "shared-mixed-gpu", "small", 35, "shared prompts; replicas 2, 3 2x slower", _OLD_GPUS
    ),
    "mixed-tenants": Spec("mixed-tenants", "roomy", 45, "chat + retrieval + agents at once"),
    "chat-surge": Spec("chat-surge", "roomy", 45, "chat; new conversations 0.5x -> 2.5x"),
}

# KV blocks (16 tokens) a replica on each fleet.
FLEET_KV_BLOCKS = {"roomy": 6000, "small": 700}


def _poisson_starts(rng: random.Random, rate: float, window: float) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < window:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _bursty_starts(
    rng: random.Random, rate: float, window: float, mean_burst: float = 6.0, spread: float = 0.25
) -> list[float]:
    """`rate` on average, in bursts: Poisson burst times at rate / mean_burst, each bringing
    a geometric number of arrivals (mean `mean_burst`) spread uniformly over `spread` s."""
    out: list[float] = []
    for t in _poisson_starts(rng, rate / mean_burst, window):
        n = 1
        while rng.random() > 1 / mean_burst:
            n += 1
        out += (min(window, t + rng.uniform(0, spread)) for _ in range(n))
    return sorted(out)


def _ramp_starts(
    rng: random.Random, rate_from: float, rate_to: float, window: float
) -> list[float]:
    """Poisson arrivals whose rate moves linearly from `rate_from` to `rate_to` over the
    window (thinning: candidates at the higher rate, each kept with the ratio then)."""
    top = max(rate_from, rate_to)
    return [
        t
        for t in _poisson_starts(rng, top, window)
        if rng.random() * top < rate_from + (rate_to - rate_from) * t / window
    ]


def _think(rng: random.Random) -> float:
    # Lognormal, median 0.8 s, mean ~1.0 s.
    return rng.lognormvariate(math.log(0.8), 0.65)


def _chat(
    name: str,
    seed: int,
    rate: float,
    window: float,
    sessions: bool = True,
    unstreamed: float = 0.0,
    bursty: bool = False,
    answers: tuple[int, int] = (16, 48),
    stops: float = 0.0,
    surge_to: float | None = None,
) -> Workload:
    rng = random.Random(f"xsim-{name}-{seed}")
    streams = random.Random(f"xsim-{name}-{seed}-stream")
    stopper = random.Random(f"xsim-{name}-{seed}-stop")  # drawn from only when stops > 0
    system = Words(random.Random(f"xsim-system-{seed}")).text(300)
    convs = []
    if surge_to is not None:  # `rate` at the start, `surge_to` at the end
        starts = _ramp_starts(rng, rate, surge_to, window)
    else:
        starts = (_bursty_starts if bursty else _poisson_starts)(rng, rate, window)
    for i, start in enumerate(starts):
        words = Words(random.Random(f"xsim-{name}-{seed}-{i}"))
        stream = streams.random() >= unstreamed
        turns = tuple(
            Turn(
                user=words.text(rng.randint(50, 300)),
                reply=words.text(rng.randint(100, 400)),
                max_tokens=rng.randint(*answers) if stream else streams.randint(150, 400),
                think_s=_think(rng),
                stream=stream,
                stop_after=(
                    stopper.randint(3, 40) if stream and stopper.random() < stops else None
                ),
            )
            for _ in range(rng.randint(4, 8))
        )
        session = f"chat-{seed}-{i}" if sessions else None
        convs.append(Conversation(i, session, start, system, turns))
    return _workload(name, seed, convs, rate if surge_to is None else (rate + surge_to) / 2)


def _hot(seed: int, rate: float, window: float) -> Workload:
    rng = random.Random(f"xsim-hot-{seed}")
    users = 30
    contexts = [
        Words(random.Random(f"xsim-user-{seed}-{u}")).text(rng.randint(2000, 6000))
        for u in range(users)
    ]
    weights = [1 / (k + 1) ** 1.2 for k in range(users)]
    convs = []
    for i, start in enumerate(_poisson_starts(rng, rate, window)):
        user = rng.choices(range(users), weights)[0]
        words = Words(random.Random(f"xsim-hot-{seed}-{i}"))
        turns = tuple(
            Turn(words.text(rng.randint(30, 150)), words.text(rng.randint(80, 250)),
                 rng.randint(16, 40), _think(rng))
            for _ in range(rng.randint(2, 5))
        )  # fmt: skip
        # The seed in the id, as every other workload's: with `user-{n}` alone, consistent
        # hashing put the same hot users on the same replicas in every seed.
        convs.append(Conversation(i, f"user-{seed}-{user}", start, contexts[user], turns))
    return _workload("hot-sessions", seed, convs, rate)


def _shared(
    seed: int, rate: float, window: float, bursty: bool = False, name: str | None = None
) -> Workload:
    name = name or ("shared-bursty" if bursty else "shared-system")
    rng = random.Random(f"xsim-shared-{seed}")
    systems = [
        Words(random.Random(f"xsim-sys-{seed}-{k}")).text(rng.randint(1000, 3000)) for k in range(8)
    ]
    convs = []
    starts = (_bursty_starts if bursty else _poisson_starts)(rng, rate, window)
    for i, start in enumerate(starts):
        words = Words(random.Random(f"xsim-q-{seed}-{i}"))
        turn = Turn(words.text(rng.randint(30, 150)), "", rng.randint(16, 32), 0.0)
        convs.append(Conversation(i, None, start, rng.choice(systems), (turn,)))
    return _workload(name, seed, convs, rate)


def _decode(seed: int, rate: float, window: float) -> Workload:
    rng = random.Random(f"xsim-decode-{seed}")
    convs = []
    for i, start in enumerate(_poisson_starts(rng, rate, window)):
        words = Words(random.Random(f"xsim-decode-{seed}-{i}"))
        turn = Turn(words.text(rng.randint(100, 400)), "", rng.randint(150, 400), 0.0)
        convs.append(Conversation(i, None, start, "", (turn,)))
    return _workload("decode-long", seed, convs, rate)


def _agents(name: str, seed: int, rate: float, window: float, sessions: bool) -> Workload:
    rng = random.Random(f"xsim-agent-{seed}")
    prompts = [
        Words(random.Random(f"xsim-agent-sys-{seed}-{k}")).text(rng.randint(1000, 2000))
        for k in range(3)
    ]
    convs = []
    for i, start in enumerate(_poisson_starts(rng, rate, window)):
        words = Words(random.Random(f"xsim-agent-{seed}-{i}"))
        steps = rng.randint(6, 16)
        # Turn k's user text is the task (k = 0) or the result of tool call k - 1; its reply
        # is the tool call the agent made.
        users = [words.text(rng.randint(100, 300))]
        users += [words.text(rng.randint(200, 1500)) for _ in range(steps - 1)]
        turns = tuple(
            Turn(u, words.text(rng.randint(20, 80)), rng.randint(20, 80), rng.uniform(0.05, 0.4))
            for u in users
        )
        session = f"agent-{seed}-{i}" if sessions else None
        convs.append(Conversation(i, session, start, rng.choice(prompts), turns))
    return _workload(name, seed, convs, rate)


def _chat_docs(seed: int, rate: float, doc_rate: float, window: float) -> Workload:
    """Chat sessions, and beside them single unstreamed requests over a long document of
    their own (a summary, an extraction: batch jobs on the same fleet)."""
    chat = _chat("chat-docs", seed, rate, window)
    rng = random.Random(f"xsim-docs-{seed}")
    convs = list(chat.conversations)
    for i, start in enumerate(_poisson_starts(rng, doc_rate, window), start=len(convs)):
        words = Words(random.Random(f"xsim-doc-{seed}-{i}"))
        ask = words.text(rng.randint(20, 60))
        turn = Turn(ask, "", rng.randint(100, 250), 0.0, stream=False)
        convs.append(Conversation(i, None, start, words.text(rng.randint(3000, 6000)), (turn,)))
    convs.sort(key=lambda c: c.start_s)
    return _workload("chat-docs", seed, convs, rate + doc_rate)


def _rag(seed: int, rate: float, window: float, documents: int = 40) -> Workload:
    """Retrieval-augmented questions without a session header: an app's prompt, then one
    of 40 documents (Zipf popularity; each belongs to one of 4 apps), then a question of
    its own. Prefixes are shared at two depths: the app's prompt by a quarter of the
    traffic, a document by fewer, and the documents' set is larger than the fleet's cache."""
    rng = random.Random(f"xsim-rag-{seed}")
    apps = [
        Words(random.Random(f"xsim-rag-app-{seed}-{k}")).text(rng.randint(500, 1000))
        for k in range(4)
    ]
    docs = [
        Words(random.Random(f"xsim-rag-doc-{seed}-{d}")).text(rng.randint(1000, 2500))
        for d in range(documents)
    ]
    weights = [1 / (k + 1) ** 1.1 for k in range(len(docs))]
    convs = []
    for i, start in enumerate(_poisson_starts(rng, rate, window)):
        d = rng.choices(range(len(docs)), weights)[0]
        words = Words(random.Random(f"xsim-rag-q-{seed}-{i}"))
        turn = Turn(words.text(rng.randint(30, 100)), "", rng.randint(16, 48), 0.0)
        system = apps[d % len(apps)] + "\n\n" + docs[d]
        convs.append(Conversation(i, None, start, system, (turn,)))
    return _workload("rag-shared", seed, convs, rate)


def _mixed_tenants(seed: int, scale: float, window: float) -> Workload:
    """Chat, retrieval and agents from three applications through one gateway. Each part
    is generated as its own workload would be; conversations keep their session ids (the
    chat's and the agents' differ), retrieval sends none."""
    parts = (
        _chat("mixed-tenants", seed, 0.8 * scale, window),
        _rag(seed, 4.0 * scale, window, documents=24),
        _agents("mixed-tenants", seed, 0.3 * scale, window, sessions=True),
    )
    convs = sorted((c for part in parts for c in part.conversations), key=lambda c: c.start_s)
    convs = [
        Conversation(i, c.session_id, c.start_s, c.system, c.turns) for i, c in enumerate(convs)
    ]
    return _workload("mixed-tenants", seed, convs, sum(p.arrival_rate for p in parts))


def _workload(name: str, seed: int, convs: list[Conversation], rate: float) -> Workload:
    spec = SPECS[name]
    wl = Workload(name, seed, spec.note, tuple(convs), rate)
    wl.params["offered_req_s"] = round(wl.offered_request_rate(), 2)
    return wl


def build(name: str, seed: int = 1, scale: float = 1.0) -> Workload:
    """Workload `name`; `scale` multiplies its arrival rate (2 for a fleet of 8)."""
    spec = SPECS[name]
    if name == "chat-moderate":
        return _chat(name, seed, 1.6 * scale, spec.window_s)
    if name == "chat-surge":
        return _chat(name, seed, 0.8 * scale, spec.window_s, surge_to=4.0 * scale)
    if name == "mixed-tenants":
        return _mixed_tenants(seed, scale, spec.window_s)
    if name == "chat-busy":
        return _chat(name, seed, 2.9 * scale, spec.window_s)
    if name == "chat-unstreamed":
        return _chat(name, seed, 1.6 * scale, spec.window_s, unstreamed=0.4)
    if name == "chat-bursty":
        return _chat(name, seed, 1.6 * scale, spec.window_s, bursty=True)
    if name == "pressure-chat":
        return _chat(name, seed, 1.2 * scale, spec.window_s)
    if name == "chat-degraded":
        return _chat(name, seed, 1.6 * scale, spec.window_s)
    if name == "chat-long-answers":
        # A turn holds a batch slot for ~6 s of decode (~300 tokens at ~19 ms a step of 12):
        # an estimate, not measured, of 20-30 of the fleet's 48 slots busy at 0.7
        # conversations a second; the measured runs are in crosscheck_long_answers.txt.
        return _chat(name, seed, 0.7 * scale, spec.window_s, answers=(150, 450))
    if name == "chat-crash":
        return _chat(name, seed, 1.6 * scale, spec.window_s)
    if name == "chat-stop":
        return _chat(name, seed, 1.2 * scale, spec.window_s, answers=(150, 450), stops=0.4)
    if name == "chat-mixed-gpu":  # 3/4 of chat-moderate's rate: 3/4 of its capacity
        return _chat(name, seed, 1.2 * scale, spec.window_s)
    if name == "shared-mixed-gpu":
        return _shared(seed, 9.0 * scale, spec.window_s, name=name)
    if name == "rag-shared":
        return _rag(seed, 10.0 * scale, spec.window_s)
    if name == "chat-docs":
        return _chat_docs(seed, 1.4 * scale, 0.35 * scale, spec.window_s)
    if name == "chat-anonymous":
        return _chat(name, seed, 1.6 * scale, spec.window_s, sessions=False)
    if name == "decode-long":
        # ~640 decode tokens/s a replica at 12 sequences (8 ms + 0.9 ms x 12 a step):
        # 4 replicas / 275 tokens a request = ~9 req/s; offer about half.
        return _decode(seed, 4.5 * scale, spec.window_s)
    if name == "hot-sessions":
        return _hot(seed, 1.3 * scale, spec.window_s)
    if name == "shared-system":
        return _shared(seed, 12.0 * scale, spec.window_s)
    if name == "shared-bursty":
        return _shared(seed, 12.0 * scale, spec.window_s, bursty=True)
    if name in ("agent-loop", "agent-anonymous"):
        return _agents(name, seed, 0.9 * scale, spec.window_s, sessions=name == "agent-loop")
    raise KeyError(name)
