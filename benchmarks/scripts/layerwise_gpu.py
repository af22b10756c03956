"""What writing the KV layer by layer saves after prefill's forward, on one GPU.

The KV of one TP-8 rank of Qwen3-32B (64 layers, K and V apart: 128 regions, 4 KiB per block
per region), contiguous blocks, 1k / 4k / 16k tokens. Prefill's forward is simulated in
prefill's process (kvpush.bench.harness.simulated_forward): per layer, CUDA's sleep
kernel for LAYER_MS_PER_1K * tokens / 1024 ms, then, layer by layer, computed() with that
layer's CUDA event; after the last layer's work, push() as the connector's would come.
"tail" is decode's notification (its endpoint's mark) minus the end of the forward's work,
on the host's monotonic clock: what the first inter-token gap gets of the transfer. Both
sides on one GPU, so UCX moves the bytes GPU to GPU (cuda_ipc); across hosts the whole
push's bytes would take longer and the difference would grow. Medians of REPEATS after one
warm-up of each.

Run on a CUDA host: python benchmarks/scripts/layerwise_gpu.py OUT.json
(a trial on DRAM, 1k tokens only: ... OUT.json cpu)
"""

import json
import statistics
import sys
import time
import uuid
from dataclasses import replace

REPEATS = 7
TOKENS = [1024, 4096, 16384]
LAYER_MS_PER_1K = 0.2  # per layer, per 1,024 tokens: about 12.8 ms of forward per 1k tokens


def main(out: str, device: str = "cuda") -> None:
    from kvpush.bench.harness import Side
    from kvpush.bench.transfer import QWEN3_32B_TP8, _free_port
    from kvpush.transfer.endpoint import TransferConfig
    from kvpush.transfer.wire import Compat, PrefillAddress, TransferKey

    tokens_run = TOKENS if device != "cpu" else TOKENS[:1]
    n_max = max(tokens_run) // 16
    spec = replace(QWEN3_32B_TP8, num_blocks=2 * n_max, device=device)
    compat = Compat(mode="push", model="bench", dtype="bfloat16", layout_kind="bench")
    port = _free_port()
    prefill = Side("prefill", TransferConfig("p", compat, side_channel_port=port), spec, seed=1)
    decode = Side("decode", TransferConfig("d", compat), spec)
    address = PrefillAddress("127.0.0.1", port)
    rows = []
    try:
        for tokens in tokens_run:
            blocks = tokens // 16
            src, dst = list(range(blocks)), list(range(n_max, n_max + blocks))
            layer_s = LAYER_MS_PER_1K * tokens / 1024 / 1e3
            for layerwise in (False, True):
                tails, pushes = [], []
                for i in range(REPEATS + 1):
                    key = TransferKey(uuid.uuid4().hex)
                    fd = decode.call("expect", key, address, dst, tokens)
                    deadline = time.monotonic() + 5
                    while prefill.call("gauges")["pending_match"] < 1:
                        assert time.monotonic() < deadline, "no registration at prefill"
                        time.sleep(0.01)
                    fid, end = prefill.call("forward", key, src, tokens, layer_s, layerwise)
                    out_p, out_d = prefill.wait(fid), decode.wait(fd)
                    assert out_p.ok and out_d.ok, (out_p, out_d)
                    if i:  # the first is a warm-up
                        tails.append((out_d.marks["notified"] - end) * 1e3)
                        pushes.append(out_p.elapsed_s * 1e3)
                    time.sleep(0.05)
                row = {
                    "tokens": tokens,
                    "layerwise": layerwise,
                    "forward_ms": layer_s * 1e3 * (spec.num_regions // 2),
                    "tail_ms": statistics.median(tails),
                    "tail_ms_all": tails,
                    "push_ms": statistics.median(pushes),
                    "layer_writes": prefill.call("counters")["layer_writes"],
                }
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "tail_ms_all"}), flush=True)
    finally:
        prefill.close()
        decode.close()
    with open(out, "w") as f:
        json.dump({"device": device, "repeats": REPEATS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
