"""`mtpwrap fleet`: configuration for several mtpwrap nodes behind one load balancer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from mtpwrap.config.options import shared_option

_SPEC = "HOST:PORT[,slots=N][,weight=W]"


def _nodes(f: Callable[..., None]) -> Callable[..., None]:
    """NODE arguments, repeatable --node and --inventory FILE: together, the fleet's nodes."""
    f = click.option(
        "--inventory", type=click.Path(dir_okay=False, path_type=Path),
        envvar="MTPWRAP_FLEET_INVENTORY",
        help="YAML file listing the nodes, each with host, port, slots, weight and an optional "
             "name.")(f)
    f = click.option(
        "--node", "node_flags", multiple=True, envvar="MTPWRAP_FLEET_NODES",
        metavar=f"[NAME=]{_SPEC}",
        help="A node, as a NODE argument; repeatable. [env: MTPWRAP_FLEET_NODES, separated by "
             "spaces]")(f)
    return click.argument("nodes", nargs=-1, metavar="NODE...")(f)


_OUTPUT = click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
    help="Write to this file instead of stdout.")


def _emit(text: str, output: Path | None) -> None:
    from mtpwrap import console

    if output is None:
        console.out.print(text, markup=False, end="")
        return
    output.write_text(text)
    console.info(f"wrote {output}")


@click.group("fleet")
def command() -> None:
    """Configuration for a fleet of mtpwrap nodes: HAProxy in front, Prometheus watching."""


@command.command("haproxy")
@_nodes
@click.option("--bind", default="127.0.0.1:8000", envvar="MTPWRAP_FLEET_BIND",
              show_default=True, help="Where clients reach the fleet.")
@shared_option("MTPWRAP_FLEET_METRICS_BIND")
@click.option("--stats-bind", default="127.0.0.1:8405", envvar="MTPWRAP_FLEET_STATS_BIND",
              show_default=True,
              help="HAProxy's stats page (/stats), on loopback only; 'none' for none.")
@click.option("--tls-cert", type=click.Path(dir_okay=False, path_type=Path),
              envvar="MTPWRAP_FLEET_TLS_CERT",
              help="PEM file (certificate, then private key): clients reach the fleet by HTTPS.")
@click.option("--affinity-header", metavar="NAME", default="X-OpenWebUI-Chat-Id", show_default=True,
              envvar="MTPWRAP_FLEET_AFFINITY_HEADER", help="Header naming a chat: its "
              "questions go back to the node that read its document; 'none': leastconn alone.")
@click.option("--admin-socket", type=click.Path(path_type=Path),
              envvar="MTPWRAP_FLEET_ADMIN_SOCKET",
              help="UNIX socket for HAProxy's runtime API (drain a node by hand).")
@click.option("--check-host", default="localhost", envvar="MTPWRAP_FLEET_CHECK_HOST",
              show_default=True,
              help="Host header of the /readyz checks; must be in the nodes' proxy.allowed_hosts "
                   "when those are set.")
@click.option("--check-interval-s", type=float, default=1.0, show_default=True,
              envvar="MTPWRAP_FLEET_CHECK_INTERVAL_S", help="Seconds between /readyz checks.")
@click.option("--fall", type=int, default=2, show_default=True, envvar="MTPWRAP_FLEET_FALL",
              help="Failed checks before a node leaves the rotation.")
@click.option("--rise", type=int, default=2, show_default=True, envvar="MTPWRAP_FLEET_RISE",
              help="Passed checks before a node rejoins it.")
@click.option("--max-per-node", type=int, default=8, show_default=True,
              envvar="MTPWRAP_FLEET_MAX_PER_NODE",
              help="Open requests per node before HAProxy queues (0 = no limit), for nodes "
                   "without slots=N; the node's profile slots (-np) is the right value.")
@click.option("--retries", type=int, default=1, show_default=True, envvar="MTPWRAP_FLEET_RETRIES",
              help="Retries on another node of a request no node began to answer.")
@click.option("--server-timeout-s", type=float, default=600.0, show_default=True,
              envvar="MTPWRAP_FLEET_SERVER_TIMEOUT_S",
              help="Longest silence from a node (a non-streamed long generation).")
@click.option("--check", is_flag=True, envvar="MTPWRAP_FLEET_CHECK",
              help="Validate the result with `haproxy -c` before writing it.")
@_OUTPUT
def haproxy(nodes: tuple[str, ...], node_flags: tuple[str, ...], inventory: Path | None,
            bind: str, metrics_bind: str, stats_bind: str,
            tls_cert: Path | None, affinity_header: str, admin_socket: Path | None,
            check_host: str, check_interval_s: float, fall: int, rise: int, max_per_node: int,
            retries: int, server_timeout_s: float, check: bool, output: Path | None) -> None:
    """Print haproxy.cfg that spreads requests over the nodes by their /readyz.

    Each NODE is [NAME=]HOST:PORT[,slots=N][,weight=W] (a node's front): slots, the requests
    it serves at once, becomes its maxconn (else --max-per-node); weight, its share of new
    requests. --inventory gives the nodes in a YAML file instead.

    A chat (--affinity-header) goes back to its node; nodes loading, restarting or draining
    get no new requests; a refused connection, a connection closed unanswered, or a node's own
    503 is retried once on another node; nothing that reached llama-server is.
    """
    from mtpwrap.front import fleet

    opts = fleet.HaproxyOptions(
        bind=bind, metrics_bind=None if metrics_bind.lower() == "none" else metrics_bind,
        stats_bind=None if stats_bind.lower() == "none" else stats_bind, tls_cert=tls_cert,
        affinity_header=None if affinity_header.lower() == "none" else affinity_header,
        admin_socket=admin_socket, check_host=check_host,
        check_interval_s=check_interval_s, fall=fall, rise=rise, max_per_node=max_per_node,
        retries=retries, server_timeout_s=server_timeout_s)
    text = fleet.render_haproxy(fleet.parse_nodes(node_flags + nodes, inventory), opts)
    if check:
        fleet.check_haproxy(text)
    _emit(text, output)


@command.command("prometheus")
@_nodes
@shared_option("MTPWRAP_FLEET_METRICS_BIND", "--haproxy-metrics",
               help="HAProxy's exporter to scrape too; 'none' to skip it.")
@click.option("--scrape-interval-s", type=float, default=15.0, show_default=True,
              envvar="MTPWRAP_FLEET_SCRAPE_INTERVAL_S", help="Scrape and rule interval.")
@click.option("--rules", "rule_files", multiple=True, default=("mtpwrap-rules.yml",),
              show_default=True, help="Rule files to load (deploy/prometheus/ has the "
              "project's); relative to the written file.")
@click.option("--key-file", type=click.Path(path_type=Path), envvar="MTPWRAP_FLEET_KEY_FILE",
              help="File with an API key, when the nodes' /metrics needs one.")
@_OUTPUT
def prometheus(nodes: tuple[str, ...], node_flags: tuple[str, ...], inventory: Path | None,
               haproxy_metrics: str, scrape_interval_s: float,
               rule_files: tuple[str, ...], key_file: Path | None, output: Path | None) -> None:
    """Print prometheus.yml scraping every node (label `node`) and HAProxy."""
    from mtpwrap.front import fleet

    opts = fleet.PrometheusOptions(
        scrape_interval_s=scrape_interval_s, rule_files=rule_files, key_file=key_file,
        haproxy_metrics=None if haproxy_metrics.lower() == "none" else haproxy_metrics)
    _emit(fleet.render_prometheus(fleet.parse_nodes(node_flags + nodes, inventory), opts), output)
