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
from mtpwrap.config.coerce import check_section, convert
from mtpwrap.config.table import COMPANION, COMPANION_REQUIRED
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


# --------------------------------------------------------------------------- validation


class _Checker:
    """Reads one parsed YAML document, raising ConfigError with `file: key.path: ...`."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key}: {message}")

    @staticmethod
    def show(value: Any) -> str:
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

    def keys(self, data: Mapping[str, Any], key: str, allowed: Iterable[str]) -> None:
        allowed = tuple(allowed)
        for k in data:
            if k not in allowed:
                path = f"{key}.{k}" if key else str(k)
                raise self.fail(path, f"unknown key; allowed keys: {', '.join(allowed)}")

    def mapping(self, value: Any, key: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping, got {self.show(value)}")
        for k in value:
            if not isinstance(k, str):
                raise self.fail(key, f"keys must be text, got {self.show(k)}")
        return value

    def string(self, value: Any, key: str, *, one_line: bool = False) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(key, f"expected non-empty text, got {self.show(value)}")
        if one_line and "\n" in value.strip():
            raise self.fail(key, "expected one line of text, got several lines")
        return value.strip()

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {self.show(value)}")
        return value

    def integer(self, value: Any, key: str, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected a whole number {lo}..{hi}, got {self.show(value)}")
        if not lo <= value <= hi:
            raise self.fail(key, f"must be {lo}..{hi}, got {value}")
        return value

    def number(self, value: Any, key: str, lo: float, hi: float) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"expected a number {lo:g}..{hi:g}, got {self.show(value)}")
        if not lo <= value <= hi:
            raise self.fail(key, f"must be {lo:g}..{hi:g}, got {value:g}")
        return float(value)

    def choice(self, value: Any, key: str, choices: Iterable[str]) -> str:
        choices = tuple(choices)
        if not isinstance(value, str) or value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}, got {self.show(value)}")
        return value

    def kv_list(self, value: Any, key: str) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise self.fail(key, f"expected a KV type or a list of them in preference order, "
                                 f"got {self.show(value)}")
        out: list[str] = []
        for i, t in enumerate(items):
            if not isinstance(t, str) or t not in KV_TYPES:
                raise self.fail(f"{key}[{i}]", f"must be one of {', '.join(KV_TYPES)}, "
                                               f"got {self.show(t)}")
            if t in out:
                raise self.fail(f"{key}[{i}]", f"{t} is listed twice")
            out.append(t)
        return tuple(out)

    def kv(self, value: Any, key: str) -> KvTypes:
        m = self.mapping(value, key)
        self.keys(m, key, ("k", "v", "why"))
        for part in ("k", "v"):
            if part not in m:
                raise self.fail(f"{key}.{part}", "missing; give the KV types in preference order")
        why = self.string(m["why"], f"{key}.why", one_line=True) if m.get("why") else None
        return KvTypes(k=self.kv_list(m["k"], f"{key}.k"), v=self.kv_list(m["v"], f"{key}.v"),
                       why=why)


TOP_KEYS = (
    "name", "description", "hardware", "model", "context", "kv", "spec", "gpu_layers", "threads",
    "batch", "ubatch", "slots", "flash_attn", "mlock", "no_warmup", "extra_args",
    "log_prompts", "allow_rpc", "allow_tools", "companions", *FREE_SECTIONS,
)
REQUIRED_KEYS = ("description", "model", "context")


def _name(c: _Checker, data: dict[str, Any], expected_name: str | None) -> str:
    name = expected_name
    if "name" in data:
        name = c.string(data["name"], "name")
        if not _NAME_RE.match(name):
            raise c.fail("name", f"letters, digits, '.', '_' and '-' only, got {name!r}")
        if expected_name is not None and name != expected_name:
            raise c.fail("name", f"must match the file name {expected_name!r}, got {name!r}")
    if name is None:
        raise c.fail("name", "missing (required when the profile is not read from a file)")
    return name


def _hardware(c: _Checker, raw: Any) -> HardwareReq:
    h = c.mapping(raw, "hardware")
    c.keys(h, "hardware", ("requires_gpu", "gpu_name", "min_memory_gib"))
    requires_gpu = c.boolean(h.get("requires_gpu", True), "hardware.requires_gpu")
    gpu_name = None
    if h.get("gpu_name") is not None:
        gpu_name = c.string(h["gpu_name"], "hardware.gpu_name")
        try:
            re.compile(gpu_name)
        except re.error as exc:
            raise c.fail("hardware.gpu_name",
                         f"expected a regular expression, got {gpu_name!r} ({exc})") from exc
    min_mem = None
    if h.get("min_memory_gib") is not None:
        min_mem = c.number(h["min_memory_gib"], "hardware.min_memory_gib", 0.5, 4096)
    if not requires_gpu and (gpu_name or min_mem):
        raise c.fail("hardware.requires_gpu",
                     "is false, so gpu_name and min_memory_gib would never apply")
    return HardwareReq(requires_gpu=requires_gpu, gpu_name=gpu_name, min_memory_gib=min_mem)


def _context(c: _Checker, ctx_raw: Any) -> int | str:
    if ctx_raw == "max":
        return "max"
    if isinstance(ctx_raw, int) and not isinstance(ctx_raw, bool):
        return c.integer(ctx_raw, "context", 256, MAX_CONTEXT)
    raise c.fail("context", f"expected a number of tokens 256..{MAX_CONTEXT} or \"max\", "
                            f"got {c.show(ctx_raw)}")


def _gpu_layers(c: _Checker, g: Any) -> int | str | None:
    if g is None:
        return None
    if isinstance(g, str):
        return c.choice(g, "gpu_layers", ("all", "auto"))
    return c.integer(g, "gpu_layers", 0, 999)


def _batches(c: _Checker, data: dict[str, Any]) -> tuple[int | None, int | None, int | None, int]:
    """(threads, batch, ubatch, slots)."""
    threads = (None if data.get("threads") is None
               else c.integer(data["threads"], "threads", 1, 1024))
    batch = None if data.get("batch") is None else c.integer(data["batch"], "batch", 1, 65536)
    ubatch = None if data.get("ubatch") is None else c.integer(data["ubatch"], "ubatch", 1, 65536)
    if batch is not None and ubatch is not None and ubatch > batch:
        raise c.fail("ubatch", f"must not exceed batch ({batch}), got {ubatch}")
    return threads, batch, ubatch, c.integer(data.get("slots", 1), "slots", 1, 256)


def _extra_args(c: _Checker, extra: Any) -> tuple[str, ...]:
    if not isinstance(extra, list):
        raise c.fail("extra_args", f"expected a list of arguments, got {c.show(extra)}")
    for i, a in enumerate(extra):
        if isinstance(a, bool) or not isinstance(a, (str, int, float)):
            raise c.fail(f"extra_args[{i}]", f"expected text, got {c.show(a)}")
    return tuple(str(a) for a in extra)


def validate(data: Any, *, where: str, expected_name: str | None = None) -> Profile:
    """A parsed YAML document → Profile, or ConfigError naming `where` and the key path."""
    c = _Checker(where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of profile keys at the top, "
                          f"got {c.show(data)}")
    c.keys(data, "", TOP_KEYS)
    for k in REQUIRED_KEYS:
        if k not in data:
            raise c.fail(k, "missing (required)")
    name = _name(c, data, expected_name)
    hw = _hardware(c, data["hardware"]) if "hardware" in data else HardwareReq()
    model = c.string(data["model"], "model")
    context = _context(c, data["context"])
    kv = c.kv(data["kv"], "kv") if "kv" in data else KvTypes()
    spec = _speculation(c, data.get("spec"))
    gpu_layers = _gpu_layers(c, data.get("gpu_layers"))
    threads, batch, ubatch, slots = _batches(c, data)

    fa_raw = data.get("flash_attn", "auto")
    if isinstance(fa_raw, bool):  # YAML 1.1 reads a bare on/off as a boolean
        fa_raw = "on" if fa_raw else "off"
    flash_attn = c.choice(fa_raw, "flash_attn", FLASH_ATTN)
    flags = {k: c.boolean(data.get(k, False), k)
             for k in ("mlock", "no_warmup", "log_prompts", "allow_rpc", "allow_tools")}
    extra = _extra_args(c, data.get("extra_args", []))
    free: dict[str, Mapping[str, Any]] = {}
    for section in FREE_SECTIONS:  # keys shared with the settings: the table's checks
        free[section] = (check_section(section, c.mapping(data[section], section), where)
                         if section in data else {})

    companions = _companions(c, data.get("companions", []))
    return Profile(
        name=name, description=c.string(data["description"], "description", one_line=True),
        model=model, context=context, hardware=hw, kv=kv, spec=spec, gpu_layers=gpu_layers,
        threads=threads, batch=batch, ubatch=ubatch, slots=slots, flash_attn=flash_attn,
        extra_args=extra, supervisor=free["supervisor"], proxy=free["proxy"],
        companions=companions, source=where, **flags,
    )


def _companions(c: _Checker, raw: Any) -> tuple[Companion, ...]:
    """companions: a list of mappings, each checked with the config table's `COMPANION` keys
    (the one coercer); names are unique, and a reranker pools with rank."""
    if not isinstance(raw, list):
        raise c.fail("companions", f"expected a list of companion models, got {c.show(raw)}")
    out: list[Companion] = []
    for i, item in enumerate(raw):
        key = f"companions[{i}]"
        m = c.mapping(item, key)
        c.keys(m, key, COMPANION)
        for k in COMPANION_REQUIRED:
            if m.get(k) is None:
                raise c.fail(f"{key}.{k}", f"missing (required); {COMPANION[k].help}")
        v = {k: convert(m[k], COMPANION[k], c.where, f"{key}.{k}", strict=True)
             for k in COMPANION if m.get(k) is not None}
        role = v["role"]
        if role == "rerank" and v.get("pooling", "rank") != "rank":
            raise c.fail(f"{key}.pooling", f"a reranker pools with rank (llama-server's "
                         f"--reranking), got {v['pooling']!r}; remove the key")
        if role == "embedding" and v.get("pooling") == "rank":
            raise c.fail(f"{key}.pooling", "rank pooling scores pairs: it is role rerank's; "
                         "an embedding companion pools with none, mean, cls or last")
        name = v.get("name") or role
        if name == "chat":
            raise c.fail(f"{key}.name", "chat names the chat model (/readyz?model=chat); give "
                         "the companion another name")
        if any(o.name == name for o in out):
            raise c.fail(f"{key}.name", f"{name!r} is used by another companion; give each "
                         "a name (clients choose by it with `model`)")
        ubatch = v.get("ubatch")
        if ubatch is not None and ubatch > v.get("context", COMPANION["context"].default):
            raise c.fail(f"{key}.ubatch", f"must not exceed its context, got {ubatch}")
        out.append(Companion(
            name=name, role=role, model=c.string(v["model"], f"{key}.model"),
            device=v.get("device", COMPANION["device"].default),
            context=v.get("context", COMPANION["context"].default),
            slots=v.get("slots", COMPANION["slots"].default), threads=v.get("threads"),
            pooling="rank" if role == "rerank" else v.get("pooling"), ubatch=ubatch))
    return tuple(out)


def _speculation(c: _Checker, raw: Any) -> Speculation:
    if raw is None:
        return Speculation()
    s = c.mapping(raw, "spec")
    c.keys(s, "spec", ("kind", "depth", "p_min", "draft_model", "draft_kv", "ngram_n",
                       "policy", "adapt"))
    if "kind" not in s:
        raise c.fail("spec.kind", f"missing; one of {', '.join(SPEC_KINDS)}")
    kind = c.choice(s["kind"], "spec.kind", SPEC_KINDS)
    if kind == "none":
        extra = [k for k in s if k != "kind"]
        if extra:
            raise c.fail(f"spec.{extra[0]}", "has no meaning when spec.kind is none")
        return Speculation()
    depth = None
    if s.get("depth") is not None:
        depth = c.integer(s["depth"], "spec.depth", 1, MAX_DEPTH)
    elif kind in ("mtp", "draft"):
        raise c.fail("spec.depth", f"missing; how many tokens to draft, 1..{MAX_DEPTH}")
    p_min = None if s.get("p_min") is None else c.number(s["p_min"], "spec.p_min", 0.0, 1.0)
    draft_model = None
    if kind == "draft":
        if s.get("draft_model") is None:
            raise c.fail("spec.draft_model", "missing; spec.kind draft needs a draft model")
        draft_model = c.string(s["draft_model"], "spec.draft_model")
    elif s.get("draft_model") is not None:
        raise c.fail("spec.draft_model", f"only applies to spec.kind draft, not {kind}")
    draft_kv = c.kv(s["draft_kv"], "spec.draft_kv") if s.get("draft_kv") is not None else None
    if draft_kv is not None and kind == "ngram":
        raise c.fail("spec.draft_kv", "ngram speculation has no draft KV cache")
    ngram_n = None
    if s.get("ngram_n") is not None:
        if kind != "ngram":
            raise c.fail("spec.ngram_n", f"only applies to spec.kind ngram, not {kind}")
        ngram_n = c.integer(s["ngram_n"], "spec.ngram_n", 1, 64)
    return Speculation(kind=kind, depth=depth, p_min=p_min, draft_model=draft_model,
                       draft_kv=draft_kv, ngram_n=ngram_n,
                       policy=_spec_policy(c, s.get("policy")),
                       adapt=_spec_adapt(c, s.get("adapt")))


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


def _spec_policy(c: _Checker, raw: Any) -> tuple[tuple[str, ClassPolicy], ...]:
    """spec.policy: {class: off | depth | {depth, p_min}} for the classes of request_class."""

    if raw is None:
        return ()
    table = c.mapping(raw, "spec.policy")
    c.keys(table, "spec.policy", CLASSES)
    out: list[tuple[str, ClassPolicy]] = []
    for name in sorted(table):
        key = f"spec.policy.{name}"
        value = table[name]
        if value is False or value == "off":
            out.append((name, ClassPolicy(0)))
        elif isinstance(value, int) and not isinstance(value, bool):
            out.append((name, ClassPolicy(c.integer(value, key, 0, MAX_DEPTH))))
        elif isinstance(value, dict):
            c.keys(value, key, ("depth", "p_min"))
            if "depth" not in value:
                raise c.fail(f"{key}.depth", f"missing; 0 (off) .. {MAX_DEPTH}")
            p_min = (None if value.get("p_min") is None
                     else c.number(value["p_min"], f"{key}.p_min", 0.0, 1.0))
            out.append((name, ClassPolicy(c.integer(value["depth"], f"{key}.depth", 0,
                                                    MAX_DEPTH), p_min)))
        else:
            raise c.fail(key, f"expected off, a depth 0..{MAX_DEPTH} or a mapping with depth "
                         f"(and p_min), got {c.show(value)}")
    return tuple(out)


def _spec_adapt(c: _Checker, raw: Any) -> SpecAdapt:
    """spec.adapt: true/false, or a mapping of SpecAdapt's fields (enabled defaults to true)."""
    if raw is None:
        return SpecAdapt()
    if isinstance(raw, bool):
        return SpecAdapt(enabled=raw)
    m = c.mapping(raw, "spec.adapt")
    c.keys(m, "spec.adapt", ("enabled", "overhead", "per_draft", "probe_share",
                             "half_life_tokens"))
    d = SpecAdapt()
    return SpecAdapt(
        enabled=d.enabled if "enabled" not in m else c.boolean(m["enabled"], "spec.adapt.enabled"),
        overhead=d.overhead if "overhead" not in m
        else c.number(m["overhead"], "spec.adapt.overhead", 0.1, 10.0),
        per_draft=d.per_draft if "per_draft" not in m
        else c.number(m["per_draft"], "spec.adapt.per_draft", 0.0, 10.0),
        probe_share=d.probe_share if "probe_share" not in m
        else c.number(m["probe_share"], "spec.adapt.probe_share", 0.0, 1.0),
        half_life_tokens=d.half_life_tokens if "half_life_tokens" not in m
        else c.number(m["half_life_tokens"], "spec.adapt.half_life_tokens", 1.0, 1e9))


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


