"""KVPushConnector, loaded by vLLM through `kv_connector_module_path: "kvpush.vllm"`.

The connector, and vLLM with it, is imported when `KVPushConnector` is first looked up, so
that the settings (`config.py`) and a request's parameters (`params.py`) are read without
vLLM: the command line checks `--connector-extra` at once, not after 7-10 s of importing
vLLM.
"""

__all__ = ["KVPushConnector"]


def __getattr__(name: str):
    if name == "KVPushConnector":
        from kvpush.vllm.connector import KVPushConnector

        return KVPushConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
