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


def test_kvpush_decode_engines_declare_that_they_force_the_first_token(tmp_path):
    from kvpush.launch.engine import EngineSpec

    infos = []
    for role, connector in [("prefill", "kvpush"), ("decode", "kvpush"), ("decode", "nixl-push")]:
        path = tmp_path / f"{role}-{connector}.json"
        path.write_text(json.dumps(EngineSpec(role, "m", 8100, connector=connector).describe()))
        infos += load_engines([str(path)])
    assert [i.forces_first_token for i in infos] == [False, True, False]


def test_the_first_token_capability_and_switch_from_flags():
    from kvpush.cli import build_parser
    from kvpush.proxy.cli import build_config

    argv = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1,forces_first_token=true"]
    config = build_config(build_parser().parse_args(argv))
    assert config.first_token and config.of_role("decode")[0].forces_first_token
    config = build_config(build_parser().parse_args([*argv, "--no-first-token"]))
    assert not config.first_token
    with pytest.raises(ValueError, match="forces_first_token must be true or false, got 'yes'"):
        build_config(build_parser().parse_args([*argv[:-1], "http://d:1,forces_first_token=yes"]))
    with pytest.raises(ValueError, match="forces_first_token must be true or false, got 'yes'"):
        EngineInfo("http://d:1", "decode", forces_first_token="yes")  # type: ignore[arg-type]
