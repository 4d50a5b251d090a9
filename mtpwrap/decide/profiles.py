"""Profiles: the intent for one kind of machine, one YAML file each.

A profile says what to run (model, context, KV types with fallbacks, speculation, batch sizes,
slots) and what hardware it is for. It does not say which flags to pass: `launch` maps it onto
what the built llama-server accepts.

Search path, first match by name wins: `MTPWRAP_PROFILES_PATH` (colon-separated folders),
`~/.config/mtpwrap/profiles/`, `/etc/mtpwrap/profiles/`, then the shipped ones (`profiles/` of
the checkout, or `mtpwrap/profiles/` inside the wheel).

Every problem is a `ConfigError` of one line: `FILE: key.path: what was expected, got what`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mtpwrap import paths
from mtpwrap.config.coerce import check_section, convert, unknown_key
from mtpwrap.config.table import COMPANION, COMPANION_REQUIRED, Key
from mtpwrap.config.yamlfile import read_yaml
from mtpwrap.decide.hardware import GpuInfo, HardwareSnapshot
from mtpwrap.decide.profile_types import (
    ClassPolicy,
    Companion,
    HardwareReq,
    KvTypes,
    Profile,
    SpecAdapt,
    Speculation,
)
from mtpwrap.decide.request_class import CLASSES
from mtpwrap.decide.vocab import FLASH_ATTN, KV_TYPES, SPEC_KINDS
from mtpwrap.errors import ConfigError

MAX_CONTEXT = 1 << 24
MAX_DEPTH = 8
#: sections of settings a profile may give (below flags, variables and the config file);
#: checked with the settings' own table.
FREE_SECTIONS = ("supervisor", "proxy")
SYSTEM_PROFILES_DIR = Path("/etc/mtpwrap/profiles")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


# --------------------------------------------------------------------------- the keys
# A profile's single-valued keys are declared as the settings are (`config.table.Key`) and read
# by the one coercer (`config.coerce.convert`, strictly: YAML's 3 is a number, "3" is text).
# The keys that hold lists or choices of shape (context, gpu_layers, kv, spec.policy's entries,
# extra_args, companions) are read below; defaults are the dataclasses' (`profile_types`).


def _between(kind: str, lo: float, hi: float) -> Key:
    what = "an integer" if kind == "int" else "a number"
    return Key(kind, None, check=lambda v: lo <= v <= hi, expect=f"{what} {lo:g}..{hi:g}")


def _regex(value: str) -> bool:
    try:
        re.compile(value)
    except re.error:
        return False
    return True


_TEXT = Key("str", None, check=lambda v: bool(v.strip()), expect="non-empty text")
_LINE = Key("str", None, check=lambda v: bool(v.strip()) and "\n" not in v.strip(),
            expect="one line of text")
_FLAG = Key("bool", None)

PROFILE: dict[str, Key] = {
    "name": Key("str", None, check=lambda v: bool(_NAME_RE.match(v)),
                expect="a name of letters, digits, '.', '_' and '-'"),
    "description": _LINE,
    "model": _TEXT,
    "threads": _between("int", 1, 1024),
    "batch": _between("int", 1, 65536),
    "ubatch": _between("int", 1, 65536),
    "slots": _between("int", 1, 256),
    "flash_attn": Key("str", None, choices=FLASH_ATTN),
    "mlock": _FLAG, "no_warmup": _FLAG, "log_prompts": _FLAG, "allow_rpc": _FLAG,
    "allow_tools": _FLAG,
}
HARDWARE: dict[str, Key] = {
    "requires_gpu": _FLAG,
    "gpu_name": Key("str", None, check=_regex, expect="a regular expression"),
    "min_memory_gib": _between("float", 0.5, 4096),
}
SPEC: dict[str, Key] = {
    "kind": Key("str", None, choices=SPEC_KINDS),
    "depth": _between("int", 1, MAX_DEPTH),
    "p_min": _between("float", 0, 1),
    "draft_model": _TEXT,
    "ngram_n": _between("int", 1, 64),
}
#: spec.policy.<class> as a mapping
CLASS_POLICY: dict[str, Key] = {"depth": _between("int", 0, MAX_DEPTH),
                                "p_min": _between("float", 0, 1)}
SPEC_ADAPT: dict[str, Key] = {
    "enabled": _FLAG,
    "overhead": _between("float", 0.1, 10.0),
    "per_draft": _between("float", 0, 10.0),
    "probe_share": _between("float", 0, 1),
    "half_life_tokens": _between("float", 1, 1e9),
}

TOP_KEYS = (*PROFILE, "context", "hardware", "kv", "spec", "gpu_layers", "extra_args",
            "companions", *FREE_SECTIONS)
REQUIRED_KEYS = ("description", "model", "context")


# --------------------------------------------------------------------------- validation


def show(value: Any) -> str:
    """A YAML value as its author wrote it, for a message."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "a list" if value else "an empty list"
    if isinstance(value, dict):
        return "a mapping"
    return str(value)


