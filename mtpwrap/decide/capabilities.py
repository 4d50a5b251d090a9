"""What a built llama-server accepts, read from its own `--help` and `--version` (the text;
`mtpwrap.build.probe` runs the binary).

llama.cpp prints every option as a block: the spellings and a value hint on the first line, the
help text indented to column 40 below (or after) it, ending with `(env: NAME)` when the option
also reads an environment variable. Allowed values appear either in the hint
(`[on|off|auto]`, `{none,layer,row}`, `none,draft-simple,...`) or in the help text
(`allowed values: f32, f16, ...`).

Options llama.cpp has removed stay in `--help` ("the argument has been removed") and abort the
server when given, so they are listed in `options` but `has()` is False for them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

HELP_COLUMN = 40
_FLAG_RE = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_VALUE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+\-]*$")
_ENV_RE = re.compile(r"\(env: ([A-Z0-9_]+)\)")
_DEFAULT_RE = re.compile(r"default: *(?:'([^']*)'|([^),\n]+))")
_ALLOWED_RE = re.compile(r"allowed values: *([^\n(]+)")
_BULLET_RE = re.compile(r"^ *- ([A-Za-z0-9][A-Za-z0-9_.+\-]*)(?: \([a-z]+\))?: ")
_VERSION_RE = re.compile(r"version: *(\S+) *\(build (\d+), commit ([0-9a-fA-F]+|unknown)\)")
_BUILT_WITH_RE = re.compile(r"built with (.+)")
_REMOVED = "the argument has been removed"


@dataclass(frozen=True)
class OptionInfo:
    names: tuple[str, ...]
    value_hint: str | None = None
    help: str = ""
    env: str | None = None
    default: str | None = None
    allowed: tuple[str, ...] | None = None
    removed: bool = False
    deprecated: bool = False
    section: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "names": list(self.names),
                "allowed": list(self.allowed) if self.allowed is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OptionInfo:
        allowed = d.get("allowed")
        return cls(
            names=tuple(d["names"]),
            value_hint=d.get("value_hint"),
            help=d.get("help", ""),
            env=d.get("env"),
            default=d.get("default"),
            allowed=tuple(allowed) if allowed is not None else None,
            removed=bool(d.get("removed", False)),
            deprecated=bool(d.get("deprecated", False)),
            section=d.get("section", ""),
        )


@dataclass
class Capabilities:
    """The options of one llama-server binary. `options` holds every spelling listed."""

    infos: list[OptionInfo] = field(default_factory=list)
    version: str | None = None
    build: int | None = None
    commit: str | None = None
    built_with: str | None = None
    binary: str | None = None
    help_sha256: str | None = None
    #: the binary's llama.cpp caps the logits rows a context reserves (`n_outputs_max`, which
    #: upstream 0c1e570's llama_context logs and llama-server sets to slots × (1 + draft
    #: depth)); False: it reserves a whole ubatch (the fork at 0bc0a27); None: not looked at.
    #: `mtpwrap.build.probe` reads it from the binary's own strings.
    outputs_capped: bool | None = None

    def __post_init__(self) -> None:
        self._by_name: dict[str, OptionInfo] = {}
        for info in self.infos:
            for name in info.names:
                self._by_name.setdefault(name, info)

    # -- construction
    @classmethod
    def from_help(cls, help_text: str, version_text: str = "",
                  binary: str | Path | None = None) -> Capabilities:
        infos = parse_help(help_text)
        m = _VERSION_RE.search(version_text) or _VERSION_RE.search(help_text)
        bw = _BUILT_WITH_RE.search(version_text)
        return cls(
            infos=infos,
            version=m.group(1) if m else None,
            build=int(m.group(2)) if m else None,
            commit=m.group(3) if m and m.group(3) != "unknown" else None,
            built_with=bw.group(1).strip() if bw else None,
            binary=str(binary) if binary is not None else None,
            help_sha256=hashlib.sha256(help_text.encode()).hexdigest(),
        )

    # -- queries
    @property
    def options(self) -> set[str]:
        return set(self._by_name)

    def option(self, flag: str) -> OptionInfo | None:
        return self._by_name.get(flag)

    def has(self, flag: str) -> bool:
        """The binary accepts `flag` (listed and not removed)."""
        info = self._by_name.get(flag)
        return info is not None and not info.removed

    def is_removed(self, flag: str) -> bool:
        info = self._by_name.get(flag)
        return info is not None and info.removed

    def allowed(self, flag: str) -> tuple[str, ...] | None:
        """Allowed values of `flag`, in the binary's order; None when it lists none."""
        info = self._by_name.get(flag)
        return info.allowed if info is not None else None

    def env_for(self, flag: str) -> str | None:
        info = self._by_name.get(flag)
        return info.env if info is not None else None

    def default(self, flag: str) -> str | None:
        info = self._by_name.get(flag)
        return info.default if info is not None else None

    def first_of(self, spellings: Iterable[str]) -> str | None:
        """The first spelling in `spellings` this binary accepts."""
        for s in spellings:
            if self.has(s):
                return s
        return None

    def describe(self) -> str:
        """How to name this binary in an error: path and version."""
        who = self.binary or "llama-server"
        if self.version or self.commit:
            return f"{who} (version {self.version or '?'}, commit {self.commit or '?'})"
        return who

    # -- persistence (the build manifest stores this under `capabilities`): every field under
    # its own name, but `infos` as `options`
    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "infos"},
                "options": [i.to_dict() for i in self.infos]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Capabilities:
        return cls(infos=[OptionInfo.from_dict(o) for o in d.get("options") or []],
                   **{f.name: d.get(f.name) for f in fields(cls) if f.name != "infos"})


