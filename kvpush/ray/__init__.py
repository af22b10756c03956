"""kvpush on Ray Serve LLM: its connector backend (backend.py) and a P/D app (app.py).

An optional extra (`pip install kvpush[ray]`); nothing here imports Ray until it is used.
Ray's connector-backend registry is internal (`ray.llm._internal`), so kvpush runs with the
Ray version it is tested with and refuses another with a clear message.
"""

from __future__ import annotations

RAY_VERSION = "2.60.0"  # the version kvpush.ray is tested with (pyproject's `ray` extra)


class RayUnavailable(RuntimeError):
    """Ray is not installed, or not the version kvpush.ray is tested with."""


def check_ray() -> None:
    try:
        import ray
    except ImportError as e:
        raise RayUnavailable(
            f"kvpush's Ray Serve app needs ray[serve]=={RAY_VERSION}: "
            "pip install 'kvpush[ray]' (or `make test-ray`, which builds it)"
        ) from e
    if ray.__version__ != RAY_VERSION:
        raise RayUnavailable(
            f"kvpush's Ray Serve backend is tested with Ray {RAY_VERSION}, found "
            f"{ray.__version__}: it registers through Ray's internal connector-backend "
            f"registry (ray.llm._internal), which may differ; pip install "
            f"'ray[serve]=={RAY_VERSION}'"
        )
