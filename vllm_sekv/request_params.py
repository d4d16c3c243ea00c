"""A request's own sekv settings, as clients send them, checked.

Clients name a session and may ask for their own view budget, turn SeKV
coarse attention off, or choose how many selected blocks a view recomputes
(`recompute_blocks`, `recompute_layout`), how many probes select them
(`probe_hops`, `probe_hop_gain`) and how many neighbours each brings (`view_context_blocks`)
or whether its passage (`view_passage_blocks`), at most how many blocks
a view selects (`view_select_blocks`), whether they complete the lines
their boundaries cut (`view_cut_lines`: true or false, where the config key
says on or off), whether look-alikes stay (`view_lookalikes`: keep or
drop) and how many passages text retrieval adds (`view_question_passages`)
for one request (the config keys of
the same names), in `kv_transfer_params` (or `vllm_xargs`, vLLM's
`extra_args`), and on vLLM 0.32 in its own `session_id` field:

    {"kv_transfer_params": {"session_id": "agent-7", "view_tokens": 4096, "coarse": false}}
    {"kv_transfer_params": {"session_id": "agent-7", "recompute_blocks": 64}}

`parse` turns them into `RequestParams` or raises `RequestParamError` (a
ValueError) that names the field and what it accepts; vLLM's request
validation turns that into an HTTP 400 before the request reaches the engine
(`compat.install_request_validation`). Unknown `kv_transfer_params` keys are
refused; other `vllm_xargs` keys belong to other plugins and are left alone.
`of_request` reads them off a vLLM request. No vLLM imports.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_sekv.config import (LOOKALIKES, MAX_PROBE_HOPS, MAX_QUESTION_PASSAGES, MAX_VIEW_PASSAGE_BLOCKS,
                              RECOMPUTE_LAYOUTS, SekvConfig)

KEYS = ("session_id", "view_tokens", "coarse", "recompute_blocks", "recompute_layout", "probe_hops",
        "probe_hop_gain", "view_context_blocks", "view_passage_blocks", "view_select_blocks", "view_cut_lines",
        "view_lookalikes", "view_question_passages")
MAX_SESSION_ID_CHARS = 256
MAX_VIEW_CONTEXT_BLOCKS = 16

logger = logging.getLogger("vllm_sekv")


class RequestParamError(ValueError):
    """A client's sekv parameter is invalid (the message names the field)."""


@dataclass(frozen=True)
class ViewLimits:
    """The per-request `view_tokens` a server accepts: from `least` (sink +
    recent + two blocks: a view with room for history) to `most` (its own
    view budget)."""

    least: int
    most: int


def view_limits(config: SekvConfig, window_tokens: int) -> ViewLimits:
    """The per-request view budgets a server with `config` accepts."""
    view = min(config.view_tokens or window_tokens, window_tokens)
    return ViewLimits(config.sink_tokens + config.recent_tokens + 2 * config.block_tokens, view)


def check(config: SekvConfig, window_tokens: int, kv_transfer_params: Any, extra_args: Any, session_id: Any) -> None:
    """Raise RequestParamError if a request's sekv parameters are invalid for this server."""
    params = parse(kv_transfer_params, extra_args, session_id, view_limits(config, window_tokens))
    if params.recompute_blocks and config.coarse == "on" and params.coarse is not False:
        raise RequestParamError("recompute_blocks: this server adds coarse summaries to its views, which "
                                "recomputed blocks cannot share; send coarse: false with it")


@dataclass(frozen=True)
class RequestParams:
    session_id: str | None = None
    view_tokens: int | None = None  # the request's own view budget
    coarse: bool | None = None  # None: the server's setting
    recompute_blocks: int | None = None  # None: the server's setting
    recompute_layout: str | None = None  # None: the server's setting
    probe_hops: int | None = None  # None: the server's setting
    view_context_blocks: int | None = None  # None: the server's setting
    view_passage_blocks: int | None = None  # None: the server's setting
    view_select_blocks: int | None = None  # None: the server's setting; 0: no limit
    view_cut_lines: bool | None = None  # None: the server's setting
    probe_hop_gain: float | None = None  # None: the server's setting
    view_lookalikes: str | None = None  # None: the server's setting
    view_question_passages: int | None = None  # None: the server's setting


