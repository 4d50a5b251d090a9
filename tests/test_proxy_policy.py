"""The front's pure access rules: settings validation, the path table, key parsing, host parsing."""

from __future__ import annotations

import pytest

from mtpwrap.config.apikeys import key_table, read_keys_file
from mtpwrap.config.objects import ProxyConfig
from mtpwrap.config.settings import load_settings
from mtpwrap.errors import ConfigError
from mtpwrap.front.access import (
    classify,
    derive_allowed_hosts,
    find_key,
    host_of,
    presented_key,
    required_scope,
)


def test_from_mapping_reads_every_kind_of_value():
    cfg = ProxyConfig.from_mapping({
        "api_keys": "key-aaaaaaaa, key-bbbbbbbb", "queue_size": 0, "stream_stall_s": 2,
        "enable_paths": ["slots"], "metrics_public": True, "listen_host": "0.0.0.0",
    }, "mtpwrap.yaml")
    assert cfg.api_keys == ("key-aaaaaaaa", "key-bbbbbbbb")
    assert cfg.queue_size == 0 and cfg.stream_stall_s == 2.0 and cfg.metrics_public is True
    assert ProxyConfig.from_mapping({}, "x") == ProxyConfig()


@pytest.mark.parametrize("data,needle", [
    ({"queue_sise": 3}, "proxy.queue_sise: unknown key"),
    ({"queue_size": "3"}, "proxy.queue_size: expected an integer"),
    ({"queue_size": True}, "proxy.queue_size: expected an integer"),
    ({"queue_size": -1}, "proxy.queue_size: expected an integer >= 0, got -1"),
    ({"max_concurrency": 0}, "proxy.max_concurrency: expected an integer >= 1, got 0"),
    ({"stream_stall_s": "fast"}, "proxy.stream_stall_s: expected a number"),
    ({"metrics_public": "yes"}, "proxy.metrics_public: expected true or false"),
    ({"enable_paths": ["slots", "shell"]}, "each one of slots, slot-actions"),
    ({"enable_paths": [1]}, "expected a list of strings"),
    ({"api_keys": ["short"]}, "at least 8 characters"),
    ({"cors_origins": ["*"]}, "each an exact origin (never `*`), got ['*']"),
    ({"listen_host": 5}, "proxy.listen_host: expected a string"),
])
def test_from_mapping_names_the_file_and_key(data, needle):
    with pytest.raises(ConfigError) as info:
        ProxyConfig.from_mapping(data, "/etc/mtpwrap/mtpwrap.yaml")
    msg = str(info.value)
    assert msg.startswith("/etc/mtpwrap/mtpwrap.yaml: proxy.")
    assert needle in msg


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="c.yaml: proxy: must be a mapping"):
        ProxyConfig.from_mapping(["x"], "c.yaml")  # type: ignore[arg-type]


@pytest.mark.parametrize("method,path,enabled,status,label,up", [
    ("POST", "/v1/chat/completions", (), 0, "/v1/chat/completions", "/v1/chat/completions"),
    ("GET", "/v1/models", (), 0, "/v1/models", "/v1/models"),
    ("HEAD", "/health", (), 0, "/health", "/health"),
    ("GET", "/v1/chat/completions", (), 405, "/v1/chat/completions", ""),
    ("POST", "/slots/3", (), 403, "/slots/{id}", ""),
    ("POST", "/slots/3", ("slot-actions",), 0, "/slots/{id}", "/slots/3"),
    ("GET", "/backend/metrics", ("backend-metrics",), 0, "/backend/metrics", "/metrics"),
    ("GET", "/cors-proxy", (), 404, "other", ""),
    ("POST", "/tools", (), 404, "other", ""),
    ("POST", "/models/load", (), 404, "other", ""),
    ("GET", "/v1/../slots", ("slots",), 404, "other", ""),
    ("GET", "/slots/", ("slots",), 404, "other", ""),
])
def test_classify(method, path, enabled, status, label, up):
    r = classify(method, path.encode(), frozenset(enabled))
    assert (r.status, r.label) == (status, label)
    if status == 0:
        assert r.upstream_path == up


def test_presented_key():
    assert presented_key({"authorization": "Bearer abc"}) == "abc"
    assert presented_key({"authorization": "bearer   abc "}) == "abc"
    assert presented_key({"x-api-key": "abc"}) == "abc"
    assert presented_key({"authorization": "Basic abc", "x-api-key": "abc"}) is None
    assert presented_key({"api-key": "abc"}) is None
    table = key_table(("zzz", "abc inference"), "t")
    assert find_key(None, table) is None
    abc, zzz = find_key("abc", table), find_key("zzz", table)
    assert abc is not None and abc.scopes == frozenset({"inference"})
    assert zzz is not None and zzz.scopes == frozenset({"inference", "admin", "metrics"})
    assert find_key("ab", table) is None


