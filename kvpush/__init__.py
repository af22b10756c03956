"""kvpush: push-mode KV-cache transfer for prefill/decode disaggregated vLLM serving."""

__version__ = "0.1.0"
