"""The latency scorer on exact cache contents: per endpoint, events when live, else the
approximate index; the Decision says which; no tokenizing when nothing is live."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from llmgw.config import load_dict
from llmgw.kvevents import BlockStored, EventBatch
from llmgw.kvindex import ExactPrefixIndex
from llmgw.registry import Registry
from llmgw.request import build_request
from llmgw.scheduling.plugins import PluginError, make_scorer
from llmgw.scheduling.scheduler import Scheduler
from llmgw.scheduling.scorers import LatencyScorer
from llmgw.tokenize import PromptTokenizer, make_tokenizer, sim_chat_prompt, sim_token_ids
from llmgw.types import RequestInfo

from .helpers import bytes_kept, context, long_session_key, state

CHAT = "/v1/chat/completions"

MESSAGES = [{"role": "system", "content": "s" * 3000}, {"role": "user", "content": "q" * 200}]
TOKENS = sim_token_ids(sim_chat_prompt(MESSAGES))
BS = 16


def request(rid: str = "r") -> RequestInfo:
    return RequestInfo(
        "m", rid, prompt="<|system|>" + "s" * 3000, prompt_tokens=len(TOKENS), raw_prompt=MESSAGES
    )


def feed(index: ExactPrefixIndex, endpoint: str, tokens: tuple[int, ...], seq: int = 0) -> None:
    blocks = len(tokens) // BS
    event = BlockStored(tuple(range(blocks)), None, tuple(tokens[: blocks * BS]), BS, medium="GPU")
    index.apply_batch(endpoint, EventBatch(seq, 0.0, (event,)), now=0.0)


def test_live_endpoint_scores_on_what_its_engine_holds() -> None:
    kv = ExactPrefixIndex()
    feed(kv, "a:1", TOKENS[:400])  # a holds 400 tokens (25 blocks) of this prompt
    feed(kv, "b:1", ())  # b is live and holds nothing
    scorer = LatencyScorer(tokenizer="sim")
    states = [state("a:1"), state("b:1")]
    # The approximate index believes b has it all: it must not count where events are live.
    scorer.index.insert("b:1", scorer.index.hashes(request().prompt))
    ctx = context(states, request=request())
    ctx.kv = kv
    scores = scorer.score(ctx, states)
    terms = scorer.terms()
    assert terms["cached_tokens"] == (400.0, 0.0)
    assert terms["exact"] == (1.0, 1.0)
    assert scores[0] > scores[1]


def test_a_request_for_an_adapter_scores_on_that_adapters_blocks() -> None:
    kv = ExactPrefixIndex()
    blocks = 400 // BS
    feed(kv, "a:1", TOKENS[:400])  # the base model's blocks
    adapter = BlockStored(
        tuple(range(1000, 1000 + blocks)), None, tuple(TOKENS[:400]), BS, lora_name="m"
    )
    kv.apply_batch("b:1", EventBatch(0, 0.0, (adapter,)), now=0.0)  # the adapter "m"'s
    scorer = LatencyScorer(tokenizer="sim")
    states = [state("a:1"), state("b:1")]
    ctx = context(states, request=request())  # a request for model "m"
    ctx.kv = kv
    scorer.score(ctx, states)
    assert scorer.terms()["cached_tokens"] == (0.0, 400.0)


def test_unknown_endpoint_falls_back_to_the_approximate_index_and_says_so() -> None:
    kv = ExactPrefixIndex()
    feed(kv, "a:1", TOKENS[:400])
    scorer = LatencyScorer(tokenizer="sim")
    states = [state("a:1"), state("b:1")]  # b: no events at all
    scorer.index.insert("b:1", scorer.index.hashes(request().prompt))
    ctx = context(states, request=request())
    ctx.kv = kv
    scorer.score(ctx, states)
    terms = scorer.terms()
    assert terms["exact"] == (1.0, 0.0)
    assert terms["cached_tokens"][1] > 0  # the approximate index's guess


def test_a_shared_prefix_held_to_the_token_somewhere_does_not_herd_new_sessions() -> None:
    kv = ExactPrefixIndex()
    feed(kv, "a:1", TOKENS[:400])  # a holds the shared system prompt, past 6 index blocks
    feed(kv, "b:1", ())  # b does not hold it yet
    scorer = LatencyScorer(tokenizer="sim")
    hashes = scorer.index.hashes(request().prompt)
    for k in range(3):  # three sessions used the first 6 blocks: a shared prefix
        scorer.index.insert("a:1", hashes[:6], key=f"other-{k}")
    states = [state("a:1"), state("b:1")]
    req = RequestInfo(
        "m", "r", "new-session", prompt=request().prompt, prompt_tokens=len(TOKENS),
        raw_prompt=MESSAGES,
    )  # fmt: skip
    ctx = context(states, request=req)
    ctx.kv = kv
    scores = scorer.score(ctx, states)
    assert scorer.terms()["cached_tokens"] == (400.0, 400.0)  # not 400 vs 384
    assert scores[0] == scores[1]


def test_no_live_endpoint_means_no_tokenizing() -> None:
    scorer = LatencyScorer(tokenizer="sim")
    assert scorer.tokenizer is not None
    states = [state("a:1")]
    ctx = context(states, request=request())
    ctx.kv = ExactPrefixIndex()
    scorer.score(ctx, states)
    assert scorer.tokenizer.misses == scorer.tokenizer.hits == 0
    assert scorer.terms()["exact"] == (0.0,)


def test_decision_says_exact_and_cached_tokens() -> None:
    config = load_dict(
        {
            "models": {
                "m": {
                    "endpoints": ["a:1", "b:1"],
                    "strategy": {"scorers": {"latency": {"params": {"tokenizer": "sim"}}}},
                }
            }
        }
    )
    registry = Registry()
    scheduler = Scheduler(config, registry)
    feed(registry.kv_index, "a:1", TOKENS[:400])
    feed(registry.kv_index, "b:1", ())
    decision = scheduler.pick(request())
    assert decision.endpoint.address == "a:1"
    assert "cached_tokens=400" in decision.describe()
    assert "exact=1" in decision.describe()
    assert decision.prefill_tokens == len(TOKENS) - 400


def test_tokenizer_param_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(PluginError, match="cannot load"):
        make_scorer("latency", {"tokenizer": str(tmp_path / "missing.json")})


def test_hf_tokenizer_renders_the_chat_template(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers  # noqa: PLC0415

    vocab = {"[UNK]": 0, "<s>": 1, "<|user|>": 2, "hi": 3, "<|assistant|>": 4}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|user|>", "<|assistant|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    scorer = LatencyScorer(tokenizer=str(tmp_path / "tokenizer.json"))
    assert scorer.tokenizer is not None
    assert scorer.tokenizer.tokens([{"role": "user", "content": "hi"}]) == (1, 2, 3, 4)
    assert scorer.tokenizer.tokens("hi") == (3,)
    assert scorer.tokenizer.tokens(None) is None


def _wordlevel(tmp_path: Path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers  # noqa: PLC0415

    words = ["[UNK]", "<s>", "<|user|>", "<|assistant|>", "hi", "there", "more", "words"]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|user|>", "<|assistant|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    (tmp_path / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return str(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("spec", ["sim", "wordlevel"])
def test_a_sessions_next_prompt_extends_its_last_tokens_equal_to_a_full_encode(
    spec: str, tmp_path: Path
) -> None:
    name = _wordlevel(tmp_path) if spec == "wordlevel" else "sim"
    incremental, fresh = make_tokenizer(name), make_tokenizer(name)
    messages: list[dict[str, str]] = []
    words = ["hi", "there", "more", "words", "unknown"]
    for turn in range(12):
        messages.append({"role": "user", "content": " ".join(words[: 1 + turn % 5] * 3)})
        got = incremental.tokens(list(messages), "session-1")
        fresh._cache.clear()
        assert got == fresh.tokens(list(messages)), f"turn {turn}"
        messages.append({"role": "assistant", "content": " ".join(words[turn % 5 :] * 2)})
    assert incremental.extended >= 10  # most turns tokenized only their new text


def test_token_caches_hold_at_most_max_tokens() -> None:
    from llmgw.tokenize import (  # noqa: PLC0415
        PromptTokenizer,
        _sim_encode,
        sim_chat_prompt,
    )

    tok = PromptTokenizer("sim", lambda c: sim_chat_prompt(c.messages), _sim_encode, max_tokens=100)
    for i in range(50):
        assert tok.tokens(f"{i:04d}" * 10, session=f"s{i}") is not None  # 10 tokens each
    assert tok._cache_tokens <= 100 and len(tok._cache) == 10
    assert tok._session_tokens <= 100 and len(tok._sessions) == 10
    assert tok.tokens("0049" * 10) is not None and tok.hits == 1  # the newest stayed


def test_the_session_cache_does_not_keep_long_session_keys() -> None:
    """The session cache is bounded by the tokens it holds, and held each key whole: short
    prompts under 60 KB session ids kept up to ~500,000 of them (found by a review
    helper)."""
    tok = make_tokenizer("sim")
    kept = bytes_kept(lambda i: tok.tokens(f"p{i:07d}", long_session_key(i)))  # 2 tokens each
    assert kept < 4_000, f"{kept:.0f} bytes kept per session"
    first = "x" * 64  # 16 tokens: past the margin kept when extending
    assert tok.tokens(first, long_session_key(1)) is not None
    assert tok.tokens(first + " and more", long_session_key(1)) is not None
    assert tok.extended == 1  # the session's next prompt still extends its last one


def test_chat_templates_render_in_transformers_environment() -> None:
    """What vLLM's templates use: loop controls, strftime_now (today, not a default date),
    a tojson that keeps key order and does not escape HTML, the generation tag."""
    pytest.importorskip("jinja2")
    from datetime import datetime  # noqa: PLC0415

    from llmgw.chat_template import template_environment  # noqa: PLC0415

    source = (
        "{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}|{% endfor %}"
        "{{ tools | tojson }}|{{ strftime_now('%Y') }}"
    )
    text = (
        template_environment()
        .from_string(source)
        .render(
            messages=[
                {"role": "user", "content": "a"},
                {"role": "stop"},
                {"role": "user", "content": "b"},
            ],
            tools=[{"z": "a<b & c's", "a": 1}],
        )
    )
    assert text == f'a|[{{"z": "a<b & c\'s", "a": 1}}]|{datetime.now().year}'


def test_a_chat_request_with_tools_renders_them_into_its_tokens(tmp_path: Path) -> None:
    name = _wordlevel(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools %}more {% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = load_dict({"models": {"m": {"endpoints": ["a:1"]}}})
    plain = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with_tools = {**plain, "tools": [{"type": "function", "function": {"name": "f"}}]}
    tokenizer = make_tokenizer(name)
    ids = [
        tokenizer.tokens(build_request(config, {}, CHAT, orjson.dumps(body)).raw_prompt)
        for body in (plain, with_tools)
    ]
    assert ids[0] == (2, 4, 3) and ids[1] == (6, 2, 4, 3)


def test_a_chat_template_that_does_not_compile_is_named_at_config_load(tmp_path: Path) -> None:
    name = _wordlevel(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match="chat template does not compile"):
        make_tokenizer(name)


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [([5, 6, 7], (5, 6, 7)), (["hi there"], (4, 5)), (["hi", "there"], None), ([], None)],
)
def test_a_completions_list_prompt_is_token_ids_or_its_one_text_not_chat(
    tmp_path: Path, prompt: list[object], tokens: tuple[int, ...] | None
) -> None:
    """A list prompt was rendered as chat messages: the engine's tokens and these parted."""
    name = _wordlevel(tmp_path)
    config = load_dict({"models": {"m": {"endpoints": ["a:1"]}}})
    body = orjson.dumps({"model": "m", "prompt": prompt})
    raw = build_request(config, {}, "/v1/completions", body).raw_prompt
    assert make_tokenizer(name).tokens(raw) == tokens