def parse(kv_transfer_params: Mapping[str, Any] | None, extra_args: Mapping[str, Any] | None = None,
          session_id: Any = None, limits: ViewLimits | None = None) -> RequestParams:
    """A request's sekv parameters. `session_id`: vLLM's own field, which
    takes precedence over the other two places. Raises RequestParamError."""
    params = kv_transfer_params or {}
    if not isinstance(params, Mapping):
        raise RequestParamError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
    unknown = sorted(k for k in params if k not in KEYS)
    if unknown:
        raise RequestParamError(f"kv_transfer_params: unknown key(s) {', '.join(map(repr, unknown))}; "
                                f"sekv accepts {', '.join(KEYS)}")
    extra = extra_args or {}

    def given(key: str) -> tuple[str, Any]:
        if key in params:
            return f"kv_transfer_params.{key}", params[key]
        return f"vllm_xargs.{key}", extra.get(key)

    if session_id is not None:
        sid_field, sid = "session_id", session_id
    else:
        sid_field, sid = given("session_id")
    if sid is not None:
        if not isinstance(sid, str) or not sid:
            raise RequestParamError(f"{sid_field}: expected a non-empty string, got {sid!r:.80}")
        if len(sid) > MAX_SESSION_ID_CHARS:
            raise RequestParamError(f"{sid_field}: at most {MAX_SESSION_ID_CHARS} characters, got {len(sid)}")
    view_field, view = given("view_tokens")
    if view is not None:
        if isinstance(view, bool) or not isinstance(view, int):
            raise RequestParamError(f"{view_field}: expected an integer, got {view!r:.80}")
        if limits is not None and not limits.least <= view <= limits.most:
            raise RequestParamError(f"{view_field}: expected {limits.least} to {limits.most} tokens "
                                    f"(the server's view budget), got {view}")
        if view <= 0:
            raise RequestParamError(f"{view_field}: expected a positive integer, got {view}")
    coarse_field, coarse = given("coarse")
    if coarse is not None and not isinstance(coarse, bool):
        raise RequestParamError(f"{coarse_field}: expected true or false, got {coarse!r:.80}")
    recompute_field, recompute = given("recompute_blocks")
    if recompute is not None and (isinstance(recompute, bool) or not isinstance(recompute, int) or recompute < 0):
        raise RequestParamError(f"{recompute_field}: expected a non-negative integer, got {recompute!r:.80}")
    select_field, select = given("view_select_blocks")
    if select is not None and (isinstance(select, bool) or not isinstance(select, int) or select < 0):
        raise RequestParamError(f"{select_field}: expected a non-negative integer (0: no limit), got {select!r:.80}")
    lines_field, lines = given("view_cut_lines")
    if lines is not None and not isinstance(lines, bool):
        raise RequestParamError(f"{lines_field}: expected true or false, got {lines!r:.80}")
    lookalikes_field, lookalikes = given("view_lookalikes")
    if lookalikes is not None and lookalikes not in LOOKALIKES:
        raise RequestParamError(f"{lookalikes_field}: expected one of {', '.join(LOOKALIKES)}, got {lookalikes!r:.80}")
    layout_field, layout = given("recompute_layout")
    if layout is not None and layout not in RECOMPUTE_LAYOUTS:
        raise RequestParamError(f"{layout_field}: expected one of {', '.join(RECOMPUTE_LAYOUTS)}, got {layout!r:.80}")
    def ranged(key: str, least: int, most: int) -> int | None:
        field, value = given(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not least <= value <= most):
            raise RequestParamError(f"{field}: expected an integer from {least} to {most}, got {value!r:.80}")
        return value

    hops = ranged("probe_hops", 1, MAX_PROBE_HOPS)
    gain_field, gain = given("probe_hop_gain")
    if gain is not None and (isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 <= gain <= 1):
        raise RequestParamError(f"{gain_field}: expected a number from 0 to 1, got {gain!r:.80}")
    context = ranged("view_context_blocks", 0, MAX_VIEW_CONTEXT_BLOCKS)
    passage = ranged("view_passage_blocks", 0, MAX_VIEW_PASSAGE_BLOCKS)
    if context and passage:
        raise RequestParamError(f"{given('view_passage_blocks')[0]}: a selected block brings either its "
                                f"passage or view_context_blocks neighbours; send one of them")
    return RequestParams(sid, view, coarse, recompute, layout, hops, context, passage, select, lines,
                         None if gain is None else float(gain), lookalikes,
                         ranged("view_question_passages", 0, MAX_QUESTION_PASSAGES))


def of_request(request: Any) -> "RequestParams":
    """A request's own sekv parameters (`request_params.parse`): vLLM's
    `session_id` field (0.32+), `kv_transfer_params` and `vllm_xargs`
    (`sampling_params.extra_args`). Invalid ones were refused at the API
    (`compat.install_request_validation`); one that reaches the engine core
    anyway (it cannot refuse a request) is logged and the server's settings apply."""
    sampling = getattr(request, "sampling_params", None)
    extra = getattr(sampling, "extra_args", None) or {}
    try:
        return parse(getattr(request, "kv_transfer_params", None), extra, getattr(request, "session_id", None))
    except RequestParamError as e:
        logger.warning("sekv: request %s: %s; the server's settings apply", getattr(request, "request_id", "?"), e)
        return RequestParams()