class _Doc:
    """One parsed YAML document; every problem is a ConfigError `file: key.path: ...`."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key}: {message}")

    def section(self, value: Any, key: str, allowed: Iterable[str] | None = None
                ) -> Mapping[str, Any]:
        """`value` as a mapping of text keys, each one of `allowed` (when given)."""
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping, got {show(value)}")
        known = None if allowed is None else tuple(allowed)
        for k in value:
            if not isinstance(k, str):
                raise self.fail(key, f"keys must be text, got {show(k)}")
            if known is not None and k not in known:
                raise unknown_key(self.where, f"{key}.{k}" if key else k, known)
        return value

    def values(self, m: Mapping[str, Any], table: Mapping[str, Key], key: str = ""
               ) -> dict[str, Any]:
        """The keys of `table` that `m` gives (null is not given), each through the coercer."""
        out: dict[str, Any] = {}
        for name, k in table.items():
            if m.get(name) is not None:
                value = convert(m[name], k, self.where, f"{key}.{name}" if key else name,
                                strict=True)
                out[name] = value.strip() if isinstance(value, str) else value
        return out

    def kv_list(self, value: Any, key: str) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise self.fail(key, f"expected a KV type or a list of them in preference order, "
                                 f"got {show(value)}")
        out: list[str] = []
        for i, t in enumerate(items):
            if not isinstance(t, str) or t not in KV_TYPES:
                raise self.fail(f"{key}[{i}]", f"must be one of {', '.join(KV_TYPES)}, "
                                               f"got {show(t)}")
            if t in out:
                raise self.fail(f"{key}[{i}]", f"{t} is listed twice")
            out.append(t)
        return tuple(out)

    def kv(self, value: Any, key: str) -> KvTypes:
        m = self.section(value, key, ("k", "v", "why"))
        for part in ("k", "v"):
            if part not in m:
                raise self.fail(f"{key}.{part}", "missing; give the KV types in preference order")
        why = self.values(m, {"why": _LINE}, key).get("why") if m.get("why") else None
        return KvTypes(k=self.kv_list(m["k"], f"{key}.k"), v=self.kv_list(m["v"], f"{key}.v"),
                       why=why)


def _name(doc: _Doc, given: str | None, expected_name: str | None) -> str:
    if given is not None and expected_name is not None and given != expected_name:
        raise doc.fail("name", f"must match the file name {expected_name!r}, got {given!r}")
    name = given or expected_name
    if name is None:
        raise doc.fail("name", "missing (required when the profile is not read from a file)")
    return name


def _hardware(doc: _Doc, raw: Any) -> HardwareReq:
    hw = HardwareReq(**doc.values(doc.section(raw, "hardware", HARDWARE), HARDWARE, "hardware"))
    if not hw.requires_gpu and (hw.gpu_name or hw.min_memory_gib):
        raise doc.fail("hardware.requires_gpu",
                       "is false, so gpu_name and min_memory_gib would never apply")
    return hw


def _context(doc: _Doc, ctx_raw: Any) -> int | str:
    if ctx_raw == "max":
        return "max"
    if isinstance(ctx_raw, int) and not isinstance(ctx_raw, bool):
        if not 256 <= ctx_raw <= MAX_CONTEXT:
            raise doc.fail("context", f"must be 256..{MAX_CONTEXT}, got {ctx_raw}")
        return ctx_raw
    raise doc.fail("context", f"expected a number of tokens 256..{MAX_CONTEXT} or \"max\", "
                              f"got {show(ctx_raw)}")


def _gpu_layers(doc: _Doc, g: Any) -> int | str | None:
    if g is None or g in ("all", "auto"):
        return g
    if isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= 999:
        return g
    raise doc.fail("gpu_layers", f"expected a number of layers 0..999, all or auto, "
                                 f"got {show(g)}")


def _extra_args(doc: _Doc, extra: Any) -> tuple[str, ...]:
    if not isinstance(extra, list):
        raise doc.fail("extra_args", f"expected a list of arguments, got {show(extra)}")
    for i, a in enumerate(extra):
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise doc.fail(f"extra_args[{i}]", f"expected text, got {show(a)}")
    return tuple(str(a) for a in extra)


def validate(data: Any, *, where: str, expected_name: str | None = None) -> Profile:
    """A parsed YAML document → Profile, or ConfigError naming `where` and the key path."""
    doc = _Doc(where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of profile keys at the top, "
                          f"got {show(data)}")
    doc.section(data, "", TOP_KEYS)
    for k in REQUIRED_KEYS:
        if data.get(k) is None:
            raise doc.fail(k, "missing (required)")
    if isinstance(data.get("flash_attn"), bool):  # YAML 1.1 reads a bare on/off as a boolean
        data = {**data, "flash_attn": "on" if data["flash_attn"] else "off"}
    given = doc.values(data, PROFILE)
    name = _name(doc, given.pop("name", None), expected_name)
    batch, ubatch = given.get("batch"), given.get("ubatch")
    if batch is not None and ubatch is not None and ubatch > batch:
        raise doc.fail("ubatch", f"must not exceed batch ({batch}), got {ubatch}")
    free: dict[str, Mapping[str, Any]] = {}
    for section in FREE_SECTIONS:  # keys shared with the settings: the table's checks
        free[section] = (check_section(section, doc.section(data[section], section), where)
                         if section in data else {})
    return Profile(
        name=name, context=_context(doc, data["context"]),
        hardware=_hardware(doc, data["hardware"]) if "hardware" in data else HardwareReq(),
        kv=doc.kv(data["kv"], "kv") if "kv" in data else KvTypes(),
        spec=_speculation(doc, data.get("spec")),
        gpu_layers=_gpu_layers(doc, data.get("gpu_layers")),
        extra_args=_extra_args(doc, data.get("extra_args", [])),
        supervisor=free["supervisor"], proxy=free["proxy"],
        companions=_companions(doc, data.get("companions", [])), source=where, **given,
    )


def _companions(doc: _Doc, raw: Any) -> tuple[Companion, ...]:
    """companions: a list of mappings, each checked with the config table's `COMPANION` keys
    (the one coercer); names are unique, and a reranker pools with rank."""
    if not isinstance(raw, list):
        raise doc.fail("companions", f"expected a list of companion models, got {show(raw)}")
    out: list[Companion] = []
    for i, item in enumerate(raw):
        key = f"companions[{i}]"
        m = doc.section(item, key, COMPANION)
        for k in COMPANION_REQUIRED:
            if m.get(k) is None:
                raise doc.fail(f"{key}.{k}", f"missing (required); {COMPANION[k].help}")
        v = doc.values(m, COMPANION, key)
        role = v["role"]
        if role == "rerank" and v.get("pooling", "rank") != "rank":
            raise doc.fail(f"{key}.pooling", f"a reranker pools with rank (llama-server's "
                           f"--reranking), got {v['pooling']!r}; remove the key")
        if role == "embedding" and v.get("pooling") == "rank":
            raise doc.fail(f"{key}.pooling", "rank pooling scores pairs: it is role rerank's; "
                           "an embedding companion pools with none, mean, cls or last")
        name = v.get("name") or role
        if name == "chat":
            raise doc.fail(f"{key}.name", "chat names the chat model (/readyz?model=chat); "
                           "give the companion another name")
        if any(o.name == name for o in out):
            raise doc.fail(f"{key}.name", f"{name!r} is used by another companion; give each "
                           "a name (clients choose by it with `model`)")
        ubatch = v.get("ubatch")
        if ubatch is not None and ubatch > v.get("context", COMPANION["context"].default):
            raise doc.fail(f"{key}.ubatch", f"must not exceed its context, got {ubatch}")
        if not v["model"]:
            raise doc.fail(f"{key}.model", "expected non-empty text, got ''")
        out.append(Companion(
            name=name, role=role, model=v["model"],
            device=v.get("device", COMPANION["device"].default),
            context=v.get("context", COMPANION["context"].default),
            slots=v.get("slots", COMPANION["slots"].default), threads=v.get("threads"),
            pooling="rank" if role == "rerank" else v.get("pooling"), ubatch=ubatch))
    return tuple(out)


def _speculation(doc: _Doc, raw: Any) -> Speculation:
    if raw is None:
        return Speculation()
    s = doc.section(raw, "spec", (*SPEC, "draft_kv", "policy", "adapt"))
    if s.get("kind") is None:
        raise doc.fail("spec.kind", f"missing; one of {', '.join(SPEC_KINDS)}")
    v = doc.values(s, SPEC, "spec")
    kind = v["kind"]
    if kind == "none":
        extra = [k for k in s if k != "kind"]
        if extra:
            raise doc.fail(f"spec.{extra[0]}", "has no meaning when spec.kind is none")
        return Speculation()
    if "depth" not in v and kind in ("mtp", "draft"):
        raise doc.fail("spec.depth", f"missing; how many tokens to draft, 1..{MAX_DEPTH}")
    if kind == "draft" and "draft_model" not in v:
        raise doc.fail("spec.draft_model", "missing; spec.kind draft needs a draft model")
    if kind != "draft" and "draft_model" in v:
        raise doc.fail("spec.draft_model", f"only applies to spec.kind draft, not {kind}")
    draft_kv = doc.kv(s["draft_kv"], "spec.draft_kv") if s.get("draft_kv") is not None else None
    if draft_kv is not None and kind == "ngram":
        raise doc.fail("spec.draft_kv", "ngram speculation has no draft KV cache")
    if "ngram_n" in v and kind != "ngram":
        raise doc.fail("spec.ngram_n", f"only applies to spec.kind ngram, not {kind}")
    return Speculation(**v, draft_kv=draft_kv, policy=_spec_policy(doc, s.get("policy")),
                       adapt=_spec_adapt(doc, s.get("adapt")))


def to_yaml(profile: Profile) -> dict[str, Any]:
    """The profile as the mapping of YAML keys a hand-written file would have (unset keys and
    empty sections left out); `validate` reads it back to the same profile."""
    def clean(d: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, Mapping):
                v = clean(v)
            if v is None or v == {} or v == []:
                continue
            out[k] = v
        return out

    d = profile.to_dict()
    data = clean({k: v for k, v in d.items() if k in TOP_KEYS})
    if profile.spec.kind == "none":
        data["spec"] = {"kind": "none"}
    return data


def with_overrides(profile: Profile, changes: Mapping[str, Any], *, where: str) -> Profile:
    """`profile` with some YAML keys replaced (`spec` and `kv` as whole sections), validated as
    a profile: how a benchmark cell or a tuned setting derives from a shipped profile."""
    data = {**to_yaml(profile), **changes, "name": profile.name}
    return validate(data, where=where)


def _spec_policy(doc: _Doc, raw: Any) -> tuple[tuple[str, ClassPolicy], ...]:
    """spec.policy: {class: off | depth | {depth, p_min}} for the classes of request_class."""
    if raw is None:
        return ()
    table = doc.section(raw, "spec.policy", CLASSES)
    out: list[tuple[str, ClassPolicy]] = []
    for name in sorted(table):
        key = f"spec.policy.{name}"
        value = table[name]
        if value is False or value == "off":
            out.append((name, ClassPolicy(0)))
        elif isinstance(value, int) and not isinstance(value, bool):
            out.append((name, ClassPolicy(convert(value, CLASS_POLICY["depth"], doc.where, key,
                                                  strict=True))))
        elif isinstance(value, dict):
            m = doc.section(value, key, CLASS_POLICY)
            if m.get("depth") is None:
                raise doc.fail(f"{key}.depth", f"missing; 0 (off) .. {MAX_DEPTH}")
            out.append((name, ClassPolicy(**doc.values(m, CLASS_POLICY, key))))
        else:
            raise doc.fail(key, f"expected off, a depth 0..{MAX_DEPTH} or a mapping with depth "
                           f"(and p_min), got {show(value)}")
    return tuple(out)


def _spec_adapt(doc: _Doc, raw: Any) -> SpecAdapt:
    """spec.adapt: true/false, or a mapping of SpecAdapt's fields (enabled defaults to true)."""
    if raw is None:
        return SpecAdapt()
    if isinstance(raw, bool):
        return SpecAdapt(enabled=raw)
    m = doc.section(raw, "spec.adapt", SPEC_ADAPT)
    return SpecAdapt(**doc.values(m, SPEC_ADAPT, "spec.adapt"))


