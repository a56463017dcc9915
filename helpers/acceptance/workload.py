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
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True, return_dict=False)
    return token_ids(list(ids))


def _sampling(kind: str, body: Mapping[str, Any], default_max_new_tokens: int,
              gen_defaults: Mapping[str, Any]) -> tuple[dict, list[str]]:
    """SGLang-named sampling params of one body and the keys left out (module docstring's defaults)."""
    sp: dict[str, Any] = {}
    ignored: list[str] = []
    if kind == "generate":
        given = body.get("sampling_params") or {}
        if not isinstance(given, Mapping):
            raise ValueError(f"sampling_params must be an object, got {type(given).__name__}")
        for k, v in given.items():
            if k in GENERATE_SAMPLING:
                sp[k] = v
            else:
                ignored.append(f"sampling_params.{k}")
        skip = {"text", "input_ids", "sampling_params"} | TRANSPORT_KEYS
        ignored += [k for k in body if k not in skip]
    else:
        content = {"messages"} if kind == "chat" else {"prompt"}
        for k, v in body.items():
            if k in OPENAI_SAMPLING:
                if v is not None:
                    sp.setdefault(OPENAI_SAMPLING[k], v)
            elif k not in content and k not in TRANSPORT_KEYS:
                ignored.append(k)
        n = body.get("n")
        if n not in (None, 1):
            ignored.append(f"n={n} (one answer is measured)")
    if kind == "chat":
        for k in ("temperature", "top_p", "top_k"):
            if k not in sp and gen_defaults.get(k) is not None:
                sp[k] = gen_defaults[k]
    sp.setdefault("temperature", 1.0)
    if sp.get("max_new_tokens") is None:
        sp["max_new_tokens"] = DEFAULT_MAX[kind] or int(default_max_new_tokens)
    mnt, t = sp["max_new_tokens"], sp["temperature"]
    if isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1:
        raise ValueError(f"max tokens is {mnt!r}; expected an integer >= 1")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
        raise ValueError(f"temperature is {t!r}; expected a number >= 0")
    return sp, ignored


def kind_of(body: Mapping[str, Any]) -> str:
    """``chat`` | ``completions`` | ``generate`` from a body's keys (module docstring). Raises ValueError."""
    if "messages" in body:
        return "chat"
    if "prompt" in body:
        return "completions"
    if "text" in body or "input_ids" in body:
        return "generate"
    raise ValueError(f"has none of messages / prompt / text / input_ids (keys: {', '.join(list(body)[:8])})")


#: ``tokenizer=CHECK_ONLY``: check a requests file before any work, chat bodies not rendered (their ``input_ids`` a
#: placeholder: never sent)
CHECK_ONLY = object()


def parse_request(body: Any, line: int, *, tokenizer: Any = None, default_max_new_tokens: int = 128,
                  gen_defaults: Optional[Mapping[str, Any]] = None) -> WorkloadRequest:
    """One body (a parsed JSON line) as a :class:`WorkloadRequest` (module docstring).

    Raises: ValueError / TypeError saying what is wrong with it (the caller adds the file and line)."""
    if not isinstance(body, Mapping):
        raise ValueError(f"is a JSON {type(body).__name__}, not an object")
    kind = kind_of(body)
    sp, ignored = _sampling(kind, body, default_max_new_tokens, gen_defaults or {})
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
        if kind == "completions" and isinstance(x, list):
            x, ids = None, x
        if x is not None:
            if not isinstance(x, str) or not x:
                raise ValueError(f"{'prompt' if kind == 'completions' else 'text'} must be a non-empty string or "
                                 f"a list of token ids, got {type(x).__name__}")
            prompt = Prompt(id=pid, text=x, kind=kind)
            content = x
        else:
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                raise ValueError("input_ids is a batch (a list of lists); expected one prompt per line")
            prompt = Prompt(id=pid, input_ids=token_ids(ids), kind=kind)
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
                  gen_defaults: Optional[Mapping[str, Any]] = None) -> list[WorkloadRequest]:
    """Every line of a requests file (module docstring), blank lines skipped.

    Args:
        path: the JSONL file. tokenizer: the target's tokenizer (:func:`load_tokenizer`), needed for chat bodies,
            or a function of no argument returning it (called at the first chat body: no transformers import
            otherwise).
        default_max_new_tokens: max tokens of a chat body that gives none.
        gen_defaults: the target's ``generation_config.json`` (chat sampling defaults).

    Raises:
        BadInput: a missing, unreadable or empty file, or a bad line: one line naming the file, the line number and
        what was expected."""
    path = Path(path)
    if path.is_dir():
        raise BadInput("is a folder; expected a JSONL requests file", path=path)
    if not path.exists():
        raise BadInput("requests file not found", path=path)
    text = read_file_text(path, "requests file", expected="JSON lines")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
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
                                     gen_defaults=gen_defaults))
        except (TypeError, ValueError, OverflowError) as exc:
            raise BadInput(f"line {n}: {exc}; expected {_expected()}", path=path) from None
        if len(out) > MAX_PROMPTS:
            raise BadInput(f"more than {MAX_PROMPTS} requests", path=path)
    if not out:
        raise BadInput(f"the requests file is empty; expected {_expected()}", path=path)
    return out


def generation_defaults(target_dir: Optional[str | Path]) -> dict:
    """The target's ``generation_config.json`` sampling defaults (``temperature``, ``top_p``, ``top_k``; {} when
    none is readable), which SGLang's chat endpoint lays under a chat body's missing ones."""
    if target_dir is None:
        return {}
    p = Path(target_dir) / "generation_config.json"
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    return {k: doc[k] for k in ("temperature", "top_p", "top_k") if isinstance(doc, dict) and k in doc} \
        if isinstance(doc, dict) else {}


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
    def stats(xs):
        v = np.asarray([float(x) for x in xs if x is not None and np.isfinite(float(x))], float)
        return None if not len(v) else {"median": float(np.median(v)), "min": float(v.min()),
                                        "max": float(v.max())}
    texts = [r.content for r in reqs if r.content]
    out = {"n": len(reqs), "kinds": {k: sum(r.kind == k for r in reqs) for k in KINDS if any(r.kind == k
                                                                                            for r in reqs)},
           "chat_template": float(np.mean([r.chat_template for r in reqs])) if reqs else None,
           "temperature": stats([r.sampling.get("temperature") for r in reqs]),
           "max_new_tokens": stats([r.sampling.get("max_new_tokens") for r in reqs]),
           "top_p": stats([r.sampling.get("top_p") for r in reqs]),
           "top_k": stats([r.sampling.get("top_k") for r in reqs if (r.sampling.get("top_k") or -1) > 0]),
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
    rng = np.random.default_rng(seed)
    ri = rng.integers(0, len(rc), size=(n_boot, len(rc)))
    ui = rng.integers(0, len(uc), size=(n_boot, len(uc)))
    d = rc[ri].sum(1) / rv[ri].sum(1) - uc[ui].sum(1) / uv[ui].sum(1)
    a = (1 - level) / 2
    ral, ual = float(rc.sum() / rv.sum()), float(uc.sum() / uv.sum())
    return {**out, "ref_accept_length": ral, "user_accept_length": ual, "delta": ral - ual,
            "ci": [float(np.quantile(d, a)), float(np.quantile(d, 1 - a))]}
