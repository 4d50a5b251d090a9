"""The one launch: a typed, frozen `LaunchConfig` chosen from profile + capabilities + hardware,
and rendered once into llama-server's argv and environment.

The flag spellings and the KV and speculation vocabularies live in `vocab`. `choose` decides
(each choice with its reason), `render` spells, `step_down` makes cheaper variants after
out-of-memory starts — all on `LaunchConfig`, never on argv strings.

Only flags the built binary lists are emitted; a flag it lacks is a ConfigError naming the flag
and the binary. Flags llama.cpp has removed (`--draft`, `--draft-n`, `--draft-max`,
`--draft-min`) still appear in its `--help` and abort the server, so they are never emitted,
not even from `extra_args`.

Secrets never go into argv (visible in `ps` to every user): the internal API key travels in the
environment variable the binary names for `--api-key` (`LLAMA_API_KEY`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide import kv
from mtpwrap.decide.vocab import (
    CONTEXT_FLOOR,
    DEFAULT_VERBOSITY,
    DEPTH_FLAGS,
    FULL_PRECISION_KV,
    KV_TYPES,
    NGRAM_N_FLAGS,
    RESERVED,
    SPEC_TYPES,
    SPELLINGS,
    STEP_KV_TYPES,
    VERBOSE,
    VERBOSITY,
)
from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.hardware import HardwareSnapshot
    from mtpwrap.decide.profiles import Profile

@dataclass(frozen=True)
class Decision:
    flag: str
    value: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value, "reason": self.reason}


@dataclass(frozen=True)
class LaunchConfig:
    """What llama-server is asked to do, independent of how one binary spells it."""

    profile: str
    model: str
    context: int  #: tokens; 0 = the model's trained length
    cache_k: str
    cache_v: str
    slots: int = 1
    spec: str = "none"  #: kind: mtp | draft | ngram | none
    spec_type: str | None = None  #: the binary's name for that kind
    depth: int | None = None
    p_min: float | None = None
    ngram_n: int | None = None
    draft_model: str | None = None
    draft_k: str | None = None
    draft_v: str | None = None
    gpu_layers: int | str | None = None
    threads: int | None = None
    batch: int | None = None
    ubatch: int | None = None
    flash_attn: str = "auto"
    mlock: bool = False
    no_warmup: bool = False
    verbosity: int | None = None
    log_prompts: bool = False  #: the profile allows logging what users send (-v, -lv > 3)
    allow_rpc: bool = False  #: the profile allows --rpc (unauthenticated remote backends)
    kv_unified: bool | None = None  #: None: llama.cpp's default (unified when slots > 1)
    repack: bool | None = None  #: CPU weight repacking; None: llama.cpp's default (on)
    fit: str | None = None  #: llama.cpp's --fit on|off; None: its default
    extra_args: tuple[str, ...] = ()
    #: field name → why it has its value (shown by `mtpwrap args`)
    why: tuple[tuple[str, str], ...] = ()
    warnings: tuple[str, ...] = ()
    note: str | None = None  #: set by step_down

    def reason(self, name: str) -> str:
        return next((r for k, r in reversed(self.why) if k == name), "")

    def replace(self, why: Mapping[str, str] | None = None, **changes: Any) -> LaunchConfig:
        """A copy with `changes`, each with its reason in `why`."""
        return dataclasses.replace(self, **changes, why=self.why + tuple((why or {}).items()))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["why"] = dict(self.why)
        d["extra_args"] = list(self.extra_args)
        d["warnings"] = list(self.warnings)
        return d


@dataclass
class RenderedLaunch:
    """A LaunchConfig rendered for one binary, host and port."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    profile: str | None = None
    #: environment names whose values are secrets (shown as "***" by to_dict()).
    secret_env: frozenset[str] = frozenset()

    def to_dict(self, *, reveal: bool = False) -> dict[str, Any]:
        env = {k: (v if reveal or k not in self.secret_env else "***")
               for k, v in self.env.items()}
        return {
            "profile": self.profile,
            "argv": list(self.argv),
            "env": env,
            "decisions": [d.to_dict() for d in self.decisions],
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- choosing


def choose(profile: Profile, caps: Capabilities | None, snapshot: HardwareSnapshot | None, *,
           model: Path | str, draft_model: Path | str | None = None,
           sized_types: Collection[str] | None = None) -> LaunchConfig:
    """The launch a profile asks for on this binary (`caps`) and machine.

    Without a binary (`caps` None: planning for a machine that is not this one), each KV list
    gives its first type with a known size (`sized_types`), and speculation its first spec type.
    A profile's `context: max` gives 0 here; the memory plan sets it (see `resolve`).
    """
    why: dict[str, str] = {}
    warnings: list[str] = []
    _check_hardware(profile, snapshot, warnings)

    why["model"] = f"model of profile {profile.name} ({profile.model})"
    if profile.context == "max":
        context = 0
        why["context"] = ("context: max and no memory plan given; 0 = the model's trained "
                          "length, and llama.cpp's --fit will not shrink it")
    else:
        assert isinstance(profile.context, int)
        context = profile.context
        why["context"] = "context from the profile"

    ngl = profile.gpu_layers
    if ngl is not None:
        why["gpu_layers"] = "GPU layers from the profile"
        if snapshot is not None and not snapshot.has_gpu and ngl not in (0, "auto"):
            warnings.append(f"gpu_layers {ngl} but no GPU here ({snapshot.error}); using 0")
            ngl = 0
            why["gpu_layers"] = "no GPU: everything stays on the CPU"

    slots = profile.slots
    why["slots"] = "slots from the profile"
    if profile.spec.kind == "mtp":
        if slots != 1:
            warnings.append(f"profile asks for {slots} slots, but MTP speculation serves one; "
                            "using 1")
        slots = 1
        why["slots"] = "MTP speculation drafts for a single sequence, so one slot"
    for name, what in (("batch", "logical batch from the profile"),
                       ("ubatch", "physical batch from the profile; small at long context "
                                  "keeps the compute buffer small"),
                       ("threads", "threads from the profile")):
        if getattr(profile, name) is not None:
            why[name] = what

    k = _pick_kv(caps, "cache_k", profile.kv.k, "K", sized_types, warnings)
    v = _pick_kv(caps, "cache_v", profile.kv.v, "V", sized_types, warnings)
    why["cache_k"] = "K cache type: first of the profile's list this binary offers"
    why["cache_v"] = "V cache type: first of the profile's list this binary offers"

    fa = profile.flash_attn
    why["flash_attn"] = "flash attention from the profile"
    if v not in FULL_PRECISION_KV:
        if fa == "off":
            warnings.append(f"profile turns flash attention off, but a quantized V cache ({v}) "
                            "needs it; turning it on")
        why["flash_attn"] = (f"flash attention from the profile; the quantized V cache ({v}) "
                             "needs it too" if fa == "on"
                             else f"quantized V cache ({v}) needs flash attention")
        fa = "on"
    if caps is not None:
        fa_flag = _flag(caps, "flash_attn", "the profile sets flash attention")
        allowed_fa = caps.allowed(fa_flag)
        if allowed_fa is not None and fa not in allowed_fa:
            raise ConfigError(f"{fa_flag}: {caps.describe()} does not accept {fa!r} "
                              f"(allows {', '.join(allowed_fa)}).")

    cfg = LaunchConfig(
        profile=profile.name, model=str(model), context=context, cache_k=k, cache_v=v,
        slots=slots, gpu_layers=ngl, threads=profile.threads, batch=profile.batch,
        ubatch=profile.ubatch, flash_attn=fa, mlock=profile.mlock, no_warmup=profile.no_warmup,
        extra_args=tuple(profile.extra_args), log_prompts=profile.log_prompts,
        allow_rpc=profile.allow_rpc)
    if profile.mlock:
        why["mlock"] = "keep the weights in RAM (profile: mlock)"
    if profile.no_warmup:
        why["no_warmup"] = "skip the empty warm-up run (profile: no_warmup)"
    if profile.extra_args:
        why["extra_args"] = "profile extra_args, passed through"
    cfg = _speculation(cfg, profile, caps, draft_model, sized_types, why, warnings)
    if caps is not None:
        check_extra(caps, "profile extra_args", cfg.extra_args)
    warnings += check_exposure("profile extra_args", cfg.extra_args,
                               log_prompts=cfg.log_prompts, allow_rpc=cfg.allow_rpc)
    return dataclasses.replace(cfg, why=tuple(why.items()), warnings=tuple(warnings))


def _flag(caps: Capabilities, logical: str, why_needed: str,
          spellings: tuple[str, ...] = ()) -> str:
    names = spellings or SPELLINGS[logical]
    spelled = caps.first_of(names)
    if spelled is None:
        removed = [s for s in names if caps.is_removed(s)]
        what = "lists it as removed" if removed else "does not accept it"
        raise ConfigError(
            f"{names[0]}: {caps.describe()} {what}, but {why_needed}.",
            hint="Build a newer llama-server (`mtpwrap build`) or choose another profile.")
    return spelled


def _pick_kv(caps: Capabilities | None, logical: str, wanted: Sequence[str], what: str,
             sized_types: Collection[str] | None, warnings: list[str]) -> str:
    if caps is None:
        if sized_types is None:
            return wanted[0]
        for i, t in enumerate(wanted):
            if t in sized_types:
                if i > 0:
                    warnings.append(f"{what} KV type {', '.join(wanted[:i])} has no known size "
                                    f"without a built binary; planning {t}")
                return t
        raise ConfigError(f"{what} KV types {', '.join(wanted)}: none has a known size; run "
                          "`mtpwrap build` (it measures the binary's types) or edit the profile.")
    flag = _flag(caps, logical, f"the profile sets the {what} KV type")
    allowed = caps.allowed(flag)
    if allowed is None:
        warnings.append(f"{flag}: {caps.describe()} lists no allowed values; using "
                        f"{wanted[0]} unchecked")
        return wanted[0]
    for i, t in enumerate(wanted):
        if t in allowed:
            if i > 0:
                warnings.append(f"{what} KV type {', '.join(wanted[:i])} is not offered by this "
                                f"llama-server ({flag} allows {', '.join(allowed)}); falling "
                                f"back to {t}")
            return t
    raise ConfigError(
        f"{flag}: {caps.describe()} offers none of the profile's {what} KV types "
        f"({', '.join(wanted)}); it allows {', '.join(allowed)}.",
        hint="Add one of those to the profile's list, or build the fork.")


def _speculation(cfg: LaunchConfig, profile: Profile, caps: Capabilities | None,
                 draft_model: Path | str | None, sized_types: Collection[str] | None,
                 why: dict[str, str], warnings: list[str]) -> LaunchConfig:
    spec = profile.spec
    if spec.kind == "none":
        return cfg
    wanted = SPEC_TYPES[spec.kind]
    if caps is None:
        chosen = wanted[0]
        why["spec_type"] = f"{spec.kind} speculation from the profile"
    else:
        type_flag = _flag(caps, "spec_type", f"the profile asks for {spec.kind} speculation")
        allowed = caps.allowed(type_flag) or ()
        found = next((t for t in wanted if t in allowed), None)
        if found is None:
            raise ConfigError(
                f"{type_flag}: {caps.describe()} offers none of {', '.join(wanted)} "
                f"(it allows {', '.join(allowed) or 'nothing'}), but profile {profile.name} asks "
                f"for {spec.kind} speculation.",
                hint="Build the MTP fork (`mtpwrap build`) or choose a profile without "
                     "speculation.")
        chosen = found
        if chosen != wanted[0]:
            warnings.append(f"speculation: this llama-server has no {wanted[0]!r} spec type; "
                            f"using its {chosen!r} instead")
            why["spec_type"] = f"{spec.kind} speculation; this build names it {chosen}"
        else:
            why["spec_type"] = f"{spec.kind} speculation from the profile"
    changes: dict[str, Any] = {"spec": spec.kind, "spec_type": chosen}
    if spec.depth is not None and (chosen in DEPTH_FLAGS):
        changes["depth"] = spec.depth
        why["depth"] = ("draft length of the n-gram matches, from the profile (spec.depth)"
                        if spec.kind == "ngram" else "draft depth from the profile")
    if spec.ngram_n is not None and chosen in NGRAM_N_FLAGS:
        changes["ngram_n"] = spec.ngram_n
        why["ngram_n"] = "n-gram lookup length from the profile"
    if spec.p_min is not None:
        changes["p_min"] = spec.p_min
        why["p_min"] = "minimum draft probability from the profile"
    if spec.kind == "draft":
        changes["draft_model"] = str(draft_model or spec.draft_model)
        why["draft_model"] = "draft model from the profile"
    if spec.draft_kv is not None:
        changes["draft_k"] = _pick_kv(caps, "draft_k", spec.draft_kv.k, "draft K", sized_types,
                                      warnings)
        changes["draft_v"] = _pick_kv(caps, "draft_v", spec.draft_kv.v, "draft V", sized_types,
                                      warnings)
        why["draft_k"] = "draft/MTP context K cache type (llama.cpp's default is f16)"
        why["draft_v"] = "draft/MTP context V cache type (llama.cpp's default is f16)"
    return dataclasses.replace(cfg, **changes)


def _check_hardware(profile: Profile, snapshot: HardwareSnapshot | None,
                    warnings: list[str]) -> None:
    if snapshot is None or not profile.hardware.requires_gpu:
        return
    if not snapshot.has_gpu:
        raise ConfigError(f"profile {profile.name} needs a GPU ({profile.hardware.describe()}), "
                          f"but {snapshot.error or 'none was found'}.",
                          hint="Use --profile cpu-demo, or run on the machine with the GPU.")
    if not any(profile.hardware.matches(g) for g in snapshot.gpus):
        have = ", ".join(f"{g.name} ({g.memory_total_gib or 0:.1f} GiB)" for g in snapshot.gpus)
        warnings.append(f"profile {profile.name} is meant for {profile.hardware.describe()}; "
                        f"this machine has {have}")


def check_extra(caps: Capabilities, source: str, args: Sequence[str]) -> None:
    """Extra arguments may not take over what mtpwrap owns, nor use removed or unknown flags."""
    for a in args:
        if not a.startswith("-") or len(a) < 2 or a[1].isdigit():
            continue  # a value, or a negative number
        flag = a.split("=", 1)[0]
        if flag in RESERVED:
            raise ConfigError(f"{source}: {flag} is set by mtpwrap ({RESERVED[flag]}); "
                              "remove it.")
        if caps.is_removed(flag):
            raise ConfigError(f"{source}: {flag} has been removed from llama.cpp and aborts "
                              f"{caps.describe()}; see its --help for the replacement.")
        if not caps.has(flag):
            raise ConfigError(f"{source}: {caps.describe()} does not accept {flag}.")


def plain(model: Path | str, *, context: int, slots: int = 1, cache: str = "f16",
          why: str, **fields: Any) -> LaunchConfig:
    """A launch that is no profile's (a smoke test, a measurement): `why` says what it is for."""
    return LaunchConfig(profile=why, model=str(model), context=context, cache_k=cache,
                        cache_v=cache, slots=slots, **fields)




def check_exposure(source: str, args: Sequence[str], *, log_prompts: bool,
                   allow_rpc: bool) -> list[str]:
    """Extra arguments that log what users send, or open an unauthenticated remote backend,
    only where the profile says so (log_prompts, allow_rpc); the warnings to show when it
    does."""
    warnings: list[str] = []
    args = list(args)
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if flag in VERBOSE or (flag in VERBOSITY and not (
                value.isdigit() and int(value) <= DEFAULT_VERBOSITY)):
            if not log_prompts:
                raise ConfigError(
                    f"{source}: {a} raises llama-server's log verbosity above its default "
                    f"({DEFAULT_VERBOSITY}), which writes prompts and answers to the logs.",
                    hint="Remove it, or set log_prompts: true in the profile if these logs may "
                         "hold what users send.")
            warnings.append(f"prompts and answers are logged ({source}: {a}; the profile sets "
                            "log_prompts: true)")
        elif flag == "--rpc":
            if not allow_rpc:
                raise ConfigError(
                    f"{source}: --rpc sends work to llama.cpp RPC servers, which have no "
                    "authentication and have had remote-code-execution bugs.",
                    hint="Remove it, or set allow_rpc: true in the profile once the RPC "
                         "servers sit on a network only this machine can reach.")
            warnings.append(f"--rpc {value}: llama.cpp's RPC servers accept anyone who reaches "
                            "them; keep them on a private network (the profile sets "
                            "allow_rpc: true)")
    return warnings


# --------------------------------------------------------------------------- rendering


class _Argv:
    def __init__(self, caps: Capabilities) -> None:
        self.caps = caps
        self.args: list[str] = []
        self.decisions: list[Decision] = []

    def add(self, logical: str, value: Any, reason: str, *, spellings: tuple[str, ...] = ()
            ) -> None:
        spelled = _flag(self.caps, logical, reason, spellings)
        self.args.append(spelled)
        text = None if value is None else str(value)
        if text is not None:
            self.args.append(text)
        self.decisions.append(Decision(spelled, text, reason))


def render(cfg: LaunchConfig, caps: Capabilities, *, binary: Path | str | None = None,
           host: str = "127.0.0.1", port: int | None = None, api_key: str | None = None,
           extra: Sequence[str] = (), serve: bool = True,
           slot_save_path: Path | str | None = None) -> RenderedLaunch:
    """The argv and environment of `cfg` for this binary; the one place flags are spelled.
    serve=False: only the model and memory flags (llama-fit-params serves nothing).
    slot_save_path: mtpwrap's KV snapshot directory, where llama-server saves slots."""
    b = _Argv(caps)
    r = cfg.reason
    b.add("model", cfg.model, r("model"))
    if serve:
        b.add("host", host, "llama-server is never exposed; the proxy is the public side")
        if port is not None:
            b.add("port", port, "internal port chosen by the supervisor")
    b.add("context", cfg.context, r("context"))
    if cfg.gpu_layers is not None:
        b.add("gpu_layers", cfg.gpu_layers, r("gpu_layers"))
    b.add("slots", cfg.slots, r("slots"))
    for name in ("batch", "ubatch", "threads"):
        if getattr(cfg, name) is not None:
            b.add(name, getattr(cfg, name), r(name))
    b.add("cache_k", cfg.cache_k, r("cache_k"))
    b.add("cache_v", cfg.cache_v, r("cache_v"))
    b.add("flash_attn", cfg.flash_attn, r("flash_attn"))
    if cfg.spec_type is not None:
        b.add("spec_type", cfg.spec_type, r("spec_type"))
        if cfg.depth is not None and cfg.spec_type in DEPTH_FLAGS:
            b.add("depth", cfg.depth, r("depth"), spellings=DEPTH_FLAGS[cfg.spec_type])
        if cfg.ngram_n is not None and cfg.spec_type in NGRAM_N_FLAGS:
            b.add("ngram_n", cfg.ngram_n, r("ngram_n"), spellings=NGRAM_N_FLAGS[cfg.spec_type])
        if cfg.p_min is not None:
            b.add("p_min", f"{cfg.p_min:g}", r("p_min"))
        if cfg.draft_model is not None:
            b.add("draft_model", cfg.draft_model, r("draft_model"))
        if cfg.draft_k is not None and cfg.draft_v is not None:
            b.add("draft_k", cfg.draft_k, r("draft_k"))
            b.add("draft_v", cfg.draft_v, r("draft_v"))
    if cfg.mlock:
        option = caps.option("--mlock")
        if option is not None:
            b.add("mlock", None, r("mlock") + ("; deprecated in this build but still accepted"
                                               if option.deprecated else ""))
        elif "mlock" in (caps.allowed("--load-mode") or ()):
            b.args += ["--load-mode", "mlock"]
            b.decisions.append(Decision("--load-mode", "mlock",
                                        "profile: mlock; this build spells it --load-mode"))
        else:
            b.add("mlock", None, r("mlock"))
    if cfg.no_warmup:
        b.add("no_warmup", None, r("no_warmup"))
    if cfg.verbosity is not None:
        b.add("verbosity", cfg.verbosity, r("verbosity") or "log verbosity")
    if cfg.kv_unified is not None:
        b.add("kv_unified" if cfg.kv_unified else "no_kv_unified", None,
              r("kv_unified") or "one KV pool for all slots, or one per slot")
    if cfg.repack is False:
        b.add("no_repack", None, r("repack") or "no CPU weight repacking")
    if cfg.fit is not None:
        b.add("fit", cfg.fit, r("fit") or "llama.cpp's own fitting to device memory")
    if serve and slot_save_path is not None:
        b.add("slot_save_path", slot_save_path,
              "mtpwrap's KV snapshot directory (persist.dir), never a client's")
    if serve:
        b.add("metrics", None, "the proxy re-exports llama-server's Prometheus metrics")
        if caps.first_of(SPELLINGS["no_webui"]):
            b.add("no_webui", None, "the built-in web UI stays off; the proxy does not serve it")

    env: dict[str, str] = {}
    secret: set[str] = set()
    if api_key is not None and serve:
        flag = _flag(caps, "api_key", "the proxy authenticates to llama-server with a key")
        env_name = caps.env_for(flag)
        if not env_name:
            raise ConfigError(f"{flag}: {caps.describe()} names no environment variable for it, "
                              "and the key must not appear in the process list.")
        name = env_name
        env[name] = api_key
        secret.add(name)
        b.decisions.append(Decision(flag, None, f"internal key passed in ${name}, not in argv"))

    exposure: list[str] = []
    for source, args in (("profile extra_args", cfg.extra_args), ("extra arguments", extra)):
        check_extra(caps, source, args)
        if args is extra:
            exposure += check_exposure(source, args, log_prompts=cfg.log_prompts,
                                       allow_rpc=cfg.allow_rpc)
        b.args += list(args)
        if args:
            b.decisions.append(Decision(" ".join(args), None, f"{source}, passed through"))

    exe = str(binary or caps.binary or "llama-server")
    warnings = list(cfg.warnings) + exposure + ([cfg.note] if cfg.note else [])
    return RenderedLaunch(argv=[exe, *b.args], env=env, decisions=b.decisions, warnings=warnings,
                      profile=cfg.profile, secret_env=frozenset(secret))


# --------------------------------------------------------------------------- stepping down


bits_per_value = kv.bits_per_value


def ladder(cfg: LaunchConfig, caps: Capabilities | None = None,
           kv_sizes: Mapping[str, Any] | None = None,
           cost: Callable[[LaunchConfig], int] | None = None) -> list[LaunchConfig]:
    """The cheaper launches tried after out-of-memory starts, each cumulative: draft depth
    down to 1, speculation off, each smaller KV type per value (among those the binary offers),
    the context halved down to CONTEXT_FLOOR. With `cost` (planned bytes of a launch) the
    groups go in the order of the bytes their first step saves, least first, and a step that
    saves nothing is left out; without it, in that fixed order, leaving out steps that change
    nothing."""
    def depth(c: LaunchConfig) -> LaunchConfig | None:
        if c.spec in ("mtp", "draft") and c.depth is not None and c.depth > 1:
            return c.replace(depth=1, why={"depth": "step-down after out-of-memory"},
                             note="draft depth 1")
        return None

    def no_spec(c: LaunchConfig) -> LaunchConfig | None:
        if c.spec == "none":
            return None
        return c.replace(spec="none", spec_type=None, depth=None, p_min=None, ngram_n=None,
                         draft_model=None, draft_k=None, draft_v=None,
                         why={"spec_type": "step-down after out-of-memory"},
                         note="no speculation")

    def kv(c: LaunchConfig) -> LaunchConfig | None:
        smaller = _smaller_kv(c, caps, kv_sizes)
        if smaller is None:
            return None
        return c.replace(cache_k=smaller, cache_v=smaller, flash_attn="on",
                         why={"cache_k": "step-down after out-of-memory",
                              "cache_v": "step-down after out-of-memory",
                              "flash_attn": f"quantized V cache ({smaller}) needs it"},
                         note=f"KV {smaller}")

    def context(c: LaunchConfig) -> LaunchConfig | None:
        if c.context <= CONTEXT_FLOOR:
            return None
        n = max(CONTEXT_FLOOR, c.context // 2)
        return c.replace(context=n, why={"context": "step-down after out-of-memory"},
                         note=f"context {n}")

    groups: list[tuple[Callable[[LaunchConfig], LaunchConfig | None], bool]] = [
        (depth, False), (no_spec, False), (kv, True), (context, True)]  # (step, repeats)
    if cost is not None:
        base = cost(cfg)

        def saved(step: Callable[[LaunchConfig], LaunchConfig | None]) -> int:
            nxt = step(cfg)
            return 0 if nxt is None else base - cost(nxt)

        ranked = [(saved(g[0]), i, g) for i, g in enumerate(groups)]
        groups = [g for s, _, g in sorted(ranked) if s > 0 or g[0] is context]
    steps: list[LaunchConfig] = []
    notes: list[str] = []
    cur, cur_cost = cfg, cost(cfg) if cost is not None else 0
    for step, repeats in groups:
        while (nxt := step(cur)) is not None:
            if cost is not None:
                c = cost(nxt)
                if c >= cur_cost:
                    break  # saves nothing more
                cur_cost = c
            notes.append(nxt.note or "")
            cur = dataclasses.replace(nxt, note=f"step-down {len(notes)}: " + ", ".join(notes))
            steps.append(cur)
            if not repeats:
                break
    return steps


def _smaller_kv(cfg: LaunchConfig, caps: Capabilities | None,
                kv_sizes: Mapping[str, Any] | None) -> str | None:
    """The next smaller rung of STEP_KV_TYPES that the binary offers: the one with the most bits
    per value (measured sizes win) below both of cfg's types."""
    offered: Sequence[str] = STEP_KV_TYPES
    if caps is not None:
        flag = caps.first_of(SPELLINGS["cache_k"])
        allowed = (caps.allowed(flag) if flag else None) or KV_TYPES
        offered = [t for t in STEP_KV_TYPES if t in allowed]
    try:
        now = max(bits_per_value(cfg.cache_k, kv_sizes), bits_per_value(cfg.cache_v, kv_sizes))
    except ConfigError:
        return None
    best: tuple[float, str] | None = None
    for t in offered:
        try:
            bits = bits_per_value(t, kv_sizes)
        except ConfigError:
            continue  # a type without a known size cannot be shown to save anything
        if bits < now and (best is None or bits > best[0]):
            best = (bits, t)
    return best[1] if best else None


def step_down(cfg: LaunchConfig, step: int, caps: Capabilities | None = None,
              kv_sizes: Mapping[str, Any] | None = None,
              cost: Callable[[LaunchConfig], int] | None = None) -> LaunchConfig | None:
    """`cfg` itself for step 0, the `step`-th rung of the ladder, or None past its end."""
    if step <= 0:
        return cfg
    steps = ladder(cfg, caps, kv_sizes, cost)
    return steps[step - 1] if step <= len(steps) else None
