"""`make demo`: the local stack, push vs pull TTFT side by side."""

from __future__ import annotations


def main() -> int:
    print(
        "kvpush demo: not yet. The local stack (`kvpush up`) and the proxy are still being built;\n"
        "the transfer engine is ready: try `kvpush bench transfer --quick`."
    )
    return 0
