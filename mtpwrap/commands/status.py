"""`mtpwrap status`: what the running instance is doing."""

from __future__ import annotations

import shlex
import sys

import click

from mtpwrap.config.options import shared_option


@click.command("status")
@shared_option("MTPWRAP_JSON")
def command(as_json: bool) -> None:
    """Report on the running instance: state, uptime, restarts, last exit, profile, URL.

    Exit code 0 while it is ready, 1 while it runs but is not ready, 3 when none runs.
    """
    from mtpwrap import console
    from mtpwrap.supervision import instance

    report = instance.instance_report()
    if as_json:
        console.print_json(report)
    else:
        if not report["running"]:
            console.out.print(f"not running ({report['reason']})", markup=False)
        else:
            rows = [
                ["state", report["state"] + (f" ({report['reason']})" if report["reason"]
                                             else "")],
                ["url", f"{report['url']}/v1"], ["profile", report["profile"]],
                ["model", report["model"]], ["uptime", instance.human_duration(report["uptime_s"])],
                ["restarts", report["restarts"]], ["last exit", report["last_exit"] or "-"],
                ["front", "answering" if report["responding"] else "NOT answering /livez"],
                ["mtpwrap pid", report["pid"]], ["llama-server pid", report["child_pid"] or "-"],
                ["log", report["log_file"]],
            ]
            rl = report.get("reload") or {}
            if rl.get("generation"):
                rows.append([f"last {rl.get('kind', 'reload')}",
                             f"{rl.get('result')}: {rl.get('message') or '-'}"])
            rows.append(["document store", report.get("persist_dir") or "off"])
            if cmd := report.get("command"):
                rows.append(["llama-server runs", shlex.join(cmd["argv"])
                             + (f"  ({cmd['note']})" if cmd.get("note") else "")])
            for c in report.get("companions") or []:
                state = c.get("state", "?") + (f" ({c['reason']})" if c.get("reason") else "")
                rows.append([f"{c['role']} {c['name']}",
                             f"{state}; pid {c.get('pid') or '-'}, restarts "
                             f"{c.get('restarts', 0)}, log {c.get('log_file')}"])
            for k, v in rows:
                console.out.print(f"{k:<17} {v}", markup=False)
    sys.exit(0 if report["running"] and report["state"] == "ready"
             else 1 if report["running"] else 3)
