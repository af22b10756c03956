"""The transfer and proxy tables of docs/benchmarks.md, from the JSON of `kvpush bench transfer`
and `kvpush bench proxy` (medians, ms):

    python benchmarks/scripts/results_tables.py benchmarks/results/transfer_cpu.json ...

Transfer: rows of the layer-outer layout only (the cross-layer rows are in the JSON). Columns:
- push: from the hand-over to the WRITE's completion, as the prefill side sees it (on a GPU,
  made ready ahead, as the connector does while prefill computes; scattered blocks staged);
- landed: until decode has the notification;
- raw WRITE: NIXL's own WRITE of the same blocks, descriptors built beforehand, one descriptor
  per block and region, polled in a tight loop;
- pull: the pull baseline (decode builds descriptors and READs, on its caller's thread);
- caller blocked: how long the caller (vLLM's engine loop) is held by a push, or by a pull.
"""

import json
import sys


def rows(data: dict) -> list[dict]:
    return [r for r in data["rows"] if not r.get("cross_layer")]


def table(data: dict) -> str:
    if "benchmark" not in data:  # benchmarks/scripts/layerwise_gpu.py's
        return layerwise_table(data)
    return proxy_table(data) if data["benchmark"] == "proxy" else transfer_table(data)


def layerwise_table(data: dict) -> str:
    """Tail: decode's notification minus the end of the simulated forward; push: the push's
    own WRITE; each written whole after the forward, and layer by layer during it."""
    by = {(r["tokens"], r["layerwise"]): r for r in data["rows"]}
    head = ["tokens", "forward", "whole push: tail", "layer by layer: tail",
            "layer by layer: push"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tokens in sorted({t for t, _ in by}):
        whole, layers = by[(tokens, False)], by[(tokens, True)]
        cells = [f"{tokens:,}", f"{whole['forward_ms']:.1f}", f"{whole['tail_ms']:.2f}",
                 f"{layers['tail_ms']:.2f}", f"{layers['push_ms']:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return f"{data['device']}, medians of {data['repeats']}:\n\n" + "\n".join(lines)


def proxy_table(data: dict) -> str:
    head = ["requests", "direct median", "direct p99", "through the proxy median",
            "through the proxy p99", "added median", "added p99",
            f"requests/s at {data['concurrency']} concurrent"]  # fmt: skip
    cells = [str(data["requests"])]
    cells += [f"{data[k]:.2f} ms" for k in ("direct_median_ms", "direct_p99_ms",
              "proxy_median_ms", "proxy_p99_ms", "added_median_ms", "added_p99_ms")]  # fmt: skip
    cells.append(f"{data['proxy_requests_per_s']:,.0f}")
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| " + " | ".join(cells) + " |",
    ]
    return f"{data['hardware']['cpus']} CPUs, {data['upstream']}:\n\n" + "\n".join(lines)


def transfer_table(data: dict) -> str:
    cuda = data.get("memory") == "VRAM"
    columns = {  # a column no row has is left out (the DRAM runs record no landing)
        "push": "push_ahead_ms_median" if cuda else "push_ms_median",
        "landed": "push_ahead_landed_ms_median" if cuda else "push_landed_ms_median",
        "raw WRITE": "raw_write_ms_median",
        "pull": "pull_ms_median",
        "push: caller blocked": "push_caller_blocked_ms_median",
        "pull: caller blocked": "pull_caller_blocked_ms_median",
    }
    columns = {k: v for k, v in columns.items() if any(v in r for r in rows(data))}
    size = ["tokens", "blocks", "pattern", "MiB"] if cuda else ["block", "blocks", "pattern"]
    head = [*size, "descs (push)", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows(data):
        if cuda:
            cells = [f"{r['num_tokens']:,}", f"{r['num_blocks']:,}", r["pattern"],
                     f"{r['num_bytes'] / 2**20:,.0f}"]  # fmt: skip
        else:
            cells = [f"{r['block_bytes'] // 1024} KiB", f"{r['num_blocks']:,}", r["pattern"]]
        cells.append(f"{r['push_descs']:,}")
        for key in columns.values():
            value = r.get(key)
            cells.append("-" if value is None else f"{value:,.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    host = data["host"]
    where = host.get("gpu") or f"{host['cpus']} CPUs"
    return f"{where}, {data['memory']}, {data['backend']}:\n\n" + "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(table(json.load(f)) + "\n")
