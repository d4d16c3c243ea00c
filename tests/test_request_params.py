"""A request's own sekv parameters: what is accepted, and the errors that
name the field (the API answers them with an HTTP 400; see
tests/engine/test_http_serve.py for the server side)."""
import pytest

from vllm_sekv.config import SekvConfig
from vllm_sekv.request_params import (
    MAX_SESSION_ID_CHARS, RequestParamError, RequestParams, ViewLimits, check, parse, view_limits,
)

LIMITS = ViewLimits(least=384, most=8192)


def test_valid_parameters_from_each_place():
    assert parse(None) == RequestParams()
    assert parse({"session_id": "a", "view_tokens": 4096, "coarse": False}, limits=LIMITS) == \
        RequestParams("a", 4096, False)
    assert parse({}, {"session_id": "x", "view_tokens": 1024, "other_plugin": 1}) == RequestParams("x", 1024)
    # vLLM's own session_id field comes first
    assert parse({"session_id": "params"}, {}, "field").session_id == "field"
    assert parse({"recompute_blocks": 64, "recompute_layout": "in_order"}) == \
        RequestParams(recompute_blocks=64, recompute_layout="in_order")
    assert parse({}, {"probe_hops": 2}) == RequestParams(probe_hops=2)
    assert parse({"probe_hop_gain": 1}) == RequestParams(probe_hop_gain=1.0)
    assert parse({"view_context_blocks": 0}) == RequestParams(view_context_blocks=0)
    assert parse({"view_passage_blocks": 8}) == RequestParams(view_passage_blocks=8)


@pytest.mark.parametrize("params, extra, session_id, field", [
    ({"view_tokens": "abc"}, None, None, "kv_transfer_params.view_tokens"),
    ({"view_tokens": True}, None, None, "kv_transfer_params.view_tokens"),
    ({"view_tokens": 8}, None, None, "kv_transfer_params.view_tokens"),  # tiny: no room for history
    ({"view_tokens": 100000}, None, None, "kv_transfer_params.view_tokens"),  # beyond the server's budget
    ({}, {"view_tokens": -3}, None, "vllm_xargs.view_tokens"),
    ({"coarse": "yes"}, None, None, "kv_transfer_params.coarse"),
    ({"recompute_blocks": -1}, None, None, "kv_transfer_params.recompute_blocks"),
    ({"recompute_blocks": "all"}, None, None, "kv_transfer_params.recompute_blocks"),
    ({}, {"recompute_layout": "sorted"}, None, "vllm_xargs.recompute_layout"),
    ({"probe_hops": 0}, None, None, "kv_transfer_params.probe_hops"),
    ({"probe_hops": 4}, None, None, "kv_transfer_params.probe_hops"),
    ({"probe_hop_gain": 1.5}, None, None, "kv_transfer_params.probe_hop_gain"),
    ({}, {"probe_hop_gain": "0.5"}, None, "vllm_xargs.probe_hop_gain"),
    ({}, {"probe_hops": "2"}, None, "vllm_xargs.probe_hops"),
    ({"view_context_blocks": -1}, None, None, "kv_transfer_params.view_context_blocks"),
    ({"view_context_blocks": 10**9}, None, None, "kv_transfer_params.view_context_blocks"),
    ({"view_passage_blocks": -1}, None, None, "kv_transfer_params.view_passage_blocks"),
    ({}, {"view_passage_blocks": 65}, None, "vllm_xargs.view_passage_blocks"),
    ({"view_passage_blocks": 8, "view_context_blocks": 1}, None, None, "kv_transfer_params.view_passage_blocks"),
    ({"session_id": ""}, None, None, "kv_transfer_params.session_id"),
    ({"session_id": 7}, None, None, "kv_transfer_params.session_id"),
    ({}, None, "s" * (MAX_SESSION_ID_CHARS + 1), "session_id"),
    ({"sesion_id": "typo"}, None, None, "kv_transfer_params: unknown key"),
    ([1, 2], None, None, "kv_transfer_params: expected an object"),
])
def test_invalid_parameters_name_their_field(params, extra, session_id, field):
    with pytest.raises(RequestParamError) as e:
        parse(params, extra, session_id, LIMITS)
    assert str(e.value).startswith(field)


def test_the_servers_limits_come_from_its_config_and_the_models_window():
    config = SekvConfig(view_tokens=4096)
    assert view_limits(config, 32768) == ViewLimits(64 + 256 + 64, 4096)
    assert view_limits(SekvConfig(), 8192).most == 8192  # view_tokens 0: the window
    with pytest.raises(RequestParamError, match="384 to 4096"):
        check(config, 32768, {"view_tokens": 8192}, None, None)


def test_recompute_beside_a_servers_coarse_summaries_is_refused_unless_the_request_opts_out():
    config = SekvConfig(surprisal="on", coarse="on")
    with pytest.raises(RequestParamError, match="^recompute_blocks: .*coarse: false"):
        check(config, 8192, {"recompute_blocks": 8}, None, None)
    check(config, 8192, {"recompute_blocks": 8, "coarse": False}, None, None)
    check(SekvConfig(), 8192, {"recompute_blocks": 8}, None, None)


def test_a_requests_selection_limit():
    assert parse({"view_select_blocks": 32}) == RequestParams(view_select_blocks=32)
    assert parse({}, {"view_select_blocks": 0}).view_select_blocks == 0  # no limit
    for bad in (-1, "32", True, 1.5):
        with pytest.raises(RequestParamError, match="^kv_transfer_params.view_select_blocks: expected a non-neg"):
            parse({"view_select_blocks": bad})


def test_a_requests_cut_lines():
    assert parse({"view_cut_lines": True}) == RequestParams(view_cut_lines=True)
    assert parse({}, {"view_cut_lines": False}).view_cut_lines is False
    for bad in ("on", 1, 0.0):
        with pytest.raises(RequestParamError, match="^kv_transfer_params.view_cut_lines: expected true or false"):
            parse({"view_cut_lines": bad})


def test_a_requests_question_passages():
    assert parse({"view_question_passages": 8}) == RequestParams(view_question_passages=8)
    assert parse({}, {"view_question_passages": 0}).view_question_passages == 0  # none
    for bad in (-1, 65, "8", True, 1.5):
        with pytest.raises(RequestParamError, match="^kv_transfer_params.view_question_passages: expected an integer "
                                                    "from 0 to 64"):
            parse({"view_question_passages": bad})
