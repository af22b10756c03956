"""The connector's scheduler half: decides, per request, what the workers must do.

It runs in vLLM's scheduler, so it never touches the network: it only queues actions that
`build_connector_meta` hands to the workers with the next engine step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.v1.request import RequestStatus

from kvpush.vllm import metadata as m
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.params import ParamsError, parse

log = logging.getLogger(__name__)

_FINISHED_OK = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class PushScheduler:
    def __init__(self, config: ConnectorConfig, vllm_config: Any) -> None:
        self.config = config
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._actions: list[m.Action] = []
        self._sending: set[str] = set()  # prefill: pushes the workers have not finished
        self._loading: dict[str, m.Expect | None] = {}  # decode: waiting for finished_recving
        self._loaded: set[str] = set()  # decode: KV arrived; the request decodes
        self._refused: dict[str, str] = {}  # decode: bad params, failed as a load failure
        self._abandoned: set[str] = set()  # decode: finished while loading; a cancel is out
        self._settling = 0  # workers' aborts and cancels not acted on yet

    # -- decode ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        rid = request.request_id
        if self.config.is_prefill or rid in self._loading or rid in self._loaded:
            return 0, False
        need = request.num_prompt_tokens - num_computed
        try:
            params = parse(request.kv_transfer_params)
            if params is not None and params.leg != "decode":
                raise ParamsError(
                    "this is a decode engine (kv_consumer) but the request is a prefill leg "
                    "(do_remote_decode)"
                )
        except ParamsError as e:
            if rid not in self._refused:
                tid = (request.kv_transfer_params or {}).get("transfer_id") if isinstance(
                    request.kv_transfer_params, dict) else None  # fmt: skip
                log.warning("kvpush: request %s (transfer_id %s) refused: %s", rid, tid, e)
                self._refused[rid] = str(e)
            return need, True
        if params is None:
            return 0, False
        # Even on a full local prefix hit (need == 1) decode loads the last token from
        # prefill: it must continue from the first token prefill sampled, which comes with
        # the WRITE (kvpush.vllm.firsttoken).
        return need, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        rid = request.request_id
        if num_external == 0 or rid in self._loading:
            return
        if rid in self._refused:
            self._actions.append(m.Refuse(rid, self._refused.pop(rid)))
            self._loading[rid] = None
            return
        params = parse(request.kv_transfer_params)
        assert params is not None and params.prefill is not None
        num_local = request.num_prompt_tokens - num_external
        expect = m.Expect(
            rid,
            params.key(rid),
            params.prefill,
            list(blocks.get_block_ids()[0]),
            request.num_prompt_tokens,
            num_local,
        )
        self._actions.append(expect)
        self._loading[rid] = expect

    # -- both -----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> m.PushMetadata:
        meta = m.PushMetadata(self._actions)
        self._actions = []
        return meta

    def update_connector_output(self, output: Any) -> None:
        stats = getattr(output, "kv_connector_stats", None)
        if stats is not None and isinstance(getattr(stats, "data", None), dict):
            self._settling = int(stats.data.get("settling", 0) or 0)
        for rid in output.finished_recving or ():
            expect = self._loading.pop(rid, None)
            if rid in self._abandoned:
                self._abandoned.discard(rid)
            elif expect is not None:
                self._loaded.add(rid)
        for rid in output.finished_sending or ():
            self._sending.discard(rid)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        if self.config.is_prefill:
            return self._prefill_finished(request, block_ids)
        rid = request.request_id
        self._refused.pop(rid, None)
        loaded = rid in self._loaded
        self._loaded.discard(rid)
        if rid in self._loading:
            expect = self._loading[rid]
            if expect is not None:  # aborted while waiting: quarantine until prefill acks
                self._actions.append(m.Cancel(rid, expect.key, expect.prefill))
            self._abandoned.add(rid)
            return False, None  # vLLM holds the blocks until we report finished_recving
        if request.status == RequestStatus.FINISHED_ABORTED and not loaded:
            try:
                params = parse(request.kv_transfer_params)
            except ParamsError:
                params = None
            if params is not None and params.prefill is not None:  # aborted before blocks
                self._actions.append(m.Cancel(None, params.key(rid), params.prefill))
        return False, None

    # -- prefill --------------------------------------------------------------------------
    def _prefill_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        try:
            params = parse(request.kv_transfer_params)
        except ParamsError as e:
            log.warning("kvpush: prefill request %s: %s", rid, e)
            return False, None
        if params is None:
            return False, None
        key = params.key(rid)
        if params.leg != "prefill":
            log.warning(
                "kvpush: request %s (transfer %s) is a decode leg sent to a prefill "
                "engine; nothing is pushed",
                rid,
                key,
            )
            return False, None
        if request.status not in _FINISHED_OK or not block_ids:
            self._actions.append(m.Abort(key, f"prefill request ended {request.status.name}"))
            return False, None
        first = request.output_token_ids[0] if request.output_token_ids else -1
        push = m.Push(rid, key, list(block_ids), request.num_prompt_tokens, time.monotonic(), first)
        self._actions.append(push)
        self._sending.add(rid)
        return True, {
            "do_remote_prefill": True,
            "transfer_id": key.transfer_id,
            "remote_engine_id": self.config.engine_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.config.side_channel_port,
            "tp_size": self._tp_size,
        }

    def has_pending_push_work(self) -> bool:
        return bool(self._actions or self._sending or self._settling)
