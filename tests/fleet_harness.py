"""A fleet on loopback, all real: N `mtpwrap up --profile cpu-demo` nodes (real llama-server, demo
model; or another profile) behind the real HAProxy configured by `mtpwrap fleet haproxy`, and
optionally the real Prometheus configured by `mtpwrap fleet prometheus` with the shipped rules.

Used by tests/test_fleet_real.py, benchmarks/fleet_report.py and benchmarks/fleet_routing.py.
"""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from mtpwrap import proc
from mtpwrap.proc import free_loopback_port
from tests.helpers import REPO, Instance, run_cli, wait_for

RULES = REPO / "deploy" / "prometheus" / "mtpwrap-rules.yml"


def answers(url: str, status: int = 200) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == status
    except httpx.HTTPError:
        return False


def chat(base: str, max_tokens: int = 8, text: str = "Say hello.",
         timeout: float = 120, key: str | None = None, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{base}/v1/chat/completions", timeout=timeout, headers=headers, json={
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
        "temperature": 0}, **kw)


def start_haproxy(cfg: Path, log: Path, livez: str, timeout: float = 30) -> proc.Process:
    """HAProxy in the foreground on `cfg`, once its frontend answers `livez`."""
    haproxy = proc.start(["haproxy", "-db", "-f", str(cfg)], stdout=log.open("wb"),
                         stderr=proc.STDOUT)

    def up() -> bool:
        assert haproxy.poll() is None, log.read_text()
        return answers(livez)

    try:
        wait_for("HAProxy answers", up, timeout)
    except BaseException:
        stop(haproxy)
        raise
    return haproxy


def stop(process: proc.Process | None) -> None:
    if process is not None:
        process.stop(10)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


class LocalFleet:
    def __init__(self, work: Path, binary: Path, model: Path, n: int,
                 check_interval_s: float = 1.0, haproxy_args: tuple[str, ...] = (),
                 api_key: str | None = None, profile: str = "cpu-demo",
                 **node_env: str) -> None:
        self.work = work
        #: each node's profile: a name, or a profile file's path (with `threads: 1`: the nodes
        #: share the cores)
        self.profile = profile
        self.names = [f"n{i}" for i in range(1, n + 1)]
        self.nodes: dict[str, Instance] = {}
        self._binary, self._model, self._node_env = binary, model, node_env
        self.check_interval_s = check_interval_s
        self.port = free_loopback_port()
        self.metrics_port = free_loopback_port()
        self.stats_port = free_loopback_port()
        self.haproxy_args = haproxy_args
        #: with a key, every node requires it (MTPWRAP_API_KEYS), Prometheus included.
        self.api_key = api_key
        self.base = f"http://127.0.0.1:{self.port}"
        self.haproxy: proc.Process | None = None
        self.prometheus: proc.Process | None = None
        self.prom_base = ""

    def start(self, timeout: float = 240) -> None:
        for name in self.names:  # all load at once; each waits on its own model load
            self.start_node(name, free_loopback_port())
        for inst in self.nodes.values():
            inst.wait_ready(timeout)
        cfg = self.work / "haproxy.cfg"
        r = run_cli("fleet", "haproxy", *self.node_flags(), "--bind", f"127.0.0.1:{self.port}",
                    "--metrics-bind", f"127.0.0.1:{self.metrics_port}",
                    "--stats-bind", f"127.0.0.1:{self.stats_port}",
                    "--check-interval-s", str(self.check_interval_s), *self.haproxy_args,
                    "--check", "-o", str(cfg))
        assert r.returncode == 0, r.stderr
        self.haproxy = start_haproxy(cfg, self.work / "haproxy.log",
                                     f"{self.base}/haproxy-livez")
        wait_for("HAProxy sees every node UP",
                 lambda: self.haproxy_ok() and all(
                     s.get("status") == "UP" for s in self.servers().values()), 30)

    def start_node(self, name: str, port: int) -> Instance:
        """Start (or start again, on its old home and port) the node `name`."""
        env = {"XDG_CONFIG_HOME": str(self.work / "config"), **self._node_env}
        if self.api_key:
            env["MTPWRAP_API_KEYS"] = self.api_key
        log = self.work / f"{name}.log"
        if log.exists():
            log.rename(log.with_suffix(f".{time.time_ns()}.log"))
        self.nodes[name] = Instance(self.work / name, port, self._binary, self._model, log=log,
                                    profile=self.profile, **env)
        return self.nodes[name]

    def chat(self, **kw: Any) -> httpx.Response:
        """A chat request through HAProxy, with the fleet's key."""
        return chat(self.base, key=self.api_key, **kw)

    def node_flags(self) -> list[str]:
        return [a for name, inst in self.nodes.items()
                for a in ("--node", f"{name}=127.0.0.1:{inst.port}")]

    def haproxy_ok(self) -> bool:
        assert self.haproxy is not None and self.haproxy.poll() is None, (
            (self.work / "haproxy.log").read_text())
        return answers(f"{self.base}/haproxy-livez")

    def servers(self) -> dict[str, dict[str, str]]:
        """HAProxy's own view of each node: its stats CSV rows of the `mtpwrap` backend."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {r["svname"]: r for r in rows
                if r["pxname"] == "mtpwrap" and r["svname"] in self.names}

    def status_of(self, name: str) -> str:
        return self.servers()[name]["status"]

    def start_prometheus(self, scrape_interval_s: float = 1.0,
                         alert_for: dict[str, str] | None = None) -> None:
        """Prometheus on the shipped rules; `alert_for` shortens chosen alerts' `for:` (the
        expressions stay the shipped ones) so that a test sees them fire."""
        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") in (alert_for or {}):
                    rule["for"] = (alert_for or {})[rule["alert"]]
        (self.work / RULES.name).write_text(yaml.safe_dump(rules, sort_keys=False))
        cfg = self.work / "prometheus.yml"
        key = []
        if self.api_key:
            (self.work / "key").write_text(self.api_key + "\n")
            key = ["--key-file", str(self.work / "key")]
        r = run_cli("fleet", "prometheus", *self.node_flags(), *key,
                    "--haproxy-metrics", f"127.0.0.1:{self.metrics_port}",
                    "--scrape-interval-s", str(scrape_interval_s), "-o", str(cfg))
        assert r.returncode == 0, r.stderr
        port = free_loopback_port()
        self.prom_base = f"http://127.0.0.1:{port}"
        self.prometheus = proc.start(
            ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={self.work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=(self.work / "prometheus.log").open("wb"), stderr=proc.STDOUT)
        wait_for("Prometheus ready", lambda: answers(f"{self.prom_base}/-/ready"), 60)

    def prom(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.prom_base}/api/v1/{path}", params=params, timeout=10)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.prom("query", query=expr)["result"]  # type: ignore[no-any-return]

    def close(self) -> None:
        for process in (self.prometheus, self.haproxy):
            stop(process)
        for inst in self.nodes.values():
            inst.close()

    def __enter__(self) -> LocalFleet:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
