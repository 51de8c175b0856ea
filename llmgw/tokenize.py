"""A request's prompt -> the token ids the engine will see, for exact prefix matching.

Two schemes (the latency scorer's `tokenizer` param):
- `sim`: the simulator's deterministic scheme (it has no vocabulary). Chat messages are
  flattened as `<|role|>\\ncontent\\n` then `<|assistant|>\\n`; the text is cut into
  4-character tokens whose id is the CRC-32 of their UTF-8 bytes (the last may be
  shorter). `llmgw.sim.tokens` implements the same; a test keeps the two equal.
- a path to a Hugging Face `tokenizer.json`: the `tokenizers` library; chat requests are
  rendered with the model's chat template (`chat_template.jinja` beside it, or
  `chat_template` in `tokenizer_config.json`) with jinja2, as vLLM does; completions get
  the tokenizer's special tokens (BOS), chat prompts only the template's own (either as
  the request's `add_special_tokens` says, as in vLLM).
Both are optional extras (`pip install 'llmgw[exact]'`); without them config load fails
with a message saying so.

Tokenizing is the costly part, so ids are cached per rendered prompt (LRU): a retried or
fanned-out request, or the same prompt on several pick attempts, is tokenized once.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIM_CHARS_PER_TOKEN = 4


def sim_token_ids(text: str) -> tuple[int, ...]:
    step = SIM_CHARS_PER_TOKEN
    crc = zlib.crc32
    return tuple(crc(text[i : i + step].encode()) for i in range(0, len(text), step))


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def sim_chat_prompt(messages: list[Any]) -> str:
    parts = [
        f"<|{m.get('role', 'user')}|>\n{_text(m.get('content'))}\n"
        for m in messages
        if isinstance(m, dict)
    ]
    parts.append("<|assistant|>\n")
    return "".join(parts)


# Encoder: (text, add special tokens) -> (ids, start character offset of each token).
Encoder = Callable[[str, bool], tuple[tuple[int, ...], tuple[int, ...]]]


def _sim_encode(text: str, special: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return sim_token_ids(text), tuple(range(0, len(text), SIM_CHARS_PER_TOKEN))


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat request's messages with what else its template renders: `tools`, and the
    kwargs vLLM renders it with (the request's `chat_template_kwargs` under its own fields);
    `add_special_tokens`: the tokenizer's special tokens (BOS) added to the rendered text
    (vLLM's default for chat: no). A request without any of them carries its messages
    list."""

    messages: list[Any]
    tools: Any = None
    kwargs: Any = None
    add_special_tokens: bool = False


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A completion's prompt text and whether the tokenizer's special tokens are added to
    it (vLLM's `add_special_tokens`, true by default: a plain string)."""

    text: str
    add_special_tokens: bool = True


class PromptTokenizer:
    """`raw_prompt` (a messages list or a prompt string) -> token ids, cached two ways: by
    the whole rendered prompt (LRU), and per session: a conversation's next prompt extends
    its last one, so only the new text is tokenized, from the last token before the old
    end (less `margin`) where tokenizing restarts exactly (`restarts(id)`: a special token
    such as a chat template's role marker, which the tokenizer never merges across).
    Both caches are bounded by the tokens they hold (`max_tokens` each, ~50 bytes a token
    with its offset: 1M tokens ~ 50 MB), oldest dropped first."""

    def __init__(
        self,
        name: str,
        render_chat: Callable[[ChatPrompt], str],
        encode: Encoder,
        restarts: Callable[[int], bool] = lambda _: True,
        max_tokens: int = 1_000_000,
        margin: int = 8,
    ) -> None:
        self.name = name
        self._render_chat = render_chat
        self._encode = encode
        self._restarts = restarts
        self.max_tokens = max_tokens
        self.margin = margin
        self._cache_tokens = 0
        self._session_tokens = 0
        self._cache: OrderedDict[tuple[bool, str], tuple[int, ...]] = OrderedDict()
        # hash(session) -> (special tokens added, text, ids, start offsets) of its last
        # prompt. The key's hash, not the key: a session id is the client's (up to the 60 KB
        # head limit) and the bound counts tokens; two sessions of one hash only share a
        # start (`_extend` checks the text extends the one kept).
        self._sessions: OrderedDict[int, tuple[bool, str, tuple[int, ...], tuple[int, ...]]] = (
            OrderedDict()
        )
        self.hits = 0
        self.misses = 0
        self.extended = 0  # misses served by extending the session's last prompt

    def tokens(self, raw_prompt: Any, session: str | None = None) -> tuple[int, ...] | None:
        """None when the request carries no prompt this tokenizer can render."""
        if isinstance(raw_prompt, tuple):  # a completion's prompt given as token ids
            return raw_prompt
        if isinstance(raw_prompt, (list, ChatPrompt)):
            chat_prompt = (
                raw_prompt if isinstance(raw_prompt, ChatPrompt) else ChatPrompt(raw_prompt)
            )
            try:
                special, text = chat_prompt.add_special_tokens, self._render_chat(chat_prompt)
            except Exception:  # a template error on odd messages: fall back, never fail the pick
                return None
        elif isinstance(raw_prompt, str):
            special, text = True, raw_prompt
        elif isinstance(raw_prompt, TextPrompt):
            special, text = raw_prompt.add_special_tokens, raw_prompt.text
        else:
            return None
        key = (special, text)
        cache = self._cache
        ids = cache.get(key)
        if ids is not None:
            cache.move_to_end(key)
            self.hits += 1
            return ids
        self.misses += 1
        ids, ends = self._extend(special, text, session) or self._encode(text, special)
        cache[key] = ids
        self._cache_tokens += len(ids)
        while self._cache_tokens > self.max_tokens and len(cache) > 1:
            self._cache_tokens -= len(cache.popitem(last=False)[1])
        if session is not None:
            sessions = self._sessions
            held = hash(session)
            old = sessions.pop(held, None)
            if old is not None:
                self._session_tokens -= len(old[2])
            sessions[held] = (special, text, ids, ends)
            self._session_tokens += len(ids)
            while self._session_tokens > self.max_tokens and len(sessions) > 1:
                self._session_tokens -= len(sessions.popitem(last=False)[1][2])
        return ids

    def _extend(
        self, special: bool, text: str, session: str | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        last = self._sessions.get(hash(session)) if session is not None else None
        if last is None or last[0] != special or not text.startswith(last[1]):
            return None
        _, _, old_ids, old_starts = last
        restarts = self._restarts
        keep = len(old_ids) - self.margin
        while keep > 0 and not restarts(old_ids[keep]):
            keep -= 1
        if keep <= 0:
            return None
        cut = old_starts[keep]
        new_ids, new_starts = self._encode(text[cut:], False)
        self.extended += 1
        return old_ids[:keep] + new_ids, old_starts[:keep] + tuple(cut + x for x in new_starts)


def sim_tokenizer() -> PromptTokenizer:
    return PromptTokenizer("sim", lambda chat: sim_chat_prompt(chat.messages), _sim_encode)


def hf_tokenizer(path: str) -> PromptTokenizer:
    """From a tokenizer.json; a ValueError says what is missing."""
    try:
        import jinja2  # noqa: PLC0415 (optional extra, loaded only when configured)
        from tokenizers import Tokenizer  # noqa: PLC0415

        from llmgw.chat_template import (  # noqa: PLC0415
            loops_over_content,
            mentions_developer,
            render_continuing,
            template_environment,
            vllm_messages,
            vllm_tools,
        )
    except ImportError as exc:
        raise ValueError(
            f"tokenizer {path!r} needs the optional packages `tokenizers` and `jinja2` "
            "(pip install 'llmgw[exact]'); or use tokenizer: sim"
        ) from exc
    file = Path(path)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception
        raise ValueError(f"tokenizer: cannot load {path!r}: {exc}") from exc
    folder = file.parent
    settings = _json_file(folder / "tokenizer_config.json")
    template_file = folder / "chat_template.jinja"
    source = template_file.read_text() if template_file.is_file() else settings.get("chat_template")
    # Named templates ({name, template}): `tool_use` for a request with tools, else `default`
    # (transformers' get_chat_template, which vLLM's resolve_chat_template calls).
    named = (
        {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if isinstance(source, list)
        else {"default": source}
    )
    templates: dict[str, tuple[Any, str, bool, bool]] = {}
    for name, text in named.items():
        if not isinstance(name, str) or not isinstance(text, str):
            continue
        try:
            compiled = template_environment().from_string(text)
        except jinja2.TemplateError as exc:
            which = "" if name == "default" else f" {name!r}"
            raise ValueError(
                f"tokenizer {path!r}: its chat template{which} does not compile: {exc}"
            ) from None
        templates[name] = (compiled, text, loops_over_content(text), mentions_developer(text))
    specials = _special_tokens(settings, folder)

    def render(chat: ChatPrompt) -> str:
        # vLLM's request tools are the kwargs' defaults: `chat_template_kwargs.tools`, as
        # sent, overrides them (ChatParams.with_defaults), for the template and its choice.
        kwargs = chat.kwargs if isinstance(chat.kwargs, dict) else {}
        given = kwargs.get("tools")
        tools = given if given is not None else vllm_tools(chat.tools)
        chosen = templates.get("tool_use") if tools is not None else None
        chosen = chosen or templates.get("default")
        if chosen is None:
            raise ValueError(f"tokenizer {path!r}: no chat template beside it")
        template, text, parts, developer = chosen
        context: dict[str, Any] = {**specials, "add_generation_prompt": True, "documents": None}
        context.update(kwargs)  # as vLLM merges them (request.py's _chat_prompt)
        continuing = context.pop("continue_final_message", False)  # not a template variable
        context["messages"] = vllm_messages(chat.messages, parts, developer)
        context["tools"] = tools
        if continuing:
            return render_continuing(template, text, context)
        return str(template.render(**context))

    def encode(text: str, special: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        enc = tok.encode(text, add_special_tokens=special)
        return tuple(enc.ids), tuple(start for start, _ in enc.offsets)

    special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return PromptTokenizer(path, render, encode, special_ids.__contains__)


# The named special tokens transformers hands a chat template (SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _json_file(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot read {str(file)!r}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _special_tokens(settings: dict[str, Any], folder: Path) -> dict[str, str]:
    """The special tokens a template sees (`bos_token`...), as transformers 5 loads them
    (PreTrainedTokenizerBase.from_pretrained, transformers/tokenization_utils_base.py):
    from tokenizer_config.json, with special_tokens_map.json's over them when the config
    has no `added_tokens_decoder` (it is not read otherwise); unset ones are left out."""
    values = dict(settings)
    if "added_tokens_decoder" not in settings:
        values.update(_json_file(folder / "special_tokens_map.json"))
    out: dict[str, str] = {}
    for key in _SPECIAL_TOKENS:
        value = values.get(key)
        if isinstance(value, dict):  # {"content": "<s>", ...}
            value = value.get("content")
        if value is not None:
            out[key] = str(value)
    return out


def make_tokenizer(spec: str) -> PromptTokenizer:
    """`sim` or a path to a tokenizer.json (a ValueError says what to fix)."""
    if not spec:
        raise ValueError("tokenizer: empty; use `sim` or the path of a tokenizer.json")
    return sim_tokenizer() if spec == "sim" else hf_tokenizer(spec)