def test_named_chat_templates_use_the_default_one(tmp_path: Path) -> None:
    name = _wordlevel(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    named = [{"name": "tool_use", "template": "more"}, {"name": "default", "template": template}]
    (tmp_path / "tokenizer_config.json").write_text(orjson.dumps({"chat_template": named}).decode())
    assert make_tokenizer(name).tokens([{"role": "user", "content": "hi"}]) == (2, 4)


@pytest.mark.parametrize(
    ("template", "content"),
    [
        # A template that prints the content: vLLM joins the text parts with newlines.
        ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}", None),
        # One that loops over the parts: vLLM hands it parts, a string one as a text part.
        (
            "{% for m in messages %}<|{{ m.role }}|>{% for p in m.content %}{{ p.text }} "
            "{% endfor %}{% endfor %}",
            "hi there",
        ),
    ],
)
def test_chat_content_reaches_the_template_as_vllm_hands_it_over(
    tmp_path: Path, template: str, content: str | None
) -> None:
    """OpenAI clients send content as a list of text parts; vLLM joins them with "\\n" for a
    template that prints the content and wraps a string in a text part for one that loops
    over parts. Rendered as given, the parts came out as a Python list's repr (or a
    string's characters), so the router's tokens and the engine's parted at once."""
    name = _wordlevel(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(template)
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    message = {"role": "user", "content": parts if content is None else content}
    assert make_tokenizer(name).tokens([message]) == (2, 4, 5)  # <|user|> hi there


def test_tool_call_arguments_reach_the_template_parsed_as_vllm_hands_them_over(
    tmp_path: Path,
) -> None:
    """The OpenAI API sends an assistant's tool-call arguments as a JSON string; vLLM parses
    them into a dict before rendering (templates print `arguments | tojson` or read its
    keys). Rendered as the string, every agent turn after a tool call parted early."""
    name = _wordlevel(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% for c in m.tool_calls or [] %} {{ c.function.arguments.city }}{% endfor %}"
        "{% endfor %}"
    )
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"city": "there"}'},
    }
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    assert make_tokenizer(name).tokens(messages) == (2, 4, 3, 5)  # <|user|>hi<|assistant|> there
    assert call["function"] == {"name": "f", "arguments": '{"city": "there"}'}  # not mutated


