"""`mtpwrap fleet`: what it writes is accepted by the real HAProxy and Prometheus tools, bad input
gets one sentence and exit 78, and the shipped alert rules behave as promtool evaluates them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, require_tool, run_cli

RULES = REPO / "deploy" / "prometheus" / "mtpwrap-rules.yml"
RULES_TEST = REPO / "deploy" / "prometheus" / "mtpwrap-rules.test.yml"


def test_haproxy_config_passes_haproxy_check(tmp_path: Path) -> None:
    require_tool("haproxy", "haproxy")
    out = tmp_path / "haproxy.cfg"
    r = run_cli("fleet", "haproxy", "--node", "gpu1=127.0.0.1:8081", "--node", "[::1]:8082",
                "--admin-socket", str(tmp_path / "admin.sock"), "--check-interval-s", "0.5",
                "--check", "-o", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "server gpu1 127.0.0.1:8081" in text and "server node2 [::1]:8082" in text
    assert "inter 500ms" in text
    check = subprocess.run(["haproxy", "-c", "-f", str(out)], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0 and "WARNING" not in check.stderr, check.stderr


def test_haproxy_check_reports_what_haproxy_rejects(tmp_path: Path) -> None:
    require_tool("haproxy", "haproxy")
    from mtpwrap import fleet
    from mtpwrap.errors import ConfigError

    text = fleet.render_haproxy(fleet.parse_nodes(["127.0.0.1:8081"]), fleet.HaproxyOptions())
    fleet.check_haproxy(text)
    with pytest.raises(ConfigError, match="haproxy -c rejected.*balance"):
        fleet.check_haproxy(text.replace("balance leastconn", "balance fewest"))


def test_check_without_haproxy_says_what_to_install(tmp_path: Path) -> None:
    python_only = tmp_path / "bin"
    python_only.mkdir()
    r = run_cli("fleet", "haproxy", "--node", "127.0.0.1:8081", "--check",
                env=cli_env(PATH=str(python_only)))
    assert r.returncode == 69 and "apt-get install haproxy" in r.stderr, r.stderr


@pytest.mark.parametrize(("args", "needle"), [
    ([], "no nodes"),
    (["--node", "10.0.0.5"], "--node '10.0.0.5': expected HOST:PORT"),
    (["--node", "10.0.0.5:99999"], "port from 1 to 65535"),
    (["--node", "a=10.0.0.5:1", "--node", "a=10.0.0.6:1"], "the name 'a' is given twice"),
    (["--node", "10.0.0.5:1", "--node", "x=10.0.0.5:1"], "the address '10.0.0.5:1' is given"),
    (["--node", "bad name=10.0.0.5:1"], "the name 'bad name' must be"),
    (["--node", "10.0.0.5:1", "--fall", "0"], "--fall: must be at least 1, got 0"),
    (["--node", "10.0.0.5:1", "--bind", "8000"], "--bind '8000': expected HOST:PORT"),
])
def test_bad_input_is_one_sentence_and_exit_78(args: list[str], needle: str) -> None:
    r = run_cli("fleet", "haproxy", *args)
    assert r.returncode == 78, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_nodes_from_the_environment() -> None:
    r = run_cli("fleet", "haproxy", env=cli_env(
        MTPWRAP_FLEET_NODES="a=127.0.0.1:8081 b=127.0.0.1:8082"))
    assert r.returncode == 0, r.stderr
    assert "server a 127.0.0.1:8081" in r.stdout and "server b 127.0.0.1:8082" in r.stdout


def test_prometheus_config_and_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / "key").write_text("k\n")
    out = tmp_path / "prometheus.yml"
    r = run_cli("fleet", "prometheus", "--node", "a=127.0.0.1:8081", "--node",
                "b=127.0.0.1:8082", "--scrape-interval-s", "5", "--key-file",
                str(tmp_path / "key"), "-o", str(out))
    assert r.returncode == 0, r.stderr
    check = subprocess.run([promtool, "check", "config", str(out)], capture_output=True,
                           text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # promtool followed rule_files to the shipped rules and loaded them.
    assert f"{RULES.name}\n  SUCCESS:" in check.stdout, check.stdout


def test_alert_rules_behave_as_specified() -> None:
    promtool = require_tool("promtool", "prometheus")
    r = subprocess.run([promtool, "test", "rules", RULES_TEST.name], cwd=RULES_TEST.parent,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
