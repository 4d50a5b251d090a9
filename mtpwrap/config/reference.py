"""docs/reference/configuration.md and the example config, written from the table.

    python -m mtpwrap.config.reference          # rewrite the page and deploy/mtpwrap.yaml
    python -m mtpwrap.config.reference --check  # exit 1 when either is not current
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from mtpwrap import paths
from mtpwrap.config.options import shown
from mtpwrap.config.table import (
    COMPANION,
    COMPANION_REQUIRED,
    DEFAULT_CONFIG_FILE,
    REFUSED,
    SECTIONS,
    TOP,
    Key,
    env_name,
    flag_name,
)

TARGET = paths.repo_root() / "docs" / "reference" / "configuration.md"
EXAMPLE = paths.repo_root() / "deploy" / "mtpwrap.yaml"

#: values the example config shows instead of the default (set: written uncommented)
EXAMPLE_VALUES: dict[str, tuple[str, bool]] = {
    "api_key_file": ("/etc/mtpwrap/api-keys", True),
    "model": ("/var/lib/mtpwrap/models/Qwen3.6-27B-Q4_K_M-mtp.gguf", False),
    "binary": ("/opt/mtpwrap/build/cuda-sm89/bin/llama-server", False),
    "hw_replay": ("/etc/mtpwrap/hw-recording.json", False),
    "persist.dir": ("/var/lib/mtpwrap/documents", False),
}
#: sections the example leaves commented out (their defaults suit most)
EXAMPLE_QUIET = ("proxy",)

EXAMPLE_HEADER = f"""\
# {DEFAULT_CONFIG_FILE} — read by `mtpwrap up` (or pass --config FILE).
# Generated from mtpwrap/config/table.py by `python -m mtpwrap.config.reference`: every key
# with its default; docs/reference/configuration.md has the same in a table.
# Precedence: command-line flag > MTPWRAP_* environment variable > this file > profile > default.
# Every key has an environment twin: port -> MTPWRAP_PORT, supervisor.wedge_s ->
# MTPWRAP_SUPERVISOR_WEDGE_S. Unknown keys are an error (exit 78), so a typo never goes unnoticed.
"""

HEADER = f"""# Configuration reference

Generated from `mtpwrap/config/table.py` by `python -m mtpwrap.config.reference`; do not edit
by hand (`tests/test_config_table.py` fails when this page is not current). The example config
`deploy/mtpwrap.yaml` is written from the same table.

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


def _companion_row(name: str, k: Key) -> str:
    kind = " / ".join(k.choices) if k.choices else (
        k.expect or _KINDS[k.kind] + (f" ({k.unit})" if k.unit else ""))
    default = "" if k.default is None else f"`{shown(k)}`"
    return f"| `{name}` | {_cell(kind)} | {default} | {_cell(k.help)} |"


def render() -> str:
    out = [HEADER]
    head = "| key | type | default | variable, flag | meaning |\n| --- | --- | --- | --- | --- |"
    out += ["## Top level\n", head, *(_row(name, k) for name, k in TOP.items()), ""]
    for section, keys in SECTIONS.items():
        out += [f"## `{section}:`\n", head,
                *(_row(f"{section}.{name}", k) for name, k in keys.items()), ""]
    out += ["## A profile's `companions:`\n",
            "Each item of a profile's `companions:` list is an embedding or rerank model served "
            "by its own llama-server next to the chat model (docs/operations/companions.md). "
            "These are profile keys only: no variable, no flag. Required: "
            + ", ".join(f"`{k}`" for k in COMPANION_REQUIRED) + ".\n",
            "| key | type | default | meaning |\n| --- | --- | --- | --- |",
            *(_companion_row(name, k) for name, k in COMPANION.items()), ""]
    out += ["## Refused keys\n", "| key | why |\n| --- | --- |",
            *(f"| `{dotted}` | {_cell(why)} |" for dotted, why in REFUSED.items()), ""]
    return "\n".join(out)


def _yaml_value(k: Key) -> str:
    value = shown(k)
    if k.kind == "list":
        return "[" + ", ".join(k.default) + "]"
    return value


def _example_key(dotted: str, k: Key, indent: str, quiet: bool) -> list[str]:
    name = dotted.rpartition(".")[2]
    value, on = EXAMPLE_VALUES.get(dotted, (None if k.default is None else _yaml_value(k),
                                            not quiet))
    lines = [f"{indent}# {line}" for line in textwrap.wrap(k.help, 96 - len(indent))]
    line = f"{name}: {value}" if value is not None else f"{name}:"
    lines.append(f"{indent}{line}" if on and value is not None else f"{indent}# {line}")
    return lines


def render_example() -> str:
    """deploy/mtpwrap.yaml: every key with its help and default."""
    out = [EXAMPLE_HEADER]
    for name, k in TOP.items():
        out += _example_key(name, k, "", False)
    for section, keys in SECTIONS.items():
        out += ["", f"{section}:"]
        for name, k in keys.items():
            out += _example_key(f"{section}.{name}", k, "  ", section in EXAMPLE_QUIET)
    return "\n".join(out) + "\n"


def generated() -> dict[Path, str]:
    return {TARGET: render(), EXAMPLE: render_example()}


def main(argv: list[str]) -> int:
    stale = 0
    for target, text in generated().items():
        if "--check" in argv:
            current = target.read_text(encoding="utf-8") if target.exists() else ""
            if current != text:
                print(f"{target} is not current: run python -m mtpwrap.config.reference",
                      file=sys.stderr)
                stale += 1
            continue
        Path(target).write_text(text, encoding="utf-8")
        print(f"wrote {target}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
