from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model():
    """The embedded model, built once into the kvpush cache (as `kvpush up` would)."""
    from kvpush.launch import tinymodel

    return tinymodel.ensure()


@pytest.fixture(scope="session")
def prompt_source(tiny_model):
    """Fresh prompts for the benchmark tests, new in every session: the shared engines have
    seen none of them."""
    from kvpush.bench.prompts import PromptSource, new_seed

    return PromptSource(str(tiny_model), new_seed())
