"""`kvpush plot RESULTS_DIR`: figures and summary.md, made only from the result JSONs."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p99")
MODE_ORDER = ("kvpush", "nixl-push", "nixl-pull", "mono")


def load(results_dir: Path) -> dict[tuple, list[dict]]:
    """(mode, qps, input_len, output_len) -> one result per iteration."""
    points: dict[tuple, list[dict]] = defaultdict(list)
    for path in sorted(results_dir.glob("*_qps*_in*_out*_iter*.json")):
        r = json.loads(path.read_text())
        points[(r["mode"], r["qps"], r["input_len"], r["output_len"])].append(r)
    if not points:
        raise FileNotFoundError(
            f"no result files (<mode>_qps<q>_in<in>_out<out>_iter<i>.json) in {results_dir}"
        )
    return points


def figure(points: dict[tuple, list[dict]], metric: str, stat: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = f"{stat}_{metric}_ms"
    qps_levels = sorted({k[1] for k in points})
    fig, axes = plt.subplots(
        1, len(qps_levels), figsize=(4.5 * len(qps_levels), 3.6), squeeze=False, sharey=True
    )
    modes = [m for m in MODE_ORDER if any(k[0] == m for k in points)]
    for ax, qps in zip(axes[0], qps_levels, strict=True):
        for mode in modes:
            keys = sorted((k for k in points if k[0] == mode and k[1] == qps), key=lambda k: k[2])
            if not keys:
                continue
            xs = [k[2] for k in keys]
            vals = [[r[key] for r in points[k]] for k in keys]
            mid = [statistics.fmean(v) for v in vals]
            ax.plot(xs, mid, marker="o", label=mode)
            ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], alpha=0.2)
        ax.set_title(f"{qps:g} QPS")
        ax.set_yscale("log")  # connectors differ by orders of magnitude here
        ax.set_xlabel("input tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{stat} {metric.upper()} (ms)")
    axes[0][-1].legend()
    fig.tight_layout()
    path = out / f"{metric}_{stat}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# arrival -> decode's first chunk, in order; with kvpush the client's TTFT is route + prefill
# (its first token is prefill's) and push_tail is its first inter-token gap
BREAKDOWN = ("route", "prefill", "push_tail")


def breakdown(points: dict[tuple, list[dict]], out: Path) -> Path | None:
    """TTFT at the proxy split into its timeline phases (medians), one stacked bar per
    connector and grid point; None when no result has the proxy's phases."""
    bars = sorted(
        (k for k, runs in points.items() if runs[0].get("proxy_phases_ms")),
        key=lambda k: (k[1], k[2], k[3], MODE_ORDER.index(k[0]) if k[0] in MODE_ORDER else 9),
    )
    if not bars:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars)), 4.0))
    bottom = [0.0] * len(bars)
    for phase in BREAKDOWN:
        heights = [
            statistics.fmean(
                (r["proxy_phases_ms"].get(phase) or {}).get("median", 0.0) for r in points[k]
            )
            for k in bars
        ]
        ax.bar(range(len(bars)), heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([f"{k[0]}\n{k[1]:g} QPS\nin {k[2]}" for k in bars], fontsize=7)
    ax.set_ylabel("median ms, arrival to decode's first chunk")
    ax.set_title("TTFT breakdown (proxy timeline; kvpush: TTFT = route + prefill)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "ttft_breakdown.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(points: dict[tuple, list[dict]], stat: str) -> str:
    modes = [m for m in MODE_ORDER if any(k[0] == m for k in points)]
    grid = sorted({k[1:] for k in points})
    hw = next(iter(points.values()))[0].get("hardware", {})
    lines = [
        "# Benchmark summary",
        "",
        f"Hardware: {hw.get('cpus', '?')} CPUs, {hw.get('machine', '?')},"
        f" {hw.get('platform', '?')}."
        f" Figures: {stat} over requests, averaged over iterations. Ratios below 1 favour kvpush.",
        "",
    ]
    for metric in ("ttft", "tpot"):
        key = f"{stat}_{metric}_ms"
        others = [m for m in modes if m != "kvpush"]
        head = ["QPS", "input", "output", *[f"{m} ms" for m in modes]]
        if "kvpush" in modes:
            head += [f"kvpush/{m}" for m in others]
        lines += [
            f"## {metric.upper()}",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for qps, n_in, n_out in grid:
            value = {}
            for m in modes:
                runs = points.get((m, qps, n_in, n_out))
                value[m] = statistics.fmean(r[key] for r in runs) if runs else None
            row = [f"{qps:g}", str(n_in), str(n_out)]
            row += [f"{value[m]:.1f}" if value[m] is not None else "-" for m in modes]
            if "kvpush" in modes:
                for m in others:
                    ok = value["kvpush"] is not None and value[m]
                    row.append(f"{value['kvpush'] / value[m]:.2f}" if ok else "-")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(results_dir: Path, metric: str = "ttft", stat: str = "median") -> int:
    points = load(results_dir)
    paths = [figure(points, m, stat, results_dir) for m in (metric, "tpot") if m in METRICS]
    paths += [p for p in (breakdown(points, results_dir),) if p is not None]
    (results_dir / "summary.md").write_text(summary(points, stat))
    for path in [*dict.fromkeys(paths), results_dir / "summary.md"]:
        print(f"wrote {path}")
    return 0
