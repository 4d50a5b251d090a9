"""Rewrite the module map in docs/reference/modules.md from each module's docstring.

    python docs/gen_module_map.py

The map sits between the two `module map` comment lines of docs/reference/modules.md; each row is
the first sentence of the module's docstring, so a module says what it holds where it is defined.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "reference" / "modules.md"
BEGIN, END = "<!-- module map: begin -->", "<!-- module map: end -->"


def layer_order() -> list[str]:
    """The packages and modules bottom layer first, as `make lint`'s layers contract lists them
    (pyproject.toml, top layer first; `a | b` is one layer)."""
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r'type = "layers".*?layers = \[(.*?)\]', text, re.S)
    if block is None:
        raise SystemExit("pyproject.toml: no layers contract under [tool.importlinter]")
    layers = re.findall(r'"([^"]+)"', block.group(1))
    return [name.strip() for layer in reversed(layers) for name in layer.split("|")]


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    para = doc.split("\n\n")[0].replace("\n", " ").strip()
    m = re.match(r"(.+?[.!?])(\s|$)", para)
    return (m.group(1) if m else para).rstrip(".").replace("|", "\\|")


def render() -> str:
    pkg = REPO / "mtpwrap"
    entries = {p.stem: p for p in pkg.iterdir()
               if not p.name.startswith(("_", ".")) and (p.is_dir() or p.suffix == ".py")}
    out: list[str] = []
    order = layer_order()
    for name in [*[n for n in order if n in entries], *sorted(set(entries) - set(order))]:
        path = entries[name]
        if path.is_file():
            if out and out[-1].startswith("|"):
                out.append("")
            out.append(f"- **`mtpwrap/{path.name}`** — {first_sentence(path)}")
            continue
        init = path / "__init__.py"
        out.append(f"\n**`mtpwrap/{name}/`** — {first_sentence(init) if init.exists() else ''}\n")
        out.append("| module | what it holds |\n| --- | --- |")
        for f in sorted(path.rglob("*.py")):
            if f.name != "__init__.py":
                rel = "/".join(f.relative_to(path).with_suffix("").parts)
                out.append(f"| `{rel}` | {first_sentence(f)} |")
    return "\n".join(out).strip()


def main() -> int:
    text = PAGE.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{render()}\n{END}{tail}")
    print(f"wrote the module map of {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