@pytest.mark.parametrize("method,path,scope", [
    ("POST", "/v1/chat/completions", "inference"), ("GET", "/v1/models", "inference"),
    ("GET", "/props", "inference"), ("HEAD", "/health", "inference"),
    ("POST", "/props", "admin"), ("GET", "/slots", "admin"), ("POST", "/slots/3", "admin"),
    ("GET", "/lora-adapters", "admin"), ("POST", "/lora-adapters", "admin"),
    ("GET", "/metrics", "metrics"), ("GET", "/healthz", "metrics"),
    ("GET", "/backend/metrics", "metrics"), ("GET", "/no/such/path", "inference"),
])
def test_required_scope_per_route(method, path, scope):
    assert required_scope(method, path) == scope


def test_every_allow_list_feature_has_a_scope():
    from mtpwrap.config.apikeys import SCOPES
    from mtpwrap.config.table import FEATURES
    from mtpwrap.front.access import _EXACT, FEATURE_SCOPES

    assert set(FEATURE_SCOPES) == {"", *FEATURES} >= set(_EXACT.values())
    assert set(FEATURE_SCOPES.values()) <= set(SCOPES)


def test_scoped_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# ops\nops-key-0123456789   metrics\nadm-key-0123456789 admin, inference\n"
                 "old-key-0123456789\n")
    entries = read_keys_file(str(f), "--api-key-file")
    table = {k.secret: k.scopes for k in key_table(entries, "t")}
    assert table[b"ops-key-0123456789"] == frozenset({"metrics"})
    assert table[b"adm-key-0123456789"] == frozenset({"admin", "inference"})
    assert table[b"old-key-0123456789"] == frozenset({"inference", "admin", "metrics"})
    f.write_text("good-key-0123456789\nsecret-key-0123456789 inference,root\n")
    with pytest.raises(ConfigError) as err:
        read_keys_file(str(f), "--api-key-file")
    assert f"--api-key-file: {f} line 2: unknown scope 'root'" in str(err.value)
    assert "secret-key" not in str(err.value)  # the message never repeats a key
    with pytest.raises(ConfigError, match="listed twice with different fields"):
        ProxyConfig(api_keys=("same-key-0123456789 admin", "same-key-0123456789"))


def test_hosts():
    assert host_of("LocalHost:8080") == "localhost"
    assert host_of("[::1]:80") == "::1"
    assert host_of("::1") == "::1"
    loop = derive_allowed_hosts(ProxyConfig())
    assert loop is not None and "localhost" in loop and "evil.example" not in loop
    explicit = derive_allowed_hosts(ProxyConfig(allowed_hosts=("llm.corp",)))
    assert explicit == frozenset({"llm.corp"})
    assert derive_allowed_hosts(ProxyConfig(allowed_hosts=("*",))) is None
    wide = derive_allowed_hosts(ProxyConfig(listen_host="0.0.0.0"))
    assert wide is not None and "127.0.0.1" in wide and "evil.example" not in wide


def test_api_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# service keys\nkey-from-file-1\n\n  key-from-file-2  \n")
    c = tmp_path / "c.yaml"
    c.write_text(f"api_key_file: {f}\n")
    s = load_settings({}, env={"MTPWRAP_API_KEYS": "inline-key-1"}, config=c)
    cfg = ProxyConfig.from_mapping({"api_keys": list(s.api_keys)}, "c")
    assert cfg.api_keys == ("inline-key-1", "key-from-file-1", "key-from-file-2")
    c.write_text(f"api_key_file: {tmp_path / 'nope'}\n")
    with pytest.raises(ConfigError, match=f"{c}: api_key_file: cannot read"):
        load_settings({}, env={}, config=c)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="MTPWRAP_API_KEY_FILE: .*holds no key"):
        load_settings({}, env={"MTPWRAP_API_KEY_FILE": str(tmp_path / "empty")})
    # the old name in the proxy section says where the setting went
    with pytest.raises(ConfigError, match="proxy.api_keys_file: this setting is api_key_file "
                                          "at the top"):
        ProxyConfig.from_mapping({"api_keys_file": str(f)}, "c")
    c.write_text(f"proxy:\n  api_keys_file: {f}\n")
    with pytest.raises(ConfigError, match=f"{c}: proxy.api_keys_file: this setting is "
                                          "api_key_file at the top"):
        load_settings({}, env={}, config=c)