# --------------------------------------------------------------------------- files


def display_path(path: Path) -> str:
    """`profiles/4090-262k.yaml` for a shipped file, the full path for others."""
    for base in (Path.cwd(), paths.repo_root()):
        try:
            return str(path.resolve().relative_to(base.resolve()))
        except ValueError:
            continue
    return str(path)


def load_file(path: Path) -> Profile:
    where = display_path(path)
    data = read_yaml(path, where, what="profile")
    if data is None:
        raise ConfigError(f"{where}: the file is empty; a profile needs at least "
                          f"{', '.join(REQUIRED_KEYS)}")
    return validate(data, where=where, expected_name=path.stem)


def shipped_dirs() -> list[Path]:
    here = Path(__file__).resolve().parent.parent
    return [here / "profiles", paths.repo_root() / "profiles"]


def search_path() -> list[Path]:
    dirs: list[Path] = []
    env = os.environ.get("MTPWRAP_PROFILES_PATH")
    if env:
        dirs.extend(Path(p).expanduser() for p in env.split(os.pathsep) if p)
    dirs.append(paths.user_config_dir() / "profiles")
    dirs.append(SYSTEM_PROFILES_DIR)
    dirs.extend(shipped_dirs())
    return dirs


def _profile_files(dirs: Iterable[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in dirs:
        if not d.is_dir():
            continue
        for f in sorted([*d.glob("*.yaml"), *d.glob("*.yml")]):
            found.setdefault(f.stem, f)  # earlier folders override later ones by name
    return found


def list_profiles(dirs: Iterable[Path] | None = None) -> list[Profile]:
    files = _profile_files(search_path() if dirs is None else dirs)
    return [load_file(files[name]) for name in sorted(files)]


def load_profile(name_or_path: str | Path, dirs: Iterable[Path] | None = None) -> Profile:
    raw = str(name_or_path)
    p = Path(raw).expanduser()
    if raw.endswith((".yaml", ".yml")) or os.sep in raw:
        if not p.is_file():
            raise ConfigError(f"--profile {raw}: no such profile file.")
        return load_file(p)
    files = _profile_files(search_path() if dirs is None else dirs)
    if raw not in files:
        names = ", ".join(sorted(files)) or "none"
        raise ConfigError(f"--profile {raw}: no such profile; available: {names}.",
                          hint="`mtpwrap profiles list` shows them with their hardware.")
    return load_file(files[raw])


# --------------------------------------------------------------------------- selection


def _rank(p: Profile) -> tuple[int, float, int, str]:
    ctx = p.context if isinstance(p.context, int) else MAX_CONTEXT
    return (1 if p.hardware.gpu_name else 0, p.hardware.min_memory_gib or 0.0, ctx, p.name)


def select_profile(snapshot: HardwareSnapshot,
                   profiles: Iterable[Profile] | None = None) -> tuple[Profile, str]:
    """The best profile for this machine and why. GPU profiles beat CPU ones when a GPU is
    there; among matches, a named GPU beats a generic one, then the larger memory floor, then
    the larger context."""
    candidates = list(list_profiles() if profiles is None else profiles)
    gpu_matches: list[tuple[Profile, GpuInfo]] = []
    for p in candidates:
        if not p.hardware.requires_gpu:
            continue
        for gpu in snapshot.gpus:
            if p.hardware.matches(gpu):
                gpu_matches.append((p, gpu))
                break
    if gpu_matches:
        gpu_matches.sort(key=lambda pg: _rank(pg[0]), reverse=True)
        best, gpu = gpu_matches[0]
        mem = f"{gpu.memory_total_gib:.1f} GiB" if gpu.memory_total_gib is not None else "? GiB"
        reason = f"GPU {gpu.index} {gpu.name} ({mem}) matches {best.hardware.describe()}"
        others = [p.name for p, _ in gpu_matches[1:]]
        if others:
            reason += (f"; preferred over {', '.join(others)} "
                       "(named GPU, then memory floor, then context)")
        return best, reason
    cpu = sorted((p for p in candidates if not p.hardware.requires_gpu), key=_rank, reverse=True)
    if cpu:
        why = snapshot.error or "no GPU profile matches " + ", ".join(
            f"{g.name} ({g.memory_total_gib or 0:.1f} GiB)" for g in snapshot.gpus)
        return cpu[0], f"{why}; {cpu[0].name} needs no GPU"
    have = snapshot.error or ", ".join(
        f"{g.name} ({g.memory_total_gib or 0:.1f} GiB)" for g in snapshot.gpus)
    listing = "; ".join(f"{p.name} ({p.hardware.describe()})" for p in candidates) or "none"
    raise ConfigError(f"no profile matches this machine ({have}); candidates: {listing}.",
                      hint="Choose one with --profile NAME.")


