"""`mtpwrap args`: the llama-server command line a profile gives on this binary and machine."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from mtpwrap.config.options import setting_option, shared_option


@click.command("args")
@setting_option("profile", "profile_name")
@setting_option("model")
@setting_option("binary")
@setting_option("hw_replay", "--hw-replay", "--replay", "replay")
@click.option("--port", type=int, envvar="MTPWRAP_UPSTREAM_PORT",
              help="Internal port to show in the command line; loopback TCP only, for a "
                   "binary that cannot bind a UNIX socket (otherwise the socket is shown).")
@click.option("--no-plan", "no_plan", is_flag=True,
              help="As `up --no-plan`: no memory plan, so nothing is refused for memory.")
@click.option("--running", is_flag=True,
              help="The command the running instance's llama-server was started with (after "
                   "any step-down, deferred plan or reload), from its state file, instead of "
                   "the profile's.")
@shared_option("MTPWRAP_JSON")
def command(profile_name: str, model: str | None, binary: str | None, replay: str | None,
            port: int | None, no_plan: bool, running: bool, as_json: bool) -> None:
    """Print the llama-server command line for a profile, and why each flag is there."""
    import dataclasses

    from mtpwrap import console
    from mtpwrap.service.startup import upstream_endpoint
    from mtpwrap.supervision import inputs

    if running:
        _print_running(as_json)
        return

    inp = inputs.gather(profile_name, model=model, binary=binary, replay=replay, fetch=False)
    # a model that is not here cannot be planned: the preview shows the argv without a plan
    here = Path(inp.model).is_file()
    r = inputs.resolve_inputs(inp, plan=False if no_plan or not here else None)
    listen = upstream_endpoint(r)
    spec = r.render(endpoint=dataclasses.replace(listen, port=port) if listen.socket is None
                    else listen)
    warnings = [*inp.warnings, *spec.warnings]
    assert inp.caps is not None
    companions = [(c, r.render(cfg=c.launch, endpoint=upstream_endpoint(r, c.name)))
                  for c in r.companions]
    if as_json:
        console.print_json({**spec.to_dict(), "profile_reason": inp.profile_reason,
                            "warnings": warnings, "binary": inp.caps.describe(),
                            "memory_plan": r.memory_text,
                            "companions": [{**c.to_dict(), **cs.to_dict()}
                                           for c, cs in companions]})
        return
    console.out.print(f"# profile {inp.profile.name}: {inp.profile_reason}", markup=False)
    console.out.print(f"# binary {inp.caps.describe()}", markup=False)
    if r.memory_text:
        console.out.print(f"# memory plan {r.memory_text}", markup=False)
    console.out.print(shlex.join(spec.argv), markup=False)
    console.out.print("")
    width = max((len(d.flag) for d in spec.decisions), default=0)
    for d in spec.decisions:
        value = f" {d.value}" if d.value is not None else ""
        console.out.print(f"  {(d.flag + value):<{width + 12}}  {d.reason}", markup=False)
    for c, cs in companions:
        console.out.print("")
        console.out.print(f"# companion {c.name} ({c.role}, {c.companion.device}): memory "
                          f"{c.plan_text}", markup=False)
        console.out.print(shlex.join(cs.argv), markup=False)
        for d in cs.decisions:
            value = f" {d.value}" if d.value is not None else ""
            console.out.print(f"  {(d.flag + value):<{width + 12}}  {d.reason}", markup=False)
    for w in warnings:
        console.warn(w)


def _print_running(as_json: bool) -> None:
    """The running llama-server's command, as the instance's state file records it."""
    from mtpwrap import console
    from mtpwrap.errors import RuntimeFailure
    from mtpwrap.supervision import instance

    report = instance.instance_report()
    if not report["running"]:
        raise RuntimeFailure(f"--running: no mtpwrap instance is running ({report['reason']}).",
                             hint="Start one with `mtpwrap up`, or leave out --running for the "
                                  "profile's command line.")
    cmd = report.get("command")
    if cmd is None:
        raise RuntimeFailure(f"--running: llama-server is not running now ({report['state']}"
                             f"{': ' + report['reason'] if report.get('reason') else ''}).")
    if as_json:
        console.print_json(cmd)
        return
    if cmd.get("note"):
        console.out.print(f"# {cmd['note']}", markup=False)
    env = " ".join(f"{k}={v}" for k, v in cmd.get("env", {}).items())
    console.out.print((env + " " if env else "") + shlex.join(cmd["argv"]), markup=False)
    console.out.print("")
    for line in cmd.get("decisions", []):
        console.out.print(f"  {line}", markup=False)