# --------------------------------------------------------------------------- parsing


def _split_head(line: str) -> tuple[str, str]:
    """An option's first line: (spellings and hint, start of help text)."""
    if len(line) > HELP_COLUMN and line[HELP_COLUMN - 3:HELP_COLUMN] == "   ":
        return line[:HELP_COLUMN].rstrip(), line[HELP_COLUMN:].strip()
    return line.rstrip(), ""


def _parse_head(head: str) -> tuple[list[str], str | None]:
    names: list[str] = []
    tokens = head.split()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        bare = tok[:-1] if tok.endswith(",") else tok
        if not _FLAG_RE.match(bare):
            break
        names.append(bare)
        i += 1
        if not tok.endswith(","):
            break
    hint = " ".join(tokens[i:]) or None
    return names, hint


def _enumerated(text: str) -> tuple[str, ...] | None:
    """`[on|off|auto]`, `{a,b}`, `<0|1>` or `a,b,c` as values; None for `N0,N1,...` and alike."""
    t = text.strip()
    if len(t) >= 2 and t[0] + t[-1] in ("[]", "{}", "<>"):
        t = t[1:-1]
    sep = "|" if "|" in t else ","
    parts = [p.strip() for p in t.split(sep)]
    if len(parts) < 2 or not all(_VALUE_RE.match(p) for p in parts):
        return None
    return tuple(parts)


def _finish(names: list[str], hint: str | None, help_lines: list[str],
            section: str) -> OptionInfo:
    text = "\n".join(help_lines).strip()
    # llama.cpp wraps help at 70 columns, so a value list or a default can span lines.
    flat = " ".join(line.strip() for line in help_lines)
    env_m = _ENV_RE.search(flat)
    allowed: tuple[str, ...] | None = None
    allowed_m = _ALLOWED_RE.search(flat)
    if allowed_m:
        vals = tuple(v.strip() for v in allowed_m.group(1).split(",") if v.strip())
        allowed = vals or None
    elif hint:
        allowed = _enumerated(hint)
    if allowed is None and hint:
        # `-lm, --load-mode MODE` lists its values as "- auto: ...", "- mlock: ..." lines
        bullets = [m.group(1) for m in map(_BULLET_RE.match, help_lines) if m]
        allowed = tuple(bullets) if len(bullets) >= 2 else None
    default: str | None = None
    dm = _DEFAULT_RE.search(flat)
    if dm:
        default = (dm.group(1) if dm.group(1) is not None else dm.group(2)).strip()
    return OptionInfo(
        names=tuple(names),
        value_hint=hint,
        help=text,
        env=env_m.group(1) if env_m else None,
        default=default,
        allowed=allowed,
        removed=_REMOVED in text,
        deprecated=text.upper().startswith("DEPRECATED"),
        section=section,
    )


def parse_help(help_text: str) -> list[OptionInfo]:
    infos: list[OptionInfo] = []
    section = ""
    cur: tuple[list[str], str | None, list[str]] | None = None
    for raw in help_text.splitlines():
        line = raw.rstrip("\n")
        stripped = line.strip()
        if stripped.startswith("-----") and stripped.endswith("-----"):
            if cur:
                infos.append(_finish(*cur, section))
                cur = None
            section = stripped.strip("- ").strip()
            continue
        if line.startswith("-"):
            head, first_help = _split_head(line)
            names, hint = _parse_head(head)
            if names:
                if cur:
                    infos.append(_finish(*cur, section))
                cur = (names, hint, [first_help] if first_help else [])
                continue
        if cur is not None:
            if line.startswith(" " * HELP_COLUMN) or (stripped and line.startswith(" ")):
                cur[2].append(stripped)
            elif not stripped:
                # a blank line inside help text (e.g. after a verbosity table) keeps the block open
                cur[2].append("")
            else:
                infos.append(_finish(*cur, section))
                cur = None
    if cur:
        infos.append(_finish(*cur, section))
    return infos