def _two_chars_a_token() -> object:
    """A tokenizer whose tokens are 2 characters long (code, CJK text: README's robustness
    runs use tokenizers of 2 and 6 characters a token)."""

    def encode(text: str, special: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        starts = tuple(range(0, len(text) - 1, 2))
        return tuple(hash(text[i : i + 2]) & 0xFFFF for i in starts), starts

    return PromptTokenizer("two", lambda chat: "", encode)


def test_approximate_hits_are_counted_in_the_tokenizers_tokens_beside_exact_ones() -> None:
    """With a `tokenizer` and KV events live on some endpoint, the prompt's size is the
    tokenizer's count, and a live endpoint's hits are in those tokens. An endpoint whose
    events are unknown falls back to the approximate index (README), whose hits are
    `depth x block_tokens` of this router's chars/4 estimate: subtracted from the
    tokenizer's count, a prompt the index holds whole there reads half uncached at 2
    characters a token (and fully cached at a fraction of it at 6), so a session's home
    is priced as if it had lost half its history."""
    prompt = "".join(f"{i:04d}" for i in range(2000))  # 8,000 characters: 4,000 tokens
    request = RequestInfo(
        "m", "r", prompt=prompt, prompt_tokens=len(prompt) // 4, raw_prompt=prompt,
        session_key="s1",
    )  # fmt: skip
    kv = ExactPrefixIndex()
    kv.apply_batch(  # a: events live, holds nothing of this prompt
        "a:1", EventBatch(0, 0.0, (BlockStored((), None, (), 16, medium="GPU"),)), now=0.0
    )
    scorer = LatencyScorer()
    scorer.tokenizer = _two_chars_a_token()  # type: ignore[assignment]
    states = [state("a:1"), state("b:1")]  # b: no events (unknown): the approximate index
    scorer.index.insert("b:1", scorer.index.hashes(prompt), "s1", 0.0)  # b holds it all
    ctx = context(states, request=request)
    ctx.kv = kv
    scorer.score(ctx, states)
    terms = scorer.terms()
    assert terms["exact"] == (1.0, 0.0)
    tokens = 4000
    assert terms["cached_tokens"][0] == 0.0
    # b's index holds all 31 whole 256-character blocks of the prompt: 7,936 of its 8,000
    # characters, 3,968 of its 4,000 tokens.
    assert terms["cached_tokens"][1] >= 0.95 * tokens, terms["cached_tokens"]
