"""A Ray Serve LLM prefill/decode application with kvpush's connector, and `kvpush ray up`.

`build_app(RayStack(...))` returns Ray Serve LLM's P/D graph: N prefill and M decode
replicas of a model, each engine with kvpush's connector, whose backend (kvpush.ray.backend)
Ray's orchestrator calls to shape each request's two legs, and kvpush's decode deployment
(kvpush.ray.server). Replicas are Ray's: it places them, restarts a dead one, and scales
each role between its bounds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from kvpush.launch.engine import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_GIB,
    KV_ROLE,
    VLLM_CONNECTOR,
    engine_env,
)
from kvpush.ray import check_ray

APP_NAME = "kvpush"


@dataclass(frozen=True)
class RayStack:
    model: str  # a local folder or a model id
    served_model_name: str = "tiny"
    num_prefill: int = 1
    num_decode: int = 1
    # autoscaling bounds; None: the replica count, fixed
    max_prefill: int | None = None
    max_decode: int | None = None
    on_cpu: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int = 4096
    dtype: str = "float32"
    kv_cache_gib: int = DEFAULT_KV_CACHE_GIB  # on CPU

    def __post_init__(self) -> None:
        for role, n, top in (
            ("prefill", self.num_prefill, self.max_prefill),
            ("decode", self.num_decode, self.max_decode),
        ):
            if n < 1:
                raise ValueError(f"at least one {role} replica, got {n}")
            if top is not None and top < n:
                raise ValueError(f"max {role} replicas ({top}) below its count ({n})")

    def replicas(self, role: str) -> tuple[int, int]:
        """(initial, most) replicas of a role."""
        n, top = (
            (self.num_prefill, self.max_prefill)
            if role == "prefill"
            else (self.num_decode, self.max_decode)
        )
        return n, top if top is not None else n

    @property
    def num_cpus(self) -> int:
        """Ray's logical CPUs for the app at its most replicas: two an engine replica (its
        actor's, and its placement group's bundle), one for the ingress. Logical only: each
        engine computes on the cores `cpu_binds` gives it."""
        return 2 * (self.replicas("prefill")[1] + self.replicas("decode")[1]) + 1


def cpu_binds(role: str, count: int, cores: int) -> list[str]:
    """The core each replica of a role computes on, by replica rank: prefill from the first
    core up, decode from the last down (1P1D on two cores: prefill 0, decode 1)."""
    if role == "prefill":
        return [str(i % cores) for i in range(count)]
    return [str(cores - 1 - i % cores) for i in range(count)]


def llm_config(stack: RayStack, role: str) -> dict[str, Any]:
    """One role's `LLMConfig`, as a dict Ray validates."""
    initial, most = stack.replicas(role)
    kv = {
        "kv_connector": VLLM_CONNECTOR["kvpush"],
        "kv_connector_module_path": "kvpush.vllm",
        "kv_role": KV_ROLE[role],
        "kv_buffer_device": "cpu" if stack.on_cpu else "cuda",
        "kv_connector_extra_config": {"backends": ["UCX"]},
    }
    if role == "decode":
        # a push that fails (its prefill replica died after answering) is computed here
        kv["kv_load_failure_policy"] = "recompute"
    engine_kwargs: dict[str, Any] = {
        "kv_transfer_config": kv,
        "block_size": stack.block_size,
        "max_model_len": stack.max_model_len,
        "dtype": stack.dtype,
    }
    deployment: dict[str, Any]
    if most > initial:
        deployment = {
            "autoscaling_config": {
                "min_replicas": initial,
                "initial_replicas": initial,
                "max_replicas": most,
            }
        }
    else:
        deployment = {"num_replicas": initial}
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": stack.served_model_name, "model_source": stack.model},
        "engine_kwargs": engine_kwargs,
        "deployment_config": deployment,
        "experimental_configs": {},
    }
    if stack.on_cpu:
        # one logical CPU a replica (else Ray asks for a GPU and never places it); its engine
        # computes on the core kvpush.ray.backend binds by replica rank
        config["placement_group_config"] = {"bundles": [{"CPU": 1}]}
        config["experimental_configs"]["KVPUSH_CPU_BIND"] = cpu_binds(
            role, most, os.cpu_count() or 1
        )
        config["runtime_env"] = {"env_vars": engine_env(True, stack.kv_cache_gib)}
    return config


def build_app(stack: RayStack) -> Any:
    """Ray Serve LLM's three-tier P/D graph for `stack` (OpenAI ingress -> decode, which
    orchestrates -> prefill), as `ray.serve.llm.build_pd_openai_app` builds it but with
    kvpush's decode deployment (kvpush.ray.server), and kvpush's backend registered."""
    check_ray()
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import (
        KVConnectorBackendFactory,
    )
    from ray.serve.llm import LLMConfig, build_llm_deployment
    from ray.serve.llm.deployment import PDPrefillServer
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress

    from kvpush.ray.server import KVPushDecodeServer

    name = VLLM_CONNECTOR["kvpush"]
    if not KVConnectorBackendFactory.is_registered(name):
        KVConnectorBackendFactory.register_backend(name, "kvpush.ray.backend:KVPushBackend")
    prefill_config = LLMConfig.model_validate(llm_config(stack, "prefill"))
    decode_config = LLMConfig.model_validate(llm_config(stack, "decode"))
    # Ray annotates deployment_cls as its public LLMServer, which its own P/D server classes
    # (passed here as by Ray's P/D builder) do not derive from
    prefill = build_llm_deployment(
        prefill_config,
        name_prefix="Prefill:",
        deployment_cls=PDPrefillServer,  # type: ignore[arg-type]
    )
    decode = build_llm_deployment(
        decode_config,
        name_prefix="Decode:",
        bind_kwargs={"prefill_server": prefill},
        deployment_cls=KVPushDecodeServer,  # type: ignore[arg-type]
    )
    model_id = decode_config.model_id
    options = OpenAiIngress.get_deployment_options([decode_config])
    ingress = serve.deployment(**options)(make_fastapi_ingress(OpenAiIngress))
    return ingress.bind(
        llm_deployments={model_id: decode},
        model_cards={model_id: to_model_metadata(model_id, decode_config)},
    )


def up(stack: RayStack, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Start a local Ray instance, run the app on it until Ctrl-C or SIGTERM (which `kvpush`
    turns into an exit), then stop it and every process it started."""
    check_ray()
    import psutil
    import ray
    from ray import serve

    # Ctrl-C stops it even where a shell started it in the background (which ignores SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ray.init(num_cpus=stack.num_cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        print(
            f"kvpush ray up: {stack.num_prefill}P{stack.num_decode}D of {stack.model} "
            "starting on Ray Serve (a minute or two)",
            flush=True,
        )
        serve.run(build_app(stack), name=APP_NAME, route_prefix="/")
        metrics = ray.nodes()[0]["MetricsExportPort"]  # every replica's engine metrics
        print(
            f"kvpush ray up: serving on http://{host}:{port}, the engines' metrics on "
            f"http://127.0.0.1:{metrics}/metrics (Ctrl-C stops)",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        print("kvpush ray up: stopping", flush=True)
        started = psutil.Process().children(recursive=True)  # Ray's, and the engines'
        serve.shutdown()
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=10)
        for p in alive:  # an engine core whose replica's actor did not take it down
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    return 0
