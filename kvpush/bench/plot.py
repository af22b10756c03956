"""`kvpush plot RESULTS_DIR`: figures and summary.md, made only from the result JSONs.

The JSONs are `vllm bench serve`'s, named `<mode>_qps<q>_in<in>_out<out>_iter<i>.json`:
those `kvpush bench serve` writes, and those anyone's own `vllm bench serve` wrote against any
endpoint (`--save-result --result-filename` named that way); the grid point then comes from
the name.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

from kvpush.bench.serve import FRONT_END

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p99")
FIGURES = [(m, s) for m in ("ttft", "tpot", "itl") for s in ("median", "p99")]
MODE_ORDER = ("kvpush", FRONT_END, "nixl-push", "nixl-pull", "push", "pull", "mono")
# push against pull, as the seed's plot_push_vs_pull.py compares them (its modes: push, pull)
KVPUSH_MODES = ("kvpush", FRONT_END)  # through the proxy, at prefill's front end
PUSH_VS_PULL = (("push", "pull"), ("nixl-push", "nixl-pull"))
NAME = re.compile(r"^(?P<mode>.+)_qps(?P<qps>[0-9.]+|inf)_in(?P<n_in>\d+)_out(?P<n_out>\d+)"
                  r"_iter(?P<it>\d+)\.json$")  # fmt: skip


def load(results_dir: Path) -> dict[tuple, list[dict]]:
    """(mode, qps, input_len, output_len) -> one result per iteration."""
    points: dict[tuple, list[dict]] = defaultdict(list)
    for path in sorted(results_dir.glob("*_qps*_in*_out*_iter*.json")):
        match = NAME.match(path.name)
        if match is None:
            continue
        r = json.loads(path.read_text())
        mode = r.get("mode", match["mode"])
        qps = float(r.get("qps", match["qps"]))
        n_in = int(r.get("input_len", match["n_in"]))
        n_out = int(r.get("output_len", match["n_out"]))
        points[(mode, qps, n_in, n_out)].append(r)
    if not points:
        raise FileNotFoundError(
            f"no result files (<mode>_qps<q>_in<in>_out<out>_iter<i>.json) in {results_dir}"
        )
    return points


def figure(points: dict[tuple, list[dict]], metric: str, stat: str, out: Path) -> Path | None:
    """`stat` of `metric` against QPS, one panel per input (and output) length, one line per
    connector: the mean over iterations, their range shaded. None when no result has it."""
    key = f"{stat}_{metric}_ms"
    if not any(key in r for runs in points.values() for r in runs):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({k[2:] for k in points})
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False, sharey=True
    )
    modes = sorted({k[0] for k in points}, key=_mode_rank)
    for ax, (n_in, n_out) in zip(axes[0], lengths, strict=True):
        for mode in modes:
            keys = sorted(k for k in points if k[0] == mode and k[2:] == (n_in, n_out))
            vals = [[r[key] for r in points[k] if key in r] for k in keys]
            keys, vals = [k for k, v in zip(keys, vals, strict=True) if v], [v for v in vals if v]
            if not keys:
                continue
            xs = [k[1] for k in keys]
            ax.plot(xs, [statistics.fmean(v) for v in vals], marker="o", label=mode)
            ax.fill_between(xs, [min(v) for v in vals], [max(v) for v in vals], alpha=0.2)
        ax.set_title(f"input {n_in}, output {n_out}")
        ax.set_yscale("log")  # connectors differ by orders of magnitude here
        ax.set_xlabel("QPS")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{stat} {metric.upper()} (ms)")
    axes[0][-1].legend()
    fig.tight_layout()
    path = out / f"{metric}_{stat}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mode_rank(mode: str) -> tuple[int, str]:
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


# arrival -> decode's first chunk, in order; with kvpush the client's TTFT is route + prefill
# (its first token is prefill's) and push_tail is its first inter-token gap
BREAKDOWN = ("route", "prefill", "push_tail")


def breakdown(points: dict[tuple, list[dict]], out: Path) -> Path | None:
    """TTFT at the proxy split into its timeline phases (medians), one stacked bar per
    connector and grid point; None when no result has the proxy's phases."""
    bars = sorted(
        (k for k, runs in points.items() if runs[0].get("proxy_phases_ms")),
        key=lambda k: (k[1], k[2], k[3], _mode_rank(k[0])),
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
    modes = sorted({k[0] for k in points}, key=_mode_rank)
    grid = sorted({k[1:] for k in points})
    hw = next(iter(points.values()))[0].get("hardware", {})
    lines = [
        "# Benchmark summary",
        "",
        (
            f"Hardware: {hw.get('cpus', '?')} CPUs, {hw.get('machine', '?')},"
            f" {hw.get('platform', '?')}."
            if hw
            else "Hardware: not recorded."
        )
        + f" Figures: {stat} over requests, averaged over iterations."
        " Ratios below 1 favour the first.",
        "",
    ]
    ours = [m for m in KVPUSH_MODES if m in modes]  # each against every other mode
    pairs = [(a, b) for a in ours for b in modes if b not in ours]
    pairs += [p for p in (KVPUSH_MODES[::-1], *PUSH_VS_PULL) if set(p) <= set(modes)]
    for metric in ("ttft", "tpot"):
        key = f"{stat}_{metric}_ms"
        head = ["QPS", "input", "output", *[f"{m} ms" for m in modes]]
        head += [f"{a}/{b}" for a, b in pairs]
        lines += [
            f"## {metric.upper()}",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for qps, n_in, n_out in grid:
            value = {}
            for m in modes:
                runs = [r[key] for r in points.get((m, qps, n_in, n_out), ()) if key in r]
                value[m] = statistics.fmean(runs) if runs else None
            row = [f"{qps:g}", str(n_in), str(n_out)]
            row += [f"{value[m]:.1f}" if value[m] is not None else "-" for m in modes]
            for a, b in pairs:
                ok = value[a] is not None and value[b]
                row.append(f"{value[a] / value[b]:.2f}" if ok else "-")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines)


def main(results_dir: Path, stat: str = "median") -> int:
    points = load(results_dir)
    drawn = [figure(points, m, st, results_dir) for m, st in FIGURES]
    paths = [p for p in (*drawn, breakdown(points, results_dir)) if p is not None]
    (results_dir / "summary.md").write_text(summary(points, stat))
    for path in [*paths, results_dir / "summary.md"]:
        print(f"wrote {path}")
    return 0
