"""docs/reference/configuration.md, written from the table.

    python -m mtpwrap.config.reference          # rewrite the page
    python -m mtpwrap.config.reference --check  # exit 1 when it is not current
"""

from __future__ import annotations

import sys
from pathlib import Path

from mtpwrap import paths
from mtpwrap.config.options import shown
from mtpwrap.config.table import (
    DEFAULT_CONFIG_FILE,
    REFUSED,
    SECTIONS,
    TOP,
    Key,
    env_name,
    flag_name,
)

TARGET = paths.repo_root() / "docs" / "reference" / "configuration.md"

HEADER = f"""# Configuration reference

Generated from `mtpwrap/config/table.py` by `python -m mtpwrap.config.reference`; do not edit
by hand (`tests/test_config_table.py` fails when this page is not current).

`mtpwrap up` reads each setting from, in this order: its flag, its `MTPWRAP_*` environment
variable, the YAML config file (`--config FILE`, else `{DEFAULT_CONFIG_FILE}` when it
exists), a profile's own `supervisor:` and `proxy:` sections, then the default. An unknown key
is an error naming the file and the key (exit 78), with the closest known key. Values from the
environment and flags are text (`true`/`false`, comma-separated lists); in the file the
`proxy:` section's values must already have their type (`3`, not `"3"`).

Client API keys never go in the config file: `api_key_file` names a file of keys (one per
line, optionally followed by its scopes), and `MTPWRAP_API_KEYS` adds comma-separated ones.
"""

_KINDS = {"str": "text", "int": "integer", "float": "number", "bool": "true/false",
          "tristate": "true/false/auto", "list": "list of text"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(dotted: str, k: Key) -> str:
    kind = k.expect or _KINDS[k.kind] + (f" ({k.unit})" if k.unit else "")
    if k.choices:
        kind = " / ".join(k.choices)
    default = "" if k.default is None else f"`{shown(k)}`"
    return (f"| `{dotted}` | {kind} | {default} | `{env_name(dotted)}` `{flag_name(dotted)}` | "
            f"{_cell(k.help)} |")


def render() -> str:
    out = [HEADER]
    head = "| key | type | default | variable, flag | meaning |\n| --- | --- | --- | --- | --- |"
    out += ["## Top level\n", head, *(_row(name, k) for name, k in TOP.items()), ""]
    for section, keys in SECTIONS.items():
        out += [f"## `{section}:`\n", head,
                *(_row(f"{section}.{name}", k) for name, k in keys.items()), ""]
    out += ["## Refused keys\n", "| key | why |\n| --- | --- |",
            *(f"| `{dotted}` | {_cell(why)} |" for dotted, why in REFUSED.items()), ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is not current: run python -m mtpwrap.config.reference",
                  file=sys.stderr)
            return 1
        return 0
    Path(TARGET).write_text(text, encoding="utf-8")
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
