"""Layer by layer on the worker side (kvpush.vllm.worker.PushWorker.layer_saved): at a step's
first layer the step's layer-by-layer Prepares are handed to the endpoint, each layer then
names its regions, and start() after the forward does not hand them over again. The
endpoint's side is tests/transfer/test_layerwise.py; real engines: tests/e2e/test_prefix.py."""

from __future__ import annotations

import torch

from kvpush.transfer.wire import TransferKey
from kvpush.vllm import metadata as m
from kvpush.vllm.config import ConnectorConfig
from kvpush.vllm.kvlayout import layer_regions
from kvpush.vllm.worker import PushWorker


class Endpoint:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def prepare(self, key, block_ids, num_tokens):
        self.calls.append(("prepare", key, block_ids, num_tokens))

    def computed(self, keys, regions, ready):
        self.calls.append(("computed", keys, regions, ready))


def worker() -> PushWorker:
    cfg = ConnectorConfig("p0", True, ("UCX",), "127.0.0.1", 5600, 30.0, 5.0, 1.0, False)
    w = PushWorker(cfg, None)
    w.endpoint = Endpoint()
    w._layer_regions = {"l0": (0,), "l1": (1,)}
    return w


def test_a_steps_layers_are_handed_over_as_the_forward_computes_them():
    w = worker()
    ka, kb = TransferKey("a"), TransferKey("b")
    meta = m.PushMetadata(
        [m.Prepare(ka, [1, 2], 40, layerwise=True), m.Prepare(kb, [3], 10, layerwise=False)]
    )
    w.layer_saved("l0", meta)
    w.layer_saved("l1", meta)
    w.layer_saved("not-a-kv-layer", meta)  # no regions of its own: nothing to write
    assert w.endpoint.calls == [
        ("prepare", ka, [1, 2], 40),
        ("computed", [ka], [0], None),
        ("computed", [ka], [1], None),
    ]
    w.endpoint.calls.clear()
    w.start(meta.actions)  # after the forward: only the Prepare not handed over yet
    assert w.endpoint.calls == [("prepare", kb, [3], 10)]


def test_a_step_without_layer_by_layer_requests_writes_nothing():
    w = worker()
    w.layer_saved("l0", m.PushMetadata([]))
    w.layer_saved("l1", m.PushMetadata([]))  # another step
    assert w.endpoint.calls == []


def test_layer_regions_follow_the_layout_one_or_two_per_layer():
    one = {"a": torch.zeros(4, 2, 16, 8), "b": torch.zeros(4, 2, 16, 8)}  # [B, H, N, 2D]
    two = {"a": torch.zeros(2, 4, 2, 16, 4), "b": torch.zeros(2, 4, 2, 16, 4)}  # K, V apart
    assert layer_regions(one) == {"a": (0,), "b": (1,)}
    assert layer_regions(two) == {"a": (0, 1), "b": (2, 3)}
