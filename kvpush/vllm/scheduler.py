"""The connector's scheduler half: decides, per request, what the workers must do.

It runs in vLLM's scheduler, so it never waits on the network: it queues actions that
`build_connector_meta` hands to the workers with the next engine step. The one message it
sends itself, SOURCE to its own prefill ranks when a request finishes (`early_source`), is a
non-blocking ZMQ send: a head start of one engine step for the push, which the worker's Push
still follows.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vllm.v1.request import RequestStatus

from kvpush.transfer.router import SourceAnnouncer
from kvpush.transfer.wire import Failure, PrefillAddress
from kvpush.vllm import metadata as m
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.params import ParamsError, parse

if TYPE_CHECKING:  # vLLM's types, for the checker only
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_FINISHED_OK = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
STEP_HOOKS = ("build_connector_meta", "update_connector_output")  # hooks without a request
WORKER_HOOKS = ("start_load_kv", "get_finished")  # raised in by the worker (PushWorker)


def _params_or_none(request: Request):
    """The request's params, or None when there are none or they do not parse."""
    try:
        return parse(request.kv_transfer_params)
    except ParamsError:
        return None


class PushScheduler:
    def __init__(self, config: ConnectorConfig, vllm_config: VllmConfig) -> None:
        self.config = config
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._block_size = vllm_config.cache_config.block_size
        self._actions: list[m.Action] = []
        self._sending: set[str] = set()  # prefill: pushes the workers have not finished
        self._loading: dict[str, m.Expect | None] = {}  # decode: waiting for finished_recving
        self._loaded: set[str] = set()  # decode: KV arrived; the request decodes
        self._refused: dict[str, Failure] = {}  # decode: why a request is failed
        # that fails as a load failure: bad params ("refused") or a failed hook ("hook")
        self._abandoned: set[str] = set()  # decode: finished while loading; a cancel is out
        self._settling = 0  # workers' aborts and cancels not acted on yet
        self._step_faults: set[str] = set()  # debug_faults: step hooks to raise in once
        self._announcer: SourceAnnouncer | None = None  # prefill, early_source: made lazily

    # -- decode ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
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
                self._refused[rid] = Failure("refused", str(e))
            return need, True
        if params is None:
            return 0, False
        # Even on a full local prefix hit (need == 1) decode loads the last token from
        # prefill: it must continue from the first token prefill sampled, which comes with
        # the WRITE (kvpush.vllm.firsttoken).
        return need, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external: int
    ) -> None:
        if self.config.is_prefill:
            self._prepare(request, blocks)
            return
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
            self._worker_fault(request),
        )
        self._actions.append(expect)
        self._loading[rid] = expect

    # -- both -----------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput | None) -> m.PushMetadata:
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", 1) == 0
        meta = m.PushMetadata(self._actions, idle)
        self._actions = []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        stats = getattr(output, "kv_connector_stats", None)
        if stats is not None and isinstance(getattr(stats, "data", None), dict):
            self._settling = int(stats.data.get("settling", 0) or 0)
        self.settle_output(output)

    def settle_output(self, output: KVConnectorOutput) -> None:
        """The requests the workers finished: all `update_connector_output` must not miss,
        also when reading the rest of the output failed."""
        for rid in getattr(output, "finished_recving", None) or ():
            expect = self._loading.pop(rid, None)
            if rid in self._abandoned:
                self._abandoned.discard(rid)
            elif expect is not None:
                self._loaded.add(rid)
        for rid in getattr(output, "finished_sending", None) or ():
            self._sending.discard(rid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        if self.config.is_prefill:
            return self._prefill_finished(request, block_ids)
        rid = request.request_id
        self._refused.pop(rid, None)
        loaded = rid in self._loaded
        self._loaded.discard(rid)
        if self._abandon_load(rid):
            return False, None  # vLLM holds the blocks until we report finished_recving
        if request.status == RequestStatus.FINISHED_ABORTED and not loaded:
            params = _params_or_none(request)
            if params is not None and params.prefill is not None:  # aborted before blocks
                self._actions.append(m.Cancel(None, params.key(rid), params.prefill))
        return False, None

    def _abandon_load(self, rid: str) -> bool:
        """Whether `rid` still waits for its load; if so, cancel it (once)."""
        if rid not in self._loading:
            return False
        expect = self._loading[rid]
        if expect is not None and rid not in self._abandoned:  # quarantined until prefill acks
            self._actions.append(m.Cancel(rid, expect.key, expect.prefill))
        self._abandoned.add(rid)
        return True

    # -- when a hook raised (kvpush.vllm.connector) ----------------------------------------
    def match_failed(
        self, request: Request, num_computed: int, error: Exception
    ) -> tuple[int, bool]:
        """`get_num_new_matched_tokens` raised. A request that is no load computes as any
        other. A load fails as a load failure, and prefill is told to free its blocks now:
        computing it here instead would sample a first token of decode's own, while the
        client may hold prefill's already."""
        rid = request.request_id
        params = _params_or_none(request)
        if self.config.is_prefill or params is None or params.leg != "decode":
            return 0, False
        if rid in self._loading or rid in self._loaded:
            return 0, False  # claimed before: that load goes on
        if rid not in self._refused:
            key = params.key(rid)
            log.warning(
                "kvpush: request %s (transfer_id %s) fails: matching it raised %r; prefill is "
                "told to free its blocks",
                rid,
                key.transfer_id,
                error,
            )
            self._refused[rid] = Failure("hook", f"matching failed: {error!r}")
            self._actions.append(m.Cancel(None, key, params.prefill))
        return request.num_prompt_tokens - num_computed, True

    def alloc_failed(self, request: Request, error: Exception) -> None:
        """`update_state_after_alloc` raised after the request was claimed as a load: fail it
        as a load failure (its blocks are freed) instead of waiting for WRITEs that nothing
        asked for, and tell prefill."""
        rid = request.request_id
        if isinstance(self._loading.get(rid), m.Expect):
            return  # registered before it raised: that load goes on
        self._refused.pop(rid, None)
        self._actions.append(m.Refuse(rid, Failure("hook", f"registration failed: {error!r}")))
        self._loading[rid] = None
        params = _params_or_none(request)
        key = params.key(rid) if params is not None and params.leg == "decode" else None
        if key is not None:
            self._actions.append(m.Cancel(None, key, params.prefill))
        log.warning(
            "kvpush: request %s (transfer_id %s) fails: registering it raised %r; prefill is "
            "told to free its blocks",
            rid,
            key.transfer_id if key is not None else "-",
            error,
        )

    def finish_failed(self, request: Request, error: Exception) -> tuple[bool, dict | None]:
        """`request_finished` raised. Prefill: a push already queued keeps its blocks until
        it is written; else decode is told (Abort) and vLLM frees them. Decode: a pending
        load is cancelled, as for any request that ends while loading."""
        rid = request.request_id
        params = _params_or_none(request)
        if self.config.is_prefill:
            if rid in self._sending:
                return True, None
            if params is not None and params.leg == "prefill":
                failure = Failure("hook", f"prefill's request_finished failed: {error!r}")
                self._actions.append(m.Abort(params.key(rid), failure))
            return False, None
        self._refused.pop(rid, None)
        self._loaded.discard(rid)
        self._abandon_load(rid)
        return False, None

    def inject(
        self,
        hook: str,
        request: Request | None = None,
        output: KVConnectorOutput | None = None,
    ) -> None:
        """debug_faults (tests only): raise in `hook` for a request whose kv_transfer_params
        name it as `kvpush_debug_fault`. The two step hooks, which see no request, raise
        once, in the first step after such a request was allocated (decode) or finished
        (prefill); `update_connector_output` in the first that finished a transfer."""
        if not self.config.debug_faults:
            return
        if request is None:
            finished = output is None or output.finished_sending or output.finished_recving
            if hook in self._step_faults and finished:
                self._step_faults.discard(hook)
                raise RuntimeError(f"kvpush debug fault in {hook}")
            return
        params = request.kv_transfer_params
        fault = params.get("kvpush_debug_fault") if isinstance(params, dict) else None
        if fault == hook:
            raise RuntimeError(f"kvpush debug fault in {hook} for {request.request_id}")
        arm_at = "request_finished" if self.config.is_prefill else "update_state_after_alloc"
        if fault in STEP_HOOKS and hook == arm_at:
            self._step_faults.add(fault)

    def _worker_fault(self, request: Request) -> str:
        """debug_faults (tests only): the worker hook named by the request's
        `kvpush_debug_fault`, which the worker then raises in for it; else ""."""
        params = request.kv_transfer_params if self.config.debug_faults else None
        fault = params.get("kvpush_debug_fault") if isinstance(params, dict) else None
        return fault if fault in WORKER_HOOKS else ""

    # -- prefill --------------------------------------------------------------------------
    def _prefill_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
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
            ended = Failure("aborted", f"prefill request ended {request.status.name}")
            self._actions.append(m.Abort(key, ended))
            return False, None
        first = request.output_token_ids[0] if request.output_token_ids else -1
        push = m.Push(
            rid,
            key,
            list(block_ids),
            request.num_prompt_tokens,
            time.monotonic(),
            first,
            self._worker_fault(request),
        )
        self._actions.append(push)
        self._sending.add(rid)
        if self.config.early_source:
            self._announce(push)
        return True, {
            "do_remote_prefill": True,
            "transfer_id": key.transfer_id,
            "remote_engine_id": self.config.engine_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.config.side_channel_port,
            "tp_size": self._tp_size,
        }

    def _prepare(self, request: Request, blocks: KVCacheBlocks) -> None:
        """A prefill leg scheduled with blocks for its whole prompt (this step computes its
        last prompt tokens): the workers make its WRITEs ready while the engine computes
        (`prepare_ahead`), and write each layer as it is computed (`layerwise`). A prompt
        prefilled in chunks gets its later blocks without a hook, so it is planned and
        written at the push, as without these."""
        params = _params_or_none(request)
        cfg = self.config
        if not (cfg.prepare_ahead or cfg.layerwise) or params is None or params.leg != "prefill":
            return
        block_ids = list(blocks.get_block_ids()[0])
        if len(block_ids) * self._block_size < request.num_prompt_tokens:
            return
        key = params.key(request.request_id)
        prepare = m.Prepare(key, block_ids, request.num_prompt_tokens, cfg.layerwise)
        self._actions.append(prepare)

    def _announce(self, push: m.Push) -> None:
        """SOURCE to this engine's ranks now; never raises (the worker's Push still comes)."""
        try:
            if self._announcer is None:
                self._announcer = SourceAnnouncer()
            cfg = self.config
            own = PrefillAddress(cfg.side_channel_host, cfg.side_channel_port, self._tp_size)
            self._announcer.announce(
                own, push.key, push.block_ids, push.num_tokens, push.first_token
            )
        except Exception as e:
            log.warning("kvpush: SOURCE for %s not sent (the push waits a step): %s", push.key, e)

    def close(self) -> None:
        if self._announcer is not None:
            self._announcer.close()
            self._announcer = None

    def has_pending_push_work(self) -> bool:
        return bool(self._actions or self._sending or self._settling)
