"""kvpush's connector backend for Ray Serve LLM (kvpush.ray.backend), the request shaping on
its own: both legs of a request share a transfer id, decode's params name the prefill replica
Ray picked, and a peer that published no kvpush address is refused with why."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray  # Ray imported in the tests: `make test` collects without it


def backend(role: str):
    from ray.serve.llm import LLMConfig
    from ray.serve.llm.openai_api_models import CompletionRequest

    from kvpush.ray.app import RayStack, llm_config
    from kvpush.ray.backend import KVPushBackend

    config = LLMConfig.model_validate(llm_config(RayStack("/models/tiny"), role))
    request = CompletionRequest(
        model="tiny", prompt="hello", max_tokens=8, stream=True, request_id="r-1"
    )
    return KVPushBackend(config), request


PEER = {"engine_id": "prefill-10.0.0.1-24000", "kv_host": "10.0.0.1",
        "side_channel_port": 24000, "tp_size": 1, "pp_size": 1}  # fmt: skip


def test_both_legs_share_one_transfer_id_and_decode_names_the_prefill_replica():
    shaper, request = backend("decode")
    assert shaper.requires_peer_binding and shaper.concurrent_handoff
    prefill = shaper.prepare_prefill_request(request=request, peer=PEER)
    decode = shaper.prepare_decode_request(request=request, peer=PEER, prefill_response=None)
    tid = prefill.kv_transfer_params["transfer_id"]
    assert prefill.kv_transfer_params == {"do_remote_decode": True, "transfer_id": tid}
    assert prefill.max_tokens == 1 and not prefill.stream  # prefill's leg: one token
    assert decode.kv_transfer_params == {
        "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": PEER["engine_id"],
        "remote_host": "10.0.0.1", "remote_port": 24000, "tp_size": 1, "pp_size": 1,
    }  # fmt: skip
    assert decode.max_tokens == 8 and decode.stream and request.kv_transfer_params is None
    other = request.model_copy(update={"request_id": "r-2"})
    assert (
        shaper.prepare_prefill_request(request=other, peer=PEER).kv_transfer_params["transfer_id"]
        != tid
    )  # one id per request


def test_a_prefill_replica_that_published_no_kvpush_address_is_refused_with_why():
    shaper, request = backend("decode")
    with pytest.raises(ValueError, match="published no kvpush address"):
        shaper.prepare_decode_request(request=request, peer={}, prefill_response=None)
