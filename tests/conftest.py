from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model():
    """The embedded model, built once into the kvpush cache (as `kvpush up` would)."""
    from kvpush.launch import tinymodel

    return tinymodel.ensure()
