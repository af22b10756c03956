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

from kvpush.bench import slo as slo_
from kvpush.bench.slo import SloConfig
from kvpush.bench.stacks import FRONT_END

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p99")
FIGURES = [(m, s) for m in ("ttft", "tpot", "itl") for s in ("median", "p99")]
MODE_ORDER = ("kvpush", FRONT_END, "nixl-push", "nixl-pull", "push", "pull", "mono", "mono-mp",
              "replicas")  # fmt: skip
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


def shares(points: dict[tuple, list[dict]], slo: SloConfig | None) -> dict[tuple, float]:
    """Each point's SLO attainment, the mean over its iterations, against `slo`, or else the
    targets its results were run with; points with neither, or no per-request data, left out."""
    out = {}
    for key, runs in points.items():
        values = [slo_.attainment(r, target) for r in runs if (target := slo or slo_.of(r))]
        found = [v for v in values if v is not None]
        if found:
            out[key] = statistics.fmean(found)
    return out


def goodputs(points: dict[tuple, list[dict]], share: dict[tuple, float]) -> dict[tuple, float]:
    """Requests a second that met both targets: each point's attainment times the rate its
    requests completed at (vLLM's `request_throughput`), for points that have both."""
    out = {}
    for key, value in share.items():
        rates = [r["request_throughput"] for r in points[key] if "request_throughput" in r]
        if rates:
            out[key] = value * statistics.fmean(rates)
    return out


def targets(points: dict[tuple, list[dict]], slo: SloConfig | None) -> str:
    if slo is not None:
        return slo.label()
    found = {t for runs in points.values() for r in runs if (t := slo_.of(r))}
    return "; ".join(sorted(t.label() for t in found)) or "none recorded"


def attainment_figure(
    points: dict[tuple, list[dict]], slo: SloConfig | None, out: Path
) -> Path | None:
    """SLO attainment against QPS, one panel per input (and output) length, one line per
    stack; None when no result has it."""
    share = shares(points, slo)
    if not share:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({k[2:] for k in share})
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(4.5 * len(lengths), 3.6), squeeze=False, sharey=True
    )
    for ax, (n_in, n_out) in zip(axes[0], lengths, strict=True):
        for mode in sorted({k[0] for k in share}, key=_mode_rank):
            keys = sorted(k for k in share if k[0] == mode and k[2:] == (n_in, n_out))
            if keys:
                ax.plot([k[1] for k in keys], [100 * share[k] for k in keys], marker="o",
                        label=mode)  # fmt: skip
        ax.axhline(100 * slo_.MIN_SHARE, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"input {n_in}, output {n_out}")
        ax.set_xlabel("QPS")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("% of requests within the SLO")
    axes[0][-1].legend()
    fig.suptitle(targets(points, slo), fontsize=9)
    fig.tight_layout()
    path = out / "slo_attainment.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def max_qps(share: dict[tuple, float], mode: str, n_in: int, n_out: int) -> float | None:
    """The highest QPS up to which every point of the stack meets the SLO for MIN_SHARE of its
    requests; None when even the lowest does not."""
    best = None
    for key in sorted(k for k in share if k[0] == mode and k[2:] == (n_in, n_out)):
        if share[key] < slo_.MIN_SHARE:
            break
        best = key[1]
    return best


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


def summary(points: dict[tuple, list[dict]], stat: str, slo: SloConfig | None = None) -> str:
    modes = sorted({k[0] for k in points}, key=_mode_rank)
    grid = sorted({k[1:] for k in points})
    hw = next(iter(points.values()))[0].get("hardware", {})
    requests = {m: sum(len(r.get("ttfts", ())) for k, runs in points.items() if k[0] == m
                       for r in runs) for m in modes}  # fmt: skip
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
        *stacks(points, modes, requests),
        "",
    ]
    ours = [m for m in KVPUSH_MODES if m in modes]  # each against every other mode
    pairs = [(a, b) for a in ours for b in modes if b not in ours]
    pairs += [p for p in (KVPUSH_MODES[::-1], *PUSH_VS_PULL) if set(p) <= set(modes)]
    for metric in ("ttft", "tpot"):
        key = f"{stat}_{metric}_ms"
        values = {
            k: statistics.fmean(v)
            for k, runs in points.items()
            if (v := [r[key] for r in runs if key in r])
        }
        lines += table(f"{metric.upper()} ({stat} ms)", "ms", modes, grid, values, pairs, "{:.1f}")
    share = shares(points, slo)
    if share:
        percent = {k: 100 * v for k, v in share.items()}
        title = f"SLO attainment (% of requests with {targets(points, slo)})"
        lines += table(title, "%", modes, grid, percent, [], "{:.0f}")
        lines.append(f"Highest QPS at which >= {slo_.MIN_SHARE:.0%} of requests meet both, "
                     "at every rate up to it:")  # fmt: skip
        lines.append("")
        for n_in, n_out in sorted({k[1:] for k in grid}):
            found = [f"{m} {q:g}" if (q := max_qps(share, m, n_in, n_out)) else f"{m} none"
                     for m in modes]  # fmt: skip
            lines.append(f"- input {n_in}, output {n_out}: " + ", ".join(found))
        lines.append("")
        if rate := goodputs(points, share):
            title = "Goodput (requests/s meeting both: attainment x completed requests/s)"
            lines += table(title, "req/s", modes, grid, rate, pairs, "{:.2f}")
    return "\n".join(lines)


def stacks(points: dict[tuple, list[dict]], modes: list[str], requests: dict) -> list[str]:
    """One line per stack: its engines as they ran, the requests measured, prefix-cache hits."""
    out = []
    for mode in modes:
        runs = [r for k, rs in points.items() if k[0] == mode for r in rs]
        engines = next((r["engines"] for r in runs if r.get("engines")), None)
        ran = "; ".join(
            f"{name} ({e['role']}, cores {e['cores']}, {e['executor']} executor)"
            for name, e in engines.items()
        ) if engines else "engines not recorded"  # fmt: skip
        hits = [c["hits"] for r in runs for c in (r.get("prefix_cache") or {}).values()]
        cache = f", prefix-cache hits {sum(hits):.0f} tokens" if hits else ""
        out.append(f"- {mode}: {ran}; {requests[mode]} requests{cache}")
    return out


def table(
    title: str, unit: str, modes: list[str], grid: list[tuple], values: dict[tuple, float],
    pairs: list[tuple[str, str]], fmt: str,
) -> list[str]:  # fmt: skip
    head = ["QPS", "input", "output", *[f"{m} {unit}" for m in modes]]
    head += [f"{a}/{b}" for a, b in pairs]
    lines = [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for qps, n_in, n_out in grid:
        value = {m: values.get((m, qps, n_in, n_out)) for m in modes}
        row = [f"{qps:g}", str(n_in), str(n_out)]
        row += [fmt.format(value[m]) if value[m] is not None else "-" for m in modes]
        for a, b in pairs:
            va, vb = value[a], value[b]
            row.append(f"{va / vb:.2f}" if va is not None and vb else "-")
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def main(results_dir: Path, stat: str = "median", slo: SloConfig | None = None) -> int:
    """`slo`: targets for results that ran without (or instead of theirs)."""
    points = load(results_dir)
    drawn = [figure(points, m, st, results_dir) for m, st in FIGURES]
    extra = (breakdown(points, results_dir), attainment_figure(points, slo, results_dir))
    paths = [p for p in (*drawn, *extra) if p is not None]
    (results_dir / "summary.md").write_text(summary(points, stat, slo))
    for path in [*paths, results_dir / "summary.md"]:
        print(f"wrote {path}")
    return 0
