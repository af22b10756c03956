"""KVPushConnector: vLLM's KV-connector API, delegating to the scheduler and worker halves.

No hook raises into the engine (an exception there kills it): a failure is logged, and the
scheduler half's `*_failed` / `settle_output` methods leave a bounded state: the request
concerned fails on its own, prefill is told at once, and no block stays held.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvpush import logs
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.metadata import PushMetadata
from kvpush.vllm.scheduler import PushScheduler
from kvpush.vllm.stats import KVPushPromMetrics, KVPushStats
from kvpush.vllm.worker import PushWorker

if TYPE_CHECKING:  # vLLM's types, for the checker only: nothing more is imported at run time
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class KVPushConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        logs.attach()
        config = ConnectorConfig.from_vllm(vllm_config)  # refuses unsupported set-ups
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "KVPushConnector supports one KV-cache group; this model has "
                f"{len(kv_cache_config.kv_cache_groups)} (hybrid or sliding-window layers)"
            )
        self._scheduler = PushScheduler(config, vllm_config) if role.name == "SCHEDULER" else None
        self._worker = PushWorker(config, vllm_config) if role.name == "WORKER" else None

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)  # errors here stop start-up, with cause

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PushMetadata)
        self._worker.start(meta.actions)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kw: Any,
    ) -> None:
        """A layer is computed: prefill writes it to decode now (`layerwise`)."""
        worker = self._worker
        if worker is None or not worker.layerwise:
            return
        try:
            meta = self._get_connector_metadata()
            if isinstance(meta, PushMetadata):
                worker.layer_saved(layer_name, meta)
        except Exception:  # the push still writes every layer
            log.exception("kvpush: writing layer %s early failed", layer_name)
            worker.fell_back("layerwise")

    def wait_for_save(self) -> None:
        """Pushes are written by the endpoint's thread, not saved layer by layer: nothing to
        wait for, except on a step with no tokens (PushWorker.wait_idle)."""
        assert self._worker is not None
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, PushMetadata) and meta.idle:
            try:
                self._worker.wait_idle()
            except Exception:
                log.exception("kvpush: waiting on an idle step failed")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        try:
            sending, recving, failed = self._worker.results()
        except Exception:
            log.exception("kvpush: collecting transfer results failed")
            return KVConnectorTransferResults()
        return KVConnectorTransferResults(sending, recving, failed)

    def get_kv_connector_stats(self) -> KVPushStats | None:
        try:
            return self._worker.take_stats() if self._worker is not None else None
        except Exception:
            log.exception("kvpush: collecting stats failed")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPushStats:
        return KVPushStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVPushPromMetrics:
        return KVPushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side -------------------------------------------------------------------
    # Each hook's failure leaves a bounded state (docs/architecture.md, "When a connector hook
    # fails"): the request fails alone or goes on, prefill is told at once, nothing is held.
    def _inject(
        self,
        hook: str,
        request: Request | None = None,
        output: KVConnectorOutput | None = None,
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.inject(hook, request, output)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            self._inject("get_num_new_matched_tokens", request)
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as e:
            log.exception("kvpush: request %s: matching failed", request.request_id)
            return self._scheduler.match_failed(request, num_computed_tokens, e)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        try:
            self._inject("update_state_after_alloc", request)
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as e:
            log.exception("kvpush: request %s: registration failed", request.request_id)
            if num_external_tokens > 0:  # claimed as a load: fail it, do not leave it waiting
                self._scheduler.alloc_failed(request, e)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PushMetadata:
        assert self._scheduler is not None
        try:
            self._inject("build_connector_meta")
            return self._scheduler.build_connector_meta(scheduler_output)
        except Exception:
            # the actions stay queued and go with the next step (has_pending_push_work)
            log.exception("kvpush: building this step's connector metadata failed")
            return PushMetadata()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        try:
            self._inject("update_connector_output", output=connector_output)
            self._scheduler.update_connector_output(connector_output)
        except Exception:
            log.exception("kvpush: reading the workers' output failed; settling what finished")
            self._scheduler.settle_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        try:
            self._inject("request_finished", request)
            return self._scheduler.request_finished(request, block_ids)
        except Exception as e:
            log.exception("kvpush: request %s: finish handling failed", request.request_id)
            return self._scheduler.finish_failed(request, e)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        kv = vllm_config.kv_transfer_config
        if kv is not None and kv.kv_buffer_device == "cuda":
            return "HND"  # head-major blocks: a TP head split is one descriptor per block
        return None
