"""The user's workload: a requests file replayed on the server with each request's own sampling parameters, the
bundled training-like prompts, what tells the two sets apart, and the unpaired loss of accept length between them
(the decision and the ``requests_accept_less`` finding: :mod:`helpers.investigation.workload`).

**The requests file** (``--requests FILE``): JSON lines, one request body per line, as a production log or a
benchmark writes them. The kind of each line is read from its keys:

* OpenAI chat (``/v1/chat/completions``): ``messages`` (a list of ``{"role", "content"}``);
* OpenAI completions (``/v1/completions``): ``prompt`` (a string, or a list of token ids);
* SGLang ``/generate``: ``text`` (a string) or ``input_ids`` (token ids), with ``sampling_params``.

Each becomes one ``/generate`` request (the :class:`helpers.server.client.ServerClient` contract: SGLang's
``/generate``, vLLM's ``/v1/completions`` behind the same call) with the body's own sampling parameters in SGLang's
names (``max_tokens`` / ``max_completion_tokens`` -> ``max_new_tokens``, ``min_tokens`` -> ``min_new_tokens``,
``seed`` -> ``sampling_seed``, as ``sglang/srt/entrypoints/openai/protocol.py::ChatCompletionRequest.
to_sampling_params`` and ``CompletionRequest.to_sampling_params`` map them). A parameter the body leaves out gets the
default of the endpoint it was written for (SGLang 0.5.23): temperature 1.0 and top_p 1.0 for completions and
``/generate`` (``CompletionRequest``, ``sampling/sampling_params.py::SamplingParams``), for chat the target's
``generation_config.json`` value, else 1.0 (``ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS``); max tokens 16 for
completions (``CompletionRequest.max_tokens``), 128 for ``/generate`` (``SamplingParams.max_new_tokens``), and for
chat (no limit there but the context) the measurement's ``max_new_tokens``.

**Chat bodies are rendered here** with the target tokenizer's chat template (transformers
``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)``, as SGLang's
``entrypoints/openai/serving_chat.py::OpenAIServingChat._encode_messages`` does: token ids, so no second BOS is
added) and sent as ``input_ids`` to ``/generate``,
not to ``/v1/chat/completions``: (1) per-request accept length then comes from the same counters as every other
measurement of the tool (``meta_info.spec_verify_ct`` / ``completion_tokens`` / ``spec_correct_drafts_histogram`` of
``/generate``; SGLang 0.5.23's chat endpoint returns them only under ``sglext.spec_tokens_details`` when the body
asks ``return_spec_tokens_details``, ``entrypoints/openai/utils.py::process_spec_tokens_details_from_ret``, and vLLM's
chat endpoint has its own); (2) the tool knows, and records, the exact text sent and whether a template was applied,
and the bundled prompts it compares with go through the same template. The cost: a server launched with its own
``--chat-template`` renders chat differently from the tokenizer's template; :func:`resolve_tokenizer` warns when ``/server_info`` names one (:func:`resolve_tokenizer`). A chat body whose tokenizer has no chat template is refused (one line naming the file
and the line), never sent as raw text silently.

**Every line is checked before any request** (:func:`load_requests`; exit 2, one line naming the file, the line and
the field): token ids below the target's vocab size (:func:`vocab_size_of`; an id beyond it kills an SGLang server),
sampling params within SGLang 0.5.23's bounds (:func:`check_sampling`), a chat template that renders the messages,
no lone surrogate, not both ``text`` and ``input_ids``.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from ..errors import BadInput
from ..runfiles import JSONTooDeep, loads_json, read_file_text
from .prompts import MAX_PROMPTS, Prompt, load_prompts, token_ids
from .stats import bootstrap_ratio_diff_ci

#: request kinds of a requests file's line
KINDS = ("chat", "completions", "generate")
#: OpenAI body key -> SGLang sampling param (``protocol.py::*Request.to_sampling_params``)
OPENAI_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                   "min_tokens": "min_new_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos", "seed": "sampling_seed",
                   "no_stop_trim": "no_stop_trim", "skip_special_tokens": "skip_special_tokens",
                   "logit_bias": "logit_bias"}
#: SGLang ``/generate`` sampling params taken from a body's ``sampling_params`` (``SamplingParams.__init__``);
#: structured-output and custom-processor params are left out (listed in ``ignored``)
GENERATE_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens", "stop",
                     "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                     "sampling_seed", "no_stop_trim", "skip_special_tokens", "logit_bias")
#: body keys that say how to transport the answer, not what to generate: never sent, never reported as ignored
TRANSPORT_KEYS = {"model", "stream", "stream_options", "user", "rid", "n", "logprobs", "top_logprobs",
                  "return_logprob", "echo"}
#: max tokens when the body gives none (module docstring); chat: None = the measurement's max_new_tokens
DEFAULT_MAX = {"completions": 16, "generate": 128, "chat": None}
#: the most new tokens one request may ask for (a sane bound: no target here has a longer context)
MAX_NEW_TOKENS = 1_000_000
#: SGLang 0.5.23 bounds (``sglang/srt/sampling/sampling_params.py``: ``TOP_K_ALL`` = 1 << 30 is "the whole
#: vocabulary", ``MAX_STOP_COUNT`` stop strings at most, ``sampling_seed`` an int64)
TOP_K_MAX, MAX_STOP_COUNT, INT64 = 1 << 30, 32, 2 ** 63


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    """One line of a requests file as the tool sends it.

    Attributes:
        prompt: the :class:`Prompt` sent (``text``: a chat body rendered with the chat template, or a completions /
            ``/generate`` text; ``input_ids``: token ids as given); its ``id`` is ``L<line>``.
        sampling: SGLang-named sampling params (``max_new_tokens`` always set; ``temperature`` always set).
        kind: ``chat`` | ``completions`` | ``generate``; line: 1-based line of the file.
        chat_template: a chat template was applied (chat bodies only).
        ignored: body keys the tool does not send (structured output, tools, ...): they may change the answer.
        content: the request's text as written (a chat body's message contents joined), None for token ids.
    """

    prompt: Prompt
    sampling: dict
    kind: str
    line: int
    chat_template: bool = False
    ignored: tuple[str, ...] = ()
    content: Optional[str] = None


def _expected() -> str:
    return ('one JSON object per line: an OpenAI chat body {"messages": [...]}, an OpenAI completions body '
            '{"prompt": "..." or [token ids]}, or an SGLang /generate body {"text": ... or "input_ids": [...], '
            '"sampling_params": {...}}')


def load_tokenizer(path: str | Path) -> Any:
    """The target's tokenizer (transformers ``AutoTokenizer.from_pretrained(path)``), for its chat template.

    Raises: BadInput: the folder holds no tokenizer transformers can read (naming the folder)."""
    from transformers import AutoTokenizer  # lazy: heavy import
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        raise BadInput(f"no tokenizer readable here ({str(exc).splitlines()[0][:160]}); expected the target's "
                       "tokenizer folder", path=path) from None


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template (``tokenizer.chat_template`` set)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """``messages`` as the token ids the target sees: ``tokenizer.apply_chat_template(messages, tokenize=True,
    add_generation_prompt=True, return_dict=False)`` (``sglang/srt/entrypoints/openai/serving_chat.py::
    OpenAIServingChat._encode_messages`` with the tokenizer's template, when the server has no ``--chat-template``).
    Raises ValueError when it has none."""
    if not has_chat_template(tokenizer):
        raise ValueError("the target tokenizer has no chat template to render a chat body with (send completions "
                         "bodies with the rendered text, or give a tokenizer that has one)")
    try:
        ids = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True,
                                            return_dict=False)
    except Exception as exc:  # noqa: BLE001 -- jinja2 TemplateError / UndefinedError, or any error of the template
        raise ValueError(f"messages: the tokenizer's chat template cannot render them ({type(exc).__name__}: "
                         f"{_short(exc)}); expected messages the template accepts (e.g. roles alternating "
                         "user / assistant, each with a content)") from None
    return token_ids(list(ids))


def _short(exc: BaseException, n: int = 160) -> str:
    """``exc``'s message on one line, at most ``n`` characters, control characters escaped."""
    return _escape(" ".join(str(exc).split()))[:n]


def _escape(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1, U+2028/9) written as ``\\xNN`` / ``\\uNNNN``: a key or value
    read from a file is shown on a terminal only through this (no escape sequence reaches it)."""
    return "".join(c if c.isprintable() or c == " " else (f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
                   for c in text)


def _sampling(kind: str, body: Mapping[str, Any], default_max_new_tokens: int,
              gen_defaults: Mapping[str, Any], vocab_size: Optional[int] = None) -> tuple[dict, list[str]]:
    """SGLang-named sampling params of one body and the keys left out (module docstring's defaults), each checked
    by :func:`check_sampling` (named as the body names it: ``seed``, ``sampling_params.top_k``)."""
    sp: dict[str, Any] = {}
    names: dict[str, str] = {}
    ignored: list[str] = []
    if kind == "generate":
        given = body.get("sampling_params")
        if given is None:
            given = {}
        if not isinstance(given, Mapping):
            raise ValueError(f"sampling_params is a JSON {_json_type(given)}; expected an object")
        for k, v in given.items():
            if k in GENERATE_SAMPLING:
                if v is not None:             # None = SGLang's default (SamplingParams.__post_init__)
                    sp[k], names[k] = v, f"sampling_params.{k}"
            elif k == "n":
                _check_n(v, "sampling_params.n")
            else:
                ignored.append(f"sampling_params.{_escape(str(k))}")
        skip = {"text", "input_ids", "sampling_params"} | TRANSPORT_KEYS
        ignored += [_escape(k) for k in body if k not in skip]
    else:
        content = {"messages"} if kind == "chat" else {"prompt"}
        # chat: max_completion_tokens before max_tokens, whatever their order in the body (SGLang 0.5.23
        # entrypoints/openai/protocol.py::ChatCompletionRequest.to_sampling_params `self.max_completion_tokens or
        # self.max_tokens`; vLLM 0.32.0 entrypoints/openai/chat_completion/protocol.py::ChatCompletionRequest.
        # build_tok_params, max_completion_tokens unless None); completions: neither engine's CompletionRequest has
        # max_completion_tokens, so it is not read (its default max_tokens 16 applies) and is listed as ignored
        keys = sorted(body, key=lambda k: k != "max_completion_tokens") if kind == "chat" else list(body)
        for k in keys:
            v = body[k]
            if k in OPENAI_SAMPLING and not (kind == "completions" and k == "max_completion_tokens"):
                if v is not None and OPENAI_SAMPLING[k] not in sp:
                    sp[OPENAI_SAMPLING[k]], names[OPENAI_SAMPLING[k]] = v, k
            elif k not in content and k not in TRANSPORT_KEYS:
                ignored.append(_escape(k))
    n = body.get("n")
    if n is not None:
        _check_n(n, "n")
        if n != 1:
            ignored.append(f"n={n} (one answer is measured)")
    if kind == "chat":
        for k in ("temperature", "top_p", "top_k"):
            if k not in sp and gen_defaults.get(k) is not None:
                sp[k], names[k] = gen_defaults[k], f"generation_config.json {k}"
    sp.setdefault("temperature", 1.0)
    if sp.get("max_new_tokens") is None:
        sp["max_new_tokens"] = DEFAULT_MAX[kind] or int(default_max_new_tokens)
    check_sampling(sp, names, vocab_size=vocab_size)
    return sp, ignored


def _json_type(v: Any) -> str:
    """The JSON name of a parsed value's type (object, array, string, number, boolean, null)."""
    return ("null" if v is None else "boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float))
            else "string" if isinstance(v, str) else "array" if isinstance(v, list) else "object"
            if isinstance(v, Mapping) else type(v).__name__)


def _show(v: Any) -> str:
    """A value as the error shows it: its JSON type and at most 60 characters of it, control characters escaped."""
    text = repr(v)
    return f"{_json_type(v)} {_escape(text[:60])}{'...' if len(text) > 60 else ''}"


def _check_n(n: Any, name: str) -> None:
    """``n`` (answers per request): a positive integer (SGLang ``SamplingParams.n``). Raises ValueError."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < INT64:
        raise ValueError(f"{name} is {_show(n)}; expected a positive integer")


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _int(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int)


def check_sampling(sp: Mapping[str, Any], names: Optional[Mapping[str, str]] = None, *,
                   vocab_size: Optional[int] = None) -> None:
    """Check SGLang-named sampling params against SGLang 0.5.23's own constraints, so the server never answers 400
    (or fails later) for a request this passed: ``sglang/srt/sampling/sampling_params.py::SamplingParams.verify``
    (temperature finite >= 0, top_p in (0, 1], min_p in [0, 1], top_k -1 or >= 1, frequency / presence penalty in
    [-2, 2], repetition penalty in (0, 2], 0 <= min_new_tokens <= max_new_tokens, logit_bias keys token ids in
    [0, vocab), sampling_seed an int64) and ``SamplingParams.normalize`` / ``__post_init__`` (stop: a string or a
    list of at most ``MAX_STOP_COUNT`` strings; stop_token_ids: integers). Stricter where SGLang would coerce: types
    are exact (``"5"`` is no top_k), booleans are booleans, max_new_tokens is at most :data:`MAX_NEW_TOKENS`.

    Args:
        sp: the params (SGLang names: ``max_new_tokens``, ``sampling_seed``, ...); None values are not checked.
        names: SGLang name -> the name the body gave it (``seed``, ``sampling_params.top_k``), for the message.
        vocab_size: the target's vocabulary size (token ids of stop_token_ids / logit_bias below it), None: unknown.

    Raises: ValueError naming the field, its value and what was expected."""
    names = names or {}

    def bad(k: str, what: str) -> ValueError:
        return ValueError(f"{names.get(k, k)} is {_show(sp[k])}; expected {what}")

    def has(k: str) -> bool:
        return sp.get(k) is not None
    ranges = {"temperature": (0.0, math.inf, "a finite number >= 0", lambda x: 0 <= x),
              "top_p": (0, 1, "a number in (0, 1]", lambda x: 0 < x <= 1),
              "min_p": (0, 1, "a number in [0, 1]", lambda x: 0 <= x <= 1),
              "frequency_penalty": (-2, 2, "a number in [-2, 2]", lambda x: -2 <= x <= 2),
              "presence_penalty": (-2, 2, "a number in [-2, 2]", lambda x: -2 <= x <= 2),
              "repetition_penalty": (0, 2, "a number in (0, 2] (1 = no penalty)", lambda x: 0 < x <= 2)}
    for k, (_, _, what, ok) in ranges.items():
        if has(k) and not (_number(sp[k]) and ok(sp[k])):
            raise bad(k, what)
    if has("top_k") and not (_int(sp["top_k"]) and (sp["top_k"] == -1 or 1 <= sp["top_k"] <= TOP_K_MAX)):
        raise bad("top_k", f"-1 (the whole vocabulary) or an integer from 1 to {TOP_K_MAX}")
    mnt = sp.get("max_new_tokens")
    if has("max_new_tokens") and not (_int(mnt) and 1 <= mnt <= MAX_NEW_TOKENS):
        raise bad("max_new_tokens", f"an integer from 1 to {MAX_NEW_TOKENS:,}")
    if has("min_new_tokens"):
        top = mnt if _int(mnt) else MAX_NEW_TOKENS
        if not (_int(sp["min_new_tokens"]) and 0 <= sp["min_new_tokens"] <= top):
            raise bad("min_new_tokens", f"an integer from 0 to the max tokens ({top})")
    for k in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
        if has(k) and not isinstance(sp[k], bool):
            raise bad(k, "true or false")
    if has("sampling_seed") and not (_int(sp["sampling_seed"]) and -INT64 <= sp["sampling_seed"] < INT64):
        raise bad("sampling_seed", "an integer in [-2**63, 2**63 - 1]")
    if has("stop"):
        st = sp["stop"]
        if not (isinstance(st, str) or (isinstance(st, list) and len(st) <= MAX_STOP_COUNT
                                        and all(isinstance(x, str) for x in st))):
            raise bad("stop", f"a string or a list of at most {MAX_STOP_COUNT} strings")
    top_id = f"from 0 to {vocab_size - 1} (the target's vocab_size {vocab_size})" if vocab_size else "(>= 0)"
    if has("stop_token_ids"):
        ids = sp["stop_token_ids"]
        if not (isinstance(ids, list) and all(_int(t) and 0 <= t < (vocab_size or INT64) for t in ids)):
            raise bad("stop_token_ids", f"a list of integer token ids {top_id}")
    if has("logit_bias"):
        lb = sp["logit_bias"]
        if not (isinstance(lb, Mapping) and all(
                str(t).isdecimal() and str(t).isascii() and int(t) < (vocab_size or INT64) and _number(b)
                for t, b in lb.items())):
            raise bad("logit_bias", f"an object mapping token ids {top_id} to finite numbers")


def kind_of(body: Mapping[str, Any]) -> str:
    """``chat`` | ``completions`` | ``generate`` from a body's keys (module docstring). Raises ValueError."""
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completions"
    if "text" in body or "input_ids" in body:
        return "generate"
    raise ValueError(f"has none of messages / prompt / text / input_ids (keys: {_escape(', '.join(map(str, list(body)[:8])))[:200]})")


#: ``tokenizer=CHECK_ONLY``: check a requests file before any work, chat bodies not rendered (their ``input_ids`` a
#: placeholder: never sent)
CHECK_ONLY = object()


def _check_unicode(body: Mapping[str, Any]) -> None:
    """Refuse a lone surrogate (``"\\ud800"``: valid JSON, no Unicode text; it could not be sent as UTF-8),
    naming the top-level field that holds it. Raises ValueError."""
    for k, v in body.items():
        try:
            json.dumps({k: v}, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{_escape(repr(k)[1:-1])} holds a lone surrogate (an unpaired \\ud800-\\udfff escape); "
                             "expected valid Unicode text") from None


def _check_vocab(ids: Sequence[int], field: str, vocab_size: Optional[int]) -> None:
    """Every token id below the target's vocabulary size: an id >= ``vocab_size`` reaches the target's
    ``embed_tokens`` unchecked (SGLang 0.5.23 checks ``token_ids_logprob`` against ``model_config.vocab_size``,
    ``managers/tokenizer_manager.py::TokenizerManager._validate_token_ids_logprob``, but not ``input_ids``: the
    server dies with an IndexError). Raises ValueError naming ``field[k]`` and the vocab size."""
    if vocab_size is None:
        return
    for k, t in enumerate(ids):
        if t >= vocab_size:
            raise ValueError(f"{field}[{k}] is {t}; expected a token id from 0 to {vocab_size - 1} (the target's "
                             f"vocab_size {vocab_size})")


def parse_request(body: Any, line: int, *, tokenizer: Any = None, default_max_new_tokens: int = 128,
                  gen_defaults: Optional[Mapping[str, Any]] = None,
                  vocab_size: Optional[int] = None) -> WorkloadRequest:
    """One body (a parsed JSON line) as a :class:`WorkloadRequest` (module docstring), its sampling params checked
    (:func:`check_sampling`) and its token ids below ``vocab_size`` (the target's vocabulary size; None: unknown,
    not checked; ids rendered from a chat template come from the tokenizer and are not checked).

    Raises: ValueError / TypeError saying what is wrong with it, naming the field (the caller adds the file and
    line)."""
    if not isinstance(body, Mapping):
        raise ValueError(f"is a JSON {_json_type(body)}, not an object")
    _check_unicode(body)
    kind = kind_of(body)
    if kind == "generate" and body.get("text") is not None and body.get("input_ids") is not None:
        raise ValueError("gives both text and input_ids; expected one of them (SGLang refuses both: "
                         "managers/io_struct.py::GenerateReqInput)")
    sp, ignored = _sampling(kind, body, default_max_new_tokens, gen_defaults or {}, vocab_size)
    pid = f"L{line}"
    templ = False
    content: Optional[str] = None
    if kind == "chat":
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in msgs):
            raise ValueError("messages must be a non-empty list of objects with a role")
        if tokenizer is None:
            raise ValueError("is a chat body but no tokenizer was given to render it with its chat template")
        ids = (0,) if tokenizer is CHECK_ONLY else render_chat(tokenizer, msgs)
        prompt = Prompt(id=pid, input_ids=ids, kind="chat")
        content = " ".join(str(m.get("content") or "") for m in msgs)
        templ = True
    else:
        x = body["prompt"] if kind == "completions" else (body.get("text") if "text" in body else None)
        ids = body.get("input_ids") if kind == "generate" else None
        if kind == "completions" and isinstance(x, list) and x and isinstance(x[0], list):
            raise ValueError("prompt is a batch (a list of lists); expected one prompt per line")
        field = "input_ids"
        if kind == "completions" and isinstance(x, list):
            x, ids, field = None, x, "prompt"
        if x is not None:
            if not isinstance(x, str) or not x:
                raise ValueError(f"{'prompt' if kind == 'completions' else 'text'} must be a non-empty string or "
                                 f"a list of token ids, got {type(x).__name__}")
            prompt = Prompt(id=pid, text=x, kind=kind)
            content = x
        else:
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                raise ValueError("input_ids is a batch (a list of lists); expected one prompt per line")
            try:
                tids = token_ids(ids)
            except ValueError as exc:
                raise ValueError(str(exc).replace("input_ids", field, 1)) from None
            _check_vocab(tids, field, vocab_size)
            prompt = Prompt(id=pid, input_ids=tids, kind=kind)
    return WorkloadRequest(prompt=prompt, sampling=sp, kind=kind, line=line, chat_template=templ,
                           ignored=tuple(ignored), content=content)


def resolve_tokenizer(info: Mapping[str, Any], given: Optional[str | Path] = None) -> tuple[Optional[Path], str]:
    """Where the target's tokenizer is read from: ``given`` (``--tokenizer``), else the server's ``tokenizer_path``
    or ``model_path`` (``/server_info``) when that folder is readable here. Returns ``(folder or None, note)``; the
    note says where it came from, or why none, and warns when the server renders chat with its own
    ``--chat-template`` (a chat body then gets another text there than here)."""
    notes = []
    if info.get("chat_template"):
        notes.append(f"the server was launched with --chat-template {info['chat_template']}: its chat endpoint renders "
                     "chat with that template, this tool with the tokenizer's own")
    if given is not None:
        return Path(given), "; ".join(["tokenizer from --tokenizer"] + notes)
    for key in ("tokenizer_path", "model_path"):
        d = info.get(key)
        if d and Path(str(d)).is_dir():
            return Path(str(d)), "; ".join([f"tokenizer from the server's {key} {d}"] + notes)
    return None, "; ".join(["the server's tokenizer_path / model_path is not readable here (give --tokenizer)"] + notes)


def load_requests(path: str | Path, *, tokenizer: Any = None, default_max_new_tokens: int = 128,
                  gen_defaults: Optional[Mapping[str, Any]] = None,
                  vocab_size: Optional[int] = None) -> list[WorkloadRequest]:
    """Every line of a requests file (module docstring), blank lines skipped. Lines are split at ``\\n`` only
    (``\\r\\n`` too; JSON strings may hold U+2028 or U+0085 raw, which ``str.splitlines`` would split at); a
    UTF-8 byte order mark at the start is skipped.

    Args:
        path: the JSONL file. tokenizer: the target's tokenizer (:func:`load_tokenizer`), needed for chat bodies,
            or a function of no argument returning it (called at the first chat body: no transformers import
            otherwise).
        default_max_new_tokens: max tokens of a chat body that gives none.
        gen_defaults: the target's ``generation_config.json`` (chat sampling defaults).
        vocab_size: the target's vocabulary size (:func:`vocab_size_of`): token ids at or above it are refused;
            None: not checked.

    Raises:
        BadInput: a missing, unreadable or empty file, or a bad line: one line naming the file, the line number and
        what was expected."""
    path = Path(path)
    if path.is_dir():
        raise BadInput("is a folder; expected a JSONL requests file", path=path)
    if not path.exists():
        raise BadInput("requests file not found", path=path)
    text = read_file_text(path, "requests file", expected="JSON lines")
    if text.startswith("\ufeff"):
        text = text[1:]
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        line = line[:-1] if line.endswith("\r") else line
        if not line.strip():
            continue
        try:
            body = loads_json(line)
        except (json.JSONDecodeError, JSONTooDeep) as exc:
            raise BadInput(f"line {n} is not JSON ({getattr(exc, 'msg', None) or exc}); expected {_expected()}",
                           path=path) from None
        if isinstance(body, Mapping) and "messages" in body and tokenizer is not None \
                and tokenizer is not CHECK_ONLY and not hasattr(tokenizer, "apply_chat_template"):
            tokenizer = tokenizer()
        try:
            out.append(parse_request(body, n, tokenizer=tokenizer, default_max_new_tokens=default_max_new_tokens,
                                     gen_defaults=gen_defaults, vocab_size=vocab_size))
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadInput(f"line {n}: {exc}; expected {_expected()}", path=path) from None
        if len(out) > MAX_PROMPTS:
            raise BadInput(f"more than {MAX_PROMPTS} requests", path=path)
    if not out:
        raise BadInput(f"the requests file is empty; expected {_expected()}", path=path)
    return out


def vocab_size_of(folder: Optional[str | Path], tokenizer: Any = None) -> Optional[int]:
    """The target's vocabulary size, what SGLang indexes ``embed_tokens`` with (``model_config.vocab_size``): the
    ``vocab_size`` of ``folder``'s ``config.json`` (:func:`helpers.formats.configs.read_target_config`, the text
    sub-config of a wrapper) when it has one, else ``len(tokenizer)`` (its vocabulary with added tokens) when a
    tokenizer is given (or a function of no argument returning it, called only then; a BadInput it raises means
    unknown); None when neither is known."""
    if folder is not None and (Path(folder) / "config.json").is_file():
        from ..formats.configs import read_target_config  # lazy: only with --requests
        try:
            v = read_target_config(folder).vocab_size
        except BadInput:
            v = None
        if v:
            return int(v)
    if tokenizer is not None and tokenizer is not CHECK_ONLY and not hasattr(tokenizer, "__len__") \
            and callable(tokenizer):
        try:
            tokenizer = tokenizer()
        except BadInput:
            return None
    if tokenizer is not None and tokenizer is not CHECK_ONLY and hasattr(tokenizer, "__len__"):
        return int(len(tokenizer))
    return None


def require_vocab(reqs: Sequence[WorkloadRequest], vocab_size: Optional[int], why: str, path: str | Path) -> None:
    """Refuse a requests file's token-id bodies when the target's vocabulary size is unknown (no config or tokenizer
    readable: ``why`` says where it was looked for): an id beyond it kills an SGLang server (:func:`_check_vocab`),
    so none is sent unchecked; text and chat bodies pass.

    Raises: BadInput naming the file, the first such line, and ``--tokenizer``."""
    if vocab_size is not None:
        return
    first = next((r for r in reqs if r.kind != "chat" and r.prompt.input_ids), None)
    if first is not None:
        raise BadInput(f"line {first.line} gives token ids, checked against the target's vocab_size before any "
                       f"request (an id beyond it kills an SGLang server), but that is unknown ({why}); expected "
                       "--tokenizer DIR (the target's tokenizer or model folder)", path=path, field="--tokenizer")


#: the engines' refusal of min tokens above max tokens once max tokens is cut to the context
MIN_TOKENS_RULE = ("vllm/sampling_params.py::SamplingParams._verify_args; sglang/srt/sampling/sampling_params.py::"
                   "SamplingParams.verify")


def fit_context(reqs: Sequence[WorkloadRequest], rule: Any, path: str | Path, *, tokenizer: Any = None) -> list[str]:
    """Check every request of a requests file against the server's context before any is sent, as the engine itself
    would (``rule``: :class:`helpers.engines.base.ContextRule`, the engine function named in each message): a prompt
    longer than ``rule.max_prompt`` tokens, or prompt + the engine's reserved slots + ``max_new_tokens`` past
    ``rule.tokens`` on a server that refuses such a request (SGLang without ``--allow-auto-truncate``), is refused
    here in one line naming the file, the line and the lengths; on a server that cuts ``max_new_tokens`` (vLLM,
    SGLang with ``--allow-auto-truncate``) the request's ``max_new_tokens`` is cut the same way and a note says so.
    Prompt tokens: the token ids given, else the text through ``tokenizer`` (as the server tokenizes a ``/generate``
    text); a text request without a tokenizer is left to the server. Returns the notes (one per cut request, at
    most 5 then a count).

    Raises: BadInput naming the file, the line, the prompt's tokens, ``max_new_tokens``, the reserved slots and the
    context length."""
    notes: list[str] = []
    cut = 0
    for q in reqs:
        if q.prompt.input_ids is not None:
            n_in = len(q.prompt.input_ids)
        elif tokenizer is not None and tokenizer is not CHECK_ONLY and q.prompt.text is not None:
            n_in = len(tokenizer(q.prompt.text)["input_ids"])
        else:
            continue
        want = int(q.sampling.get("max_new_tokens") or 0)
        room = rule.tokens - rule.reserved - n_in
        slots = f" + {rule.reserved} slots the server reserves" if rule.reserved else ""
        if n_in > rule.max_prompt:
            second = getattr(rule, "prompt_source", None)
            if second and n_in < rule.tokens - rule.reserved:     # only the engine's second check refuses it
                raise BadInput(f"line {q.line}: the prompt is {n_in} tokens, refused by {second}; expected at most "
                               f"{rule.max_prompt} prompt tokens", path=path, field="prompt")
            longer = n_in > rule.tokens
            what = (f"longer than the server's context of {rule.tokens} tokens" if longer
                    else f"leaving no room for one generated token in the server's context of {rule.tokens} tokens")
            who = rule.source if longer else (getattr(rule, "no_room_source", None) or rule.source)
            raise BadInput(f"line {q.line}: the prompt is {n_in} tokens{slots}, {what} ({who} refuses it); "
                           f"expected at most {rule.max_prompt} prompt tokens", path=path, field="prompt")
        if want <= room:
            continue
        if not rule.clamps:
            raise BadInput(f"line {q.line}: {n_in} prompt tokens + max_new_tokens {want}{slots} = "
                           f"{n_in + want + rule.reserved} tokens, past the server's context of {rule.tokens} tokens "
                           f"({rule.source} refuses the request); expected max_new_tokens <= {room}",
                           path=path, field="max_new_tokens")
        least = int(q.sampling.get("min_new_tokens") or 0)
        if least > room:     # the engine would cut max tokens below min tokens and refuse the request
            raise BadInput(f"line {q.line}: max_new_tokens {want} would be cut to {room} ({n_in} prompt tokens{slots}, "
                           f"context {rule.tokens} tokens, {rule.source}), below min_new_tokens {least}, which the "
                           f"server refuses ({MIN_TOKENS_RULE}); expected min_new_tokens <= {room}",
                           path=path, field="min_new_tokens")
        q.sampling["max_new_tokens"] = room
        cut += 1
        if cut <= 5:
            notes.append(f"--requests line {q.line}: max_new_tokens {want} cut to {room} ({n_in} prompt tokens{slots}, "
                         f"context {rule.tokens} tokens), as the server does ({rule.source})")
    if cut > 5:
        notes.append(f"--requests: {cut - 5} more requests' max_new_tokens cut to fit the context")
    return notes


def generation_defaults(target_dir: Optional[str | Path]) -> dict:
    """The target's ``generation_config.json`` sampling defaults (``temperature``, ``top_p``, ``top_k``; {} when
    none is readable), which SGLang's chat endpoint lays under a chat body's missing ones."""
    if target_dir is None:
        return {}
    from ..formats.configs import read_config_json  # lazy: only with --requests
    try:          # the one reader of model config files (bounded; a FIFO or /dev/zero is never opened for a read)
        doc = read_config_json(Path(target_dir) / "generation_config.json", "generation config")
    except BadInput:
        return {}
    return {k: doc[k] for k in ("temperature", "top_p", "top_k") if k in doc} if isinstance(doc, dict) else {}


def training_is_chat(tokenizer: Any, samples: Sequence[Mapping[str, Any]]) -> Optional[bool]:
    """Whether the training data was chat-formatted with ``tokenizer``'s template: the template's generation prompt
    (the tokens ``add_generation_prompt=True`` adds, e.g. ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``)
    ends the prompt part (before the first loss-masked token) of most samples, as SpecForge's chat-template
    preprocessing leaves it. None when the tokenizer has no template or no sample has a loss mask.

    ``samples``: mappings with ``input_ids`` and ``loss_mask`` (1-D int sequences), or
    :class:`helpers.formats.dumps.Sample` (``input_ids``, ``meta["loss_mask"]``) as
    :class:`helpers.formats.training_data.TrainingData` yields them."""
    if not has_chat_template(tokenizer):
        return None
    msgs = [{"role": "user", "content": "x"}]
    with_gen = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    suffix = with_gen[len(without):] if with_gen.startswith(without) else ""
    if not suffix.strip():
        return None
    gen_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
    hits = seen = 0
    for s in samples:
        if isinstance(s, Mapping):
            ids, mask = s.get("input_ids"), s.get("loss_mask")
        else:
            ids, mask = getattr(s, "input_ids", None), (getattr(s, "meta", None) or {}).get("loss_mask")
        if mask is None or ids is None:
            continue
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        nz = np.flatnonzero(np.asarray(mask).reshape(-1))
        if not len(nz):
            continue
        seen += 1
        head = ids[:int(nz[0])]
        hits += bool(gen_ids) and head[-len(gen_ids):] == gen_ids
    if not seen:
        return None
    return hits * 2 > seen


def training_like_prompts(n: int, *, tokenizer: Any = None, chat: bool = False) -> list[Prompt]:
    """The bundled prompts (``helpers/data/prompts.jsonl``), the first ``n`` (cycling), rendered as a one-turn chat
    with ``tokenizer``'s template when ``chat`` (the training data was chat-formatted, :func:`training_is_chat`),
    else as they are (``kind`` ``training-like``)."""
    return [Prompt(id=p.id, input_ids=render_chat(tokenizer, [{"role": "user", "content": p.text}]),
                   kind="training-like") if chat else Prompt(id=p.id, text=p.text, kind="training-like")
            for p in load_prompts(None, n=n)]


def describe(reqs: Sequence[WorkloadRequest], per_request: Optional[pd.DataFrame] = None) -> dict:
    """What a set of requests looks like: ``{"n", "kinds" {kind: count}, "chat_template" (share rendered with a
    template), "temperature" {median, min, max}, "max_new_tokens" {median, ...}, "prompt_tokens" {median, ...}
    (from the server's counts in ``per_request`` when given), "completion_tokens" {median, ...}, "top_p", "top_k"
    (medians, None when none given), "non_ascii" (share of text prompts with non-ASCII letters: another language or
    script)}``."""
    def num(x):
        return not isinstance(x, bool) and isinstance(x, (int, float, np.integer, np.floating)) \
            and bool(np.isfinite(float(x)))

    def stats(xs):
        v = np.asarray([float(x) for x in xs if num(x)], float)
        return None if not len(v) else {"median": float(np.median(v)), "min": float(v.min()),
                                        "max": float(v.max())}
    texts = [r.content for r in reqs if r.content]
    out = {"n": len(reqs), "kinds": {k: sum(r.kind == k for r in reqs) for k in KINDS if any(r.kind == k
                                                                                            for r in reqs)},
           "chat_template": float(np.mean([r.chat_template for r in reqs])) if reqs else None,
           "temperature": stats([r.sampling.get("temperature") for r in reqs]),
           "max_new_tokens": stats([r.sampling.get("max_new_tokens") for r in reqs]),
           "top_p": stats([r.sampling.get("top_p") for r in reqs]),
           "top_k": stats([k for k in (r.sampling.get("top_k") for r in reqs) if num(k) and k > 0]),
           "non_ascii": float(np.mean([any(ord(c) > 127 and c.isalpha() for c in t) for t in texts]))
           if texts else None}
    if per_request is not None and len(per_request):
        ok = per_request[per_request["error"].isna()]
        out["prompt_tokens"] = stats(ok["prompt_tokens"])
        out["completion_tokens"] = stats(ok["completion_tokens"])
    return out


def differences(user: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """The observed differences between two :func:`describe` results (user's requests, training-like prompts), in
    words: chat template applied or not, temperature, prompt length, max tokens, top_p / top_k, non-ASCII text.
    Observed, not proven causes."""
    out = []
    ut, rt = user.get("chat_template"), ref.get("chat_template")
    if ut is not None and rt is not None and abs(ut - rt) >= 0.5:
        out.append(f"chat template applied to {ut:.0%} of the requests vs {rt:.0%} of the training-like prompts")

    def med(d, k):
        return (d.get(k) or {}).get("median")
    for key, name, rel in (("temperature", "temperature", None), ("prompt_tokens", "prompt length (tokens)", 1.5),
                           ("max_new_tokens", "max tokens", 1.5), ("completion_tokens", "completion length (tokens)",
                                                                    1.5), ("top_p", "top_p", None)):
        a, b = med(user, key), med(ref, key)
        if a is None or b is None:
            continue
        differ = (abs(a - b) > 1e-9) if rel is None else (max(a, b) >= rel * max(min(a, b), 1e-9))
        if differ:
            out.append(f"{name} median {a:g} vs {b:g}")
    if (user.get("top_k") or {}).get("median") is not None and (ref.get("top_k") or {}).get("median") is None:
        out.append(f"top_k median {user['top_k']['median']:g} vs none")
    ua, ra = user.get("non_ascii"), ref.get("non_ascii")
    if ua is not None and ra is not None and ua - ra >= 0.25:
        out.append(f"non-ASCII letters (another language or script) in {ua:.0%} of the text prompts vs {ra:.0%}")
    return out


def unpaired_loss(ref: pd.DataFrame, user: pd.DataFrame, *, n_boot: int = 2000, level: float = 0.95,
                  seed: int = 0) -> dict:
    """The accept-length loss of the user's requests against the training-like prompts, with a CI: ``ref`` and
    ``user`` are :data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS` frames (rows with an error or no spec
    fields left out). Accept length of a set = Σ completion_tokens / Σ verify_ct (tokens per verify step, bonus
    included). The two sets hold different prompts, so nothing pairs: the CI is the percentile interval of the
    difference of two **independent** bootstraps (each set's requests resampled on their own, the ratio recomputed
    each time), ``delta = AL(ref) - AL(user)`` (positive = the user's requests accept less).

    Returns ``{"ref_accept_length", "user_accept_length", "delta", "ci": [lo, hi], "n_ref", "n_user",
    "interval"}``; NaNs when a set has no spec row."""
    def arr(df):
        ok = df[df["error"].isna() & df["has_spec"].astype(bool) & (df["verify_ct"].fillna(0) > 0)]
        return ok["completion_tokens"].to_numpy(float), ok["verify_ct"].to_numpy(float)
    (rc, rv), (uc, uv) = arr(ref), arr(user)
    out = {"n_ref": int(len(rc)), "n_user": int(len(uc)), "interval": (
        f"percentile {level:.0%} CI of the difference of two independent bootstraps (unpaired: different prompts), "
        f"{n_boot} resamples each")}
    if not len(rc) or not len(uc):
        nan = float("nan")
        return {**out, "ref_accept_length": nan, "user_accept_length": nan, "delta": nan, "ci": [nan, nan]}
    delta, lo, hi = bootstrap_ratio_diff_ci(rc, rv, uc, uv, n_boot=n_boot, level=level, seed=seed)
    return {**out, "ref_accept_length": float(rc.sum() / rv.sum()), "user_accept_length": float(uc.sum() / uv.sum()),
            "delta": delta, "ci": [lo, hi]}
