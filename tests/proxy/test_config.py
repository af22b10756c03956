"""The proxy's configuration refuses what it does not understand, naming it."""

from __future__ import annotations

import json

import pytest

from kvpush.proxy.config import EngineInfo, ProxyConfig, load_engines, load_file


def test_an_unknown_engine_key_is_refused_by_name(tmp_path):
    path = tmp_path / "engines.yaml"
    path.write_text("engines:\n  - {url: 'http://h:1', role: prefill, side_chanel_port: 5}\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['side_chanel_port'\].*accepted"):
        load_file(str(path))


def test_an_unknown_setting_is_refused_by_name(tmp_path):
    path = tmp_path / "proxy.toml"
    path.write_text('polcy = "round-robin"\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['polcy'\]"):
        load_file(str(path))


def test_an_engine_description_from_kvpush_serve_loads(tmp_path):
    from kvpush.launch.engine import EngineSpec

    path = tmp_path / "p.json"
    path.write_text(json.dumps(EngineSpec("prefill", "m", 8100, engine_id="p0").describe()))
    (info,) = load_engines([str(path)])
    assert info.engine_id == "p0" and info.connector == "kvpush"


def test_an_engine_running_another_connector_is_refused():
    engines = (
        EngineInfo("http://p:1", "prefill", connector="nixl-pull"),
        EngineInfo("http://d:1", "decode"),
    )
    with pytest.raises(ValueError, match="runs connector 'nixl-pull', the proxy 'kvpush'"):
        ProxyConfig(engines=engines)
