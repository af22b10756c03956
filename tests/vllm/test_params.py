"""kv_transfer_params parsing and the pairing key (no engine needed)."""

from __future__ import annotations

import pytest

from kvpush.transfer.wire import TransferKey
from kvpush.vllm import validate
from kvpush.vllm.params import ParamsError, external_request_id, parse
from kvpush.vllm.validate import EngineFacts, check_body

DECODE = {
    "do_remote_prefill": True,
    "remote_host": "h",
    "remote_port": 5600,
    "tp_size": 2,
    "remote_engine_id": "p0",
    "transfer_id": "t1",
}


def test_plain_requests_are_not_disaggregated():
    assert parse(None) is None
    assert parse({}) is None
    assert parse({"do_remote_prefill": False}) is None


def test_decode_leg_carries_the_prefill_address():
    p = parse(DECODE)
    assert p.leg == "decode" and p.transfer_id == "t1"
    assert (p.prefill.host, p.prefill.base_port, p.prefill.tp_size) == ("h", 5600, 2)
    assert p.prefill.engine_id == "p0"


def test_key_is_the_transfer_id_when_given():
    assert parse(DECODE).key("cmpl-x-0-0123abcd") == TransferKey("t1")


def test_without_transfer_id_the_key_is_the_router_request_id_exactly():
    p = parse({"do_remote_decode": True})
    assert p.key("cmpl-abc-0-0123abcd") == TransferKey("cmpl-abc-0")
    assert p.key("cmpl-abc-0-0123abcd") != p.key("cmpl-abc-1-0123abcd")
    assert external_request_id("cmpl-abc-0") == "cmpl-abc-0"  # no vLLM suffix: unchanged


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("x", "kv_transfer_params: expected `object`, got `str`"),
        ({"do_remote_prefill": "yes"}, "do_remote_prefill: expected `bool`, got `str`"),
        ({"do_remote_prefill": True, "do_remote_decode": True}, "both true"),
        (
            {"do_remote_decode": True, "transfer_id": ""},
            "transfer_id: expected `str` of length",
        ),
        ({"do_remote_decode": True, "pp_size": 2}, "pp_size=2"),
        (DECODE | {"remote_host": None}, "remote_host is required"),
        (DECODE | {"remote_port": 70000}, "remote_port: expected `int` <= 65535"),
        (DECODE | {"remote_port": True}, "remote_port: expected `int \\| null`, got `bool`"),
        (DECODE | {"tp_size": 0}, "tp_size: expected `int` >= 1"),
    ],
)
def test_bad_params_name_the_field(params, message):
    with pytest.raises(ParamsError, match=message):
        parse(params)


def test_middleware_check_refuses_lists_and_n_in_push_mode_only():
    assert check_body({"prompt": ["a", "b"]}) is None  # not disaggregated: vLLM's business
    assert "one prompt" in check_body({"prompt": ["a", "b"], "kv_transfer_params": DECODE})
    assert "n=3" in check_body({"prompt": "a", "n": 3, "kv_transfer_params": DECODE})
    assert check_body({"prompt": [1, 2, 3], "kv_transfer_params": DECODE}) is None


def test_a_seeded_random_request_is_refused_only_where_it_would_kill_the_engine():
    crash = EngineFacts(seeded_crash=True)
    seeded = {"prompt": "a", "seed": 5, "temperature": 0.7}
    assert "seed=5" in check_body(seeded, crash)
    assert "temperature 1.0" in check_body({"prompt": "a", "seed": 5}, crash)  # vLLM's default
    greedy_model = EngineFacts(seeded_crash=True, default_temperature=0)
    assert check_body({"prompt": "a", "seed": 5}, greedy_model) is None
    assert check_body(seeded | {"temperature": 0}, crash) is None  # greedy: no generator
    assert check_body({"prompt": "a", "temperature": 0.7}, crash) is None  # no seed of its own
    assert check_body(seeded, EngineFacts(seeded_crash=False)) is None  # a GPU, or no chunking
    assert check_body(seeded) is None  # the engine not known yet


def test_torch_cpu_generators_have_no_offset_in_the_pinned_torch():
    """The fact the refusal rests on; when torch gains it, `EngineFacts` stops refusing."""
    import torch

    assert validate._cpu_generator_has_offset(torch) is False
