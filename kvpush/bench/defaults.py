"""`kvpush bench serve`'s default grid, the headline of docs/benchmarks.md (about 20 minutes on
a 2-core host a round; the page's run had --rounds 2). Plain values, so `kvpush --help`
imports nothing heavy."""

MODES = ("kvpush", "mono", "mono-mp", "replicas")
QPS = (1.0, 2.0, 3.0, 4.0)
INPUT_LENS = (2048,)
OUTPUT_LENS = (32,)
NUM_PROMPTS = 48  # a point; with --rounds 2, 96 requests a point and stack
# Goodput's targets, sized for the tiny model on CPU (one plain engine: TTFT ~130 ms, TPOT
# ~4 ms at 1 QPS); set your own for your model and hardware.
SLO_TTFT_MS = 500.0
SLO_TPOT_MS = 8.0


def csv(values: tuple) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
