"""The transfer and proxy tables of docs/benchmarks.md, from the JSON of `kvpush bench transfer`
and `kvpush bench proxy` (medians, ms):

    python benchmarks/scripts/results_tables.py benchmarks/results/transfer_cpu.json ...
    python benchmarks/scripts/results_tables.py --fast-poll benchmarks/results/transfer_cpu.json ...

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
    if "streamed_tokens" in data:  # streamed answers, relayed event by event or as bytes
        head = [f"a streamed answer of {data['streamed_tokens']} events", "direct median",
                "through the proxy, event by event (migration on)",
                "as bytes (migration off)", "parsing, per event"]  # fmt: skip
        cells = ["median", *(f"{data[k]:.2f} ms" for k in ("streamed_direct_median_ms",
                 "streamed_proxy_median_ms", "streamed_proxy_bytes_median_ms")),
                 f"{data['parse_per_event_us']:+.2f} us"]  # fmt: skip
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                  "| " + " | ".join(cells) + " |"]  # fmt: skip
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


FAST_POLL_HEAD = ["where", "pushes", "faster at the 0.1 ms step", "median change ms",
                  "least / most change ms"]  # fmt: skip


def fast_poll_row(data: dict) -> str:
    """`fast_poll_s`'s measurement: each push of a run (layer-outer rows) at the default
    0.1 ms poll step against the same push through endpoints that keep the 1 ms busy step
    (`push_1ms_step_ms`, same run); change = fast - 1 ms step, negative is faster."""
    pairs = [(r["push_ms_median"], r["push_1ms_step_ms_median"]) for r in rows(data)]
    changes = sorted(fast - slow for fast, slow in pairs)
    mid = len(changes) // 2
    median = changes[mid] if len(changes) % 2 else (changes[mid - 1] + changes[mid]) / 2
    host = data["host"]
    where = f"{host.get('gpu') or str(host['cpus']) + ' CPUs'}, {data['memory']}"
    faster = sum(c < 0 for c in changes)
    cells = [where, str(len(changes)), f"{faster} of {len(changes)}", f"{median:+.2f}",
             f"{changes[0]:+.2f} / {changes[-1]:+.2f}"]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def fast_poll_table(datas: list[dict]) -> str:
    lines = ["| " + " | ".join(FAST_POLL_HEAD) + " |", "|" + "---|" * len(FAST_POLL_HEAD)]
    return "\n".join(lines + [fast_poll_row(d) for d in datas])


def knobs_table(folder: str) -> str:
    """The CPU-only settings against their absence (benchmarks/scripts/knobs_cpu.sh): per
    variant and rate, TTFT and TPOT medians and the share within the SLO targets, each the
    mean over the rounds (folders `<variant>_r<round>`)."""
    import glob
    import os

    runs: dict[tuple[str, float], list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*_r*", "kvpush_*.json"))):
        variant = os.path.basename(os.path.dirname(path)).rsplit("_r", 1)[0]
        with open(path) as f:
            data = json.load(f)
        runs.setdefault((variant, data["qps"]), []).append(data)
    order = {"default": 0, "idle_wait_0": 1, "gil_5ms": 2}
    head = ["settings", "QPS", "rounds", "TTFT ms", "TPOT ms", "within the SLO"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, qps in sorted(runs, key=lambda k: (order.get(k[0], 9), k[1])):
        got = runs[(variant, qps)]

        def mean(key: str, got: list[dict] = got) -> float:
            return sum(r[key] for r in got) / len(got)

        share = 100 * mean("slo_attainment")
        cells = [variant, f"{qps:g}", str(len(got)), f"{mean('median_ttft_ms'):.0f}",
                 f"{mean('median_tpot_ms'):.2f}", f"{share:.0f} %"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paths_table(folder: str) -> str:
    """The paths kvpush's proxy took (kvpush.proxy.paths) per rate, summed over the rounds of
    a `kvpush bench serve` results folder."""
    import glob
    import os

    counts: dict[float, dict[str, int]] = {}
    plans: dict[float, list[str]] = {}  # what `kvpush plan` said of each round's point
    for path in sorted(glob.glob(os.path.join(folder, "kvpush_*.json"))):
        with open(path) as f:
            data = json.load(f)
        point = counts.setdefault(data["qps"], {})
        for name, n in (data.get("proxy_paths") or {}).items():
            point[name] = point.get(name, 0) + n
        if plan := data.get("plan"):
            said = plan["verdict"] + (f" (`{plan['flags']}`)" if plan["flags"] else "")
            plans.setdefault(data["qps"], []).append(said)
    head = ["QPS", "push", "local (whole on decode)", "whole (on prefill)"]
    head += ["`kvpush plan`, each round"] if plans else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for qps in sorted(counts):
        c = counts[qps]
        cells = [f"{qps:g}", *(str(c.get(k, 0)) for k in ("push", "local", "whole"))]
        cells += ["; ".join(plans.get(qps, [])) or "-"] if plans else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prefix_table(folder: str) -> str:
    """A shared-prefix run (`kvpush bench serve --shared-prefix`): per stack and rate, the
    medians, the share within the SLO, and the engines' prefix-cache hit rate (tokens hit
    over tokens looked up, all engines, from their /metrics), means over the iterations."""
    import glob
    import os

    runs: dict[tuple[str, float], list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*_qps*.json"))):
        with open(path) as f:
            data = json.load(f)
        runs.setdefault((data["mode"], data["qps"]), []).append(data)
    head = ["stack", "QPS", "TTFT ms", "TPOT ms", "within the SLO", "prefix-cache hits"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, qps in sorted(runs):
        got = runs[(mode, qps)]
        caches = [c for r in got for c in r["prefix_cache"].values()]
        hits = sum(c["hits"] for c in caches) / max(sum(c["queries"] for c in caches), 1)

        def mean(key: str, got: list[dict] = got) -> float:
            return sum(r[key] for r in got) / len(got)

        cells = [mode, f"{qps:g}", f"{mean('median_ttft_ms'):.0f}",
                 f"{mean('median_tpot_ms'):.2f}", f"{100 * mean('slo_attainment'):.0f} %",
                 f"{100 * hits:.0f} %"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chaos_table(*folders: str) -> str:
    """Soaks (`kvpush bench chaos`), a row each: what every request got, the kills, and what
    the engines held once idle (KV blocks in use, kvpush's gauges: the sum over engines)."""
    import os

    head = ["stack", "load", "timeout s", "kills", "sent", "200, whole", "503", "failed",
            "s to end, p50 / p99", "migrated", "re-sent", "lease failures, both sides",
            "equal to plain", "held at the end", "preemptions"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for folder in folders:
        with open(os.path.join(folder, "chaos.json")) as f:
            data = json.load(f)
        cfg, checked, engines = (
            data["config"],
            data["checked_against_plain"],
            data["engines_at_end"],
        )
        counts = ("leases_expired", "preemptions")
        held = sum(v for e in engines.values() for k, v in e.items() if k not in counts)
        preempted = sum(e.get("preemptions", 0) for e in engines.values())
        cells = [
            f"{cfg['num_prefill']}P{cfg['num_decode']}D",
            f"{cfg['duration_s']:g} s at {cfg['qps']:g} QPS",
            f"{cfg['request_timeout_s']:g}",
            str(len(data["kills"])),
            str(data["requests_sent"]),
            str(data["completed_ok"]),
            str(data["refused_503"]),
            str(data["failed"]),
            " / ".join(f"{s:.0f}" for s in data.get("seconds_to_end_p50_p99", ())) or "-",
            f"{data['migrated']:g}",
            f"{sum(data['rerouted'].values()):g}",
            f"{data['leases_expired']:g}",
            f"{checked['checked'] - len(checked['mismatched'])} of {checked['checked']} "
            f"({checked['migrated_checked']} migrated)",
            f"{held:g}",
            f"{preempted:g}" if any("preemptions" in e for e in engines.values()) else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--chaos"]:
        print(chaos_table(*sys.argv[2:]))
        sys.exit()
    if sys.argv[1:2] == ["--prefix"]:
        print(prefix_table(sys.argv[2]))
        sys.exit()
    if sys.argv[1:2] == ["--paths"]:
        print(paths_table(sys.argv[2]))
        sys.exit()
    if sys.argv[1:2] == ["--knobs"]:
        print(knobs_table(sys.argv[2]))
        sys.exit()
    if sys.argv[1:2] == ["--fast-poll"]:
        datas = []
        for path in sys.argv[2:]:
            with open(path) as f:
                datas.append(json.load(f))
        print(fast_poll_table(datas))
        sys.exit()
    for path in sys.argv[1:]:
        with open(path) as f:
            print(table(json.load(f)) + "\n")
