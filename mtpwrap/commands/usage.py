"""`mtpwrap usage`: the audit trail summed per key, day or route."""

from __future__ import annotations

import datetime as dt
import re

import click


def _since(text: str | None) -> str | None:
    """A YYYY-MM-DD day, or N days back (`7d`), as the first day to read."""
    if text is None:
        return None
    if m := re.fullmatch(r"(\d{1,4})d", text.strip()):
        day = dt.datetime.now(dt.timezone.utc).date() - dt.timedelta(days=int(m.group(1)))
        return day.isoformat()
    try:
        return dt.date.fromisoformat(text.strip()).isoformat()
    except ValueError:
        raise click.BadParameter(f"expected a day as YYYY-MM-DD or a number of days back "
                                 f"such as 7d, got {text!r}", param_hint="--since") from None


@click.command("usage")
@click.option("--since", help="First day to count: YYYY-MM-DD, or days back such as 7d "
                              "(default: everything the audit trail keeps).")
@click.option("--by", "by", type=click.Choice(["key", "day", "route"]), default="key",
              show_default=True, help="What the totals are per.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--config", type=click.Path(dir_okay=False), default=None,
              help="The config file whose audit.dir to read (default: as `up` finds it).")
def command(since: str | None, by: str, as_json: bool, config: str | None) -> None:
    """Requests, refusals, tokens and bytes per key, day or route, summed from the audit
    trail's files (audit.sink: file). Prompts and answers are never in it."""
    from mtpwrap import console
    from mtpwrap.config.objects import AuditConfig
    from mtpwrap.config.settings import load_settings
    from mtpwrap.front.audit import SUMS, read_records, summarize

    first = _since(since)
    cfg = AuditConfig(**load_settings({}, config=config).audit)
    rows = summarize(read_records(cfg.directory, first), by)
    if as_json:
        console.print_json({"dir": str(cfg.directory), "since": first, "by": by,
                            "rows": rows})
        return
    if not rows:
        console.info(f"no audit records in {cfg.directory}"
                     + (f" since {first}" if first else ""))
        return
    columns = [by, *SUMS]
    console.table(f"usage by {by} ({cfg.directory})", columns,
                  [[r[c] for c in columns] for r in rows])
