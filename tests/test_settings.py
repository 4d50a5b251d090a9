"""Settings layering (flag > MTPWRAP_* > config file > default) and the errors bad input gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpwrap.config.settings import load_settings
from mtpwrap.errors import EXIT_CONFIG, ConfigError
from tests.helpers import cli_env, run_cli


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "mtpwrap.yaml"
    p.write_text(text)
    return p


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    cfg = write(tmp_path, "port: 9001\nhost: 0.0.0.0\ndrain_s: 12\n"
                          "supervisor:\n  backoff_max_s: 7\n  max_failures: 9\n")
    env = {"MTPWRAP_PORT": "9002", "MTPWRAP_SUPERVISOR_MAX_FAILURES": "3"}
    s = load_settings({"port": "9003"}, env=env, config=cfg)
    assert s.port == 9003 and s.sources["port"] == "--port"
    s = load_settings({}, env=env, config=cfg)
    assert s.port == 9002 and s.sources["port"] == "MTPWRAP_PORT"
    assert s.host == "0.0.0.0" and s.sources["host"] == str(cfg)
    assert s.drain_s == 12.0
    assert s.supervisor["backoff_max_s"] == 7.0
    assert s.supervisor["max_failures"] == 3  # env beats the file inside sections too
    assert s.supervisor["stop_grace_s"] == 10.0
    assert s.sources["supervisor.stop_grace_s"] == "default"
    s = load_settings({}, env={}, config=None)
    assert s.port == 8080 and s.profile == "auto" and s.config_file is None


@pytest.mark.parametrize("text, fragment", [
    ("prot: 9000\n", "prot: unknown key. Did you mean 'port'?"),
    ("supervisor:\n  bakoff_max_s: 3\n", "supervisor.bakoff_max_s: unknown key. "
                                          "Did you mean 'backoff_max_s'?"),
    ("port: 70000\n", "port: expected an integer 1..65535, got 70000"),
    ("port: eighty\n", "port: expected an integer 1..65535, got 'eighty'"),
    ("supervisor:\n  oom_step_down: maybe\n",
     "supervisor.oom_step_down: expected true, false or auto"),
    ("supervisor:\n  exit_on_failed: sometimes\n",
     "supervisor.exit_on_failed: expected true, false or auto, got 'sometimes'"),
    ("supervisor: 5\n", "supervisor: expected a mapping, got int"),
    ("- a\n- b\n", "expected a mapping of keys at the top, got list"),
    ("port: [1\n", "not valid YAML"),
    ("proxy:\n  api_keys: [abc]\n", "proxy.api_keys: keys do not belong in the config file"),
])
def test_bad_config_file_names_file_and_key(tmp_path: Path, text: str, fragment: str) -> None:
    cfg = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_settings({}, env={}, config=cfg)
    assert fragment in str(err.value)
    assert str(cfg) in str(err.value)
    assert err.value.exit_code == EXIT_CONFIG


def test_exit_on_failed_is_auto_unless_set(tmp_path: Path) -> None:
    assert load_settings({}, env={}).supervisor["exit_on_failed"] == "auto"
    cfg = write(tmp_path, "supervisor:\n  exit_on_failed: true\n")
    assert load_settings({}, env={}, config=cfg).supervisor["exit_on_failed"] is True
    env = {"MTPWRAP_SUPERVISOR_EXIT_ON_FAILED": "Auto"}
    auto = load_settings({}, env=env, config=cfg).supervisor
    assert auto["exit_on_failed"] == "auto"
    # auto: exit when the supervisor gives up only where systemd's restart policy takes over
    from mtpwrap.config.objects import exit_on_failed

    assert exit_on_failed(auto["exit_on_failed"], under_systemd=True) is True
    assert exit_on_failed(auto["exit_on_failed"], under_systemd=False) is False
    told = load_settings({}, env={}, config=cfg).supervisor
    assert exit_on_failed(told["exit_on_failed"], under_systemd=False) is True


def test_bad_env_and_flag_values_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^MTPWRAP_SUPERVISOR_WEDGE_S: supervisor.wedge_s: "
                                          r"expected a number of seconds >= 0"):
        load_settings({}, env={"MTPWRAP_SUPERVISOR_WEDGE_S": "-1"})
    with pytest.raises(ConfigError, match=r"^--drain-s: drain_s: expected"):
        load_settings({"drain_s": "soon"}, env={})
    with pytest.raises(ConfigError, match="--config .*nope.yaml: no such file"):
        load_settings({}, env={}, config=tmp_path / "nope.yaml")


def test_api_keys_from_env_and_file_never_from_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk-file-1\n\nk-file-2\n")
    cfg = write(tmp_path, f"api_key_file: {keys}\nproxy:\n  queue_size: 4\n")
    s = load_settings({}, env={"MTPWRAP_API_KEYS": "k-env, k-file-1"}, config=cfg)
    assert s.api_keys == ("k-env", "k-file-1", "k-file-2")
    assert s.proxy == {"queue_size": 4}  # only what was set: the profile's section fills in
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="--api-key-file: .*holds no key"):
        load_settings({"api_key_file": str(empty)}, env={})


def test_cli_reports_config_errors_in_one_sentence_with_exit_78(tmp_path: Path) -> None:
    cfg = write(tmp_path, "supervisor:\n  max_failure: 3\n")
    r = run_cli("up", "--config", str(cfg), env=cli_env(MTPWRAP_HOME=str(tmp_path / "h")))
    assert r.returncode == EXIT_CONFIG
    assert "supervisor.max_failure: unknown key" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") <= 3
    r = run_cli("up", "--port", "0", env=cli_env(MTPWRAP_HOME=str(tmp_path / "h")))
    assert r.returncode == EXIT_CONFIG and "--port: port: expected an integer 1..65535" in r.stderr


def test_missing_model_is_one_sentence_and_nothing_starts(tmp_path: Path) -> None:
    from tests.helpers import REPO

    fake = REPO / "tests" / "fakes" / "fake_llama_server.py"
    home = tmp_path / "h"
    r = run_cli("up", "--binary", str(fake), "--model", str(tmp_path / "missing.gguf"),
                "--port", "18999", env=cli_env(MTPWRAP_HOME=str(home)))
    assert r.returncode == EXIT_CONFIG
    assert "missing.gguf" in r.stderr and "Traceback" not in r.stderr
    assert not (home / "state" / "instance.json").exists()
    model = tmp_path / "m.gguf"  # here, so nothing is fetched before the binary is checked
    model.write_bytes(b"GGUF")
    r = run_cli("up", "--binary", str(tmp_path / "nope"), "--model", str(model),
                env=cli_env(MTPWRAP_HOME=str(home)))
    assert r.returncode == EXIT_CONFIG and "nope" in r.stderr


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_an_open_front_needs_keys_or_the_operators_word(host: str) -> None:
    from mtpwrap.service.startup import check_open_listen

    with pytest.raises(ConfigError, match=rf"--host {host}: .*no API keys .*--allow-open-listen"):
        check_open_listen(load_settings({"host": host}, env={}))
    check_open_listen(load_settings({"host": host, "allow_open_listen": "true"}, env={}))
    check_open_listen(load_settings({"host": host}, env={"MTPWRAP_API_KEYS": "k" * 20}))
    for loopback in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        check_open_listen(load_settings({"host": loopback}, env={}))


def test_up_on_an_open_address_without_keys_exits_78_and_starts_nothing(tmp_path: Path) -> None:
    """`up --host 0.0.0.0` with no keys: one sentence naming the flag (or variable, or file),
    exit 78, no instance file; with --allow-open-listen true the launch goes on (here to the
    next check, the missing model)."""
    from mtpwrap.proc import free_loopback_port
    from tests.helpers import REPO

    fake = REPO / "tests" / "fakes" / "fake_llama_server.py"
    home = tmp_path / "h"
    port = free_loopback_port()
    common = ("--binary", str(fake), "--model", str(tmp_path / "missing.gguf"), "--port",
              str(port))
    r = run_cli("up", "--host", "0.0.0.0", *common, env=cli_env(MTPWRAP_HOME=str(home)))
    assert r.returncode == EXIT_CONFIG, r.stderr
    assert "--host 0.0.0.0: the front would listen beyond loopback with no API keys" \
        in r.stderr and "--allow-open-listen true" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") <= 3
    assert not (home / "state" / "instance.json").exists()
    cfg = write(tmp_path, "host: 0.0.0.0\n")
    r = run_cli("up", "--config", str(cfg), *common, env=cli_env(MTPWRAP_HOME=str(home)))
    assert r.returncode == EXIT_CONFIG and f"{cfg}: host 0.0.0.0: the front" in r.stderr
    r = run_cli("up", *common, env=cli_env(MTPWRAP_HOME=str(home), MTPWRAP_HOST="::"))
    assert r.returncode == EXIT_CONFIG and "MTPWRAP_HOST=::: the front" in r.stderr
    r = run_cli("up", "--host", "0.0.0.0", "--allow-open-listen", "true", *common,
                env=cli_env(MTPWRAP_HOME=str(home)))
    assert r.returncode == EXIT_CONFIG and "missing.gguf" in r.stderr
    assert "loopback" not in r.stderr
