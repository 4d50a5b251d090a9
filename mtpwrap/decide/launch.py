"""The one launch: a typed, frozen `LaunchConfig` chosen from profile + capabilities + hardware,
and rendered once into llama-server's argv and environment.

The flag spellings and the KV and speculation vocabularies live in `vocab`. `choose` decides
(each choice with its reason), `render` spells, and `ladder.step_down` makes cheaper variants
after out-of-memory starts — all on `LaunchConfig`, never on argv strings.

Only flags the built binary lists are emitted; a flag it lacks is a ConfigError naming the flag
and the binary. Flags llama.cpp has removed (`--draft`, `--draft-n`, `--draft-max`,
`--draft-min`) still appear in its `--help` and abort the server, so they are never emitted,
not even from `extra_args`.

Secrets never go into argv (visible in `ps` to every user): the internal API key travels in the
environment variable the binary names for `--api-key` (`LLAMA_API_KEY`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide import kv
from mtpwrap.decide.endpoint import Endpoint, host_and_port
from mtpwrap.decide.extra_args import check_exposure, check_extra
from mtpwrap.decide.vocab import (
    DEPTH_FLAGS,
    FULL_PRECISION_KV,
    NGRAM_N_FLAGS,
    SPEC_TYPES,
    SPELLINGS,
)
from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.gguf_facts import ModelFacts
    from mtpwrap.decide.hardware import HardwareSnapshot
    from mtpwrap.decide.profile_types import Profile


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
    allow_tools: bool = False  #: the profile allows tools that act on the machine (--tools …)
    kv_unified: bool | None = None  #: None: llama.cpp's default (unified when slots > 1)
    repack: bool | None = None  #: CPU weight repacking; None: llama.cpp's default (on)
    fit: str | None = None  #: llama.cpp's --fit on|off; None: its default
    #: a companion: serve embeddings (--embeddings) or reranking (--reranking) only
    serves: str | None = None
    pooling: str | None = None  #: --pooling; None: the model's own
    alias: str | None = None  #: the name the API answers to (--alias)
    #: device bytes others hold on the GPU this launch plans on (a GPU companion's weights,
    #: KV and compute), as (what, bytes, note): rows of its memory plan
    reserved: tuple[tuple[str, int, str], ...] = ()
    extra_args: tuple[str, ...] = ()
    #: environment llama-server needs for this launch (e.g. the fork's tbq3_0 V switch)
    env: tuple[tuple[str, str], ...] = ()
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
    #: flags left out because this binary lacks them (render(serve=False) only)
    dropped: list[str] = field(default_factory=list)

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
           sized_types: Collection[str] | None = None, facts: ModelFacts | None = None,
           target: kv.Target | None = None) -> LaunchConfig:
    """The launch a profile asks for on this binary (`caps`) and machine.

    Without a binary (`caps` None: planning for a machine that is not this one), each KV list
    gives its first type with a known size (`sized_types`), and speculation its first spec type.
    With the model's header (`facts`), each KV list gives its first type the model admits on
    `target` too (mtpwrap.decide.kv), and the launch carries the environment that type needs.
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

    # quantized V turns flash attention on below, so the model is asked with it on
    ask = _KvChoice(caps, sized_types, facts,
                    dataclasses.replace(target or kv.Target(), flash_attn="on"), warnings)
    k, why["cache_k"] = ask.pick("cache_k", profile.kv.k, "K", "K")
    v, why["cache_v"] = ask.pick("cache_v", profile.kv.v, "V", "V")
    if profile.kv.why:  # the profile's own reason for its order (e.g. measured figures)
        why["cache_k"] += f"; the list's order: {profile.kv.why}"
        why["cache_v"] += f"; the list's order: {profile.kv.why}"

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
        allow_rpc=profile.allow_rpc, allow_tools=profile.allow_tools)
    if profile.mlock:
        why["mlock"] = "keep the weights in RAM (profile: mlock)"
    if profile.no_warmup:
        why["no_warmup"] = "skip the empty warm-up run (profile: no_warmup)"
    if profile.extra_args:
        why["extra_args"] = "profile extra_args, passed through"
    cfg = _speculation(cfg, profile, draft_model, ask, why)
    trade = _recipe_trade(profile, k)
    if trade:
        warnings.append(trade)
    if ask.env:
        why["env"] = "; ".join(f"{k}={v} in llama-server's environment" for k, v in ask.env.items())
        cfg = dataclasses.replace(cfg, env=tuple(ask.env.items()))
    if caps is not None:
        check_extra(caps, "profile extra_args", cfg.extra_args)
    warnings += check_exposure("profile extra_args", cfg.extra_args,
                               log_prompts=cfg.log_prompts, allow_rpc=cfg.allow_rpc,
                               allow_tools=cfg.allow_tools)
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


@dataclass
class _KvChoice:
    """What a KV list is checked against: the binary (or, without one, the known sizes) and,
    when its header was read, the model on its target (mtpwrap.decide.kv.admits)."""

    caps: Capabilities | None
    sized_types: Collection[str] | None
    facts: ModelFacts | None
    target: kv.Target | None
    warnings: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def offered(self, logical: str, wanted: Sequence[str], what: str) -> list[str]:
        """The types of `wanted` this binary offers (or, without one, that have a size)."""
        if self.caps is None:
            if self.sized_types is None:
                return list(wanted)
            got = [t for t in wanted if t in self.sized_types]
            if not got:
                raise ConfigError(f"{what} KV types {', '.join(wanted)}: none has a known size; "
                                  "run `mtpwrap build` (it measures the binary's types) or edit "
                                  "the profile.")
            if got[0] != wanted[0]:
                skipped = wanted[:wanted.index(got[0])]
                self.warnings.append(f"{what} KV type {', '.join(skipped)} has no known size "
                                     f"without a built binary; planning {got[0]}")
            return got
        flag = _flag(self.caps, logical, f"the profile sets the {what} KV type")
        allowed = self.caps.allowed(flag)
        if allowed is None:
            self.warnings.append(f"{flag}: {self.caps.describe()} lists no allowed values; "
                                 f"using {wanted[0]} unchecked")
            return [wanted[0]]
        got = [t for t in wanted if t in allowed]
        if not got:
            raise ConfigError(
                f"{flag}: {self.caps.describe()} offers none of the profile's {what} KV types "
                f"({', '.join(wanted)}); it allows {', '.join(allowed)}.",
                hint="Add one of those to the profile's list, or build the fork.")
        if got[0] != wanted[0]:
            skipped = wanted[:wanted.index(got[0])]
            self.warnings.append(f"{what} KV type {', '.join(skipped)} is not offered by this "
                                 f"llama-server ({flag} allows {', '.join(allowed)}); falling "
                                 f"back to {got[0]}")
        return got

    def pick(self, logical: str, wanted: Sequence[str], what: str, role: str
             ) -> tuple[str, str]:
        """(type, reason): the first of `wanted` the binary offers and the model admits."""
        offered = self.offered(logical, wanted, what)
        source = "this binary offers" if self.caps is not None else "has a known size"
        if self.facts is None:
            return offered[0], f"{what} cache type: first of the profile's list {source}"
        got, refused = kv.first_admitted(self.facts, offered, role, self.target)
        if got is None:
            raise ConfigError(
                f"{what} KV types {', '.join(offered)}: the model admits none of them "
                f"({refused[0].reason}).",
                hint="Add a type it admits to the profile's list (q8_0 and q4_0 fit any head "
                     "size that is a multiple of 32).")
        for r in refused:
            self.warnings.append(f"{r.reason}; using {got.kv_type}")
        self.env.update(got.env)
        reason = f"{what} cache type: first of the profile's list {source} and the model admits"
        if refused:
            reason += f" ({'; '.join(r.reason for r in refused)})"
        return got.kv_type, reason


def _speculation(cfg: LaunchConfig, profile: Profile, draft_model: Path | str | None,
                 ask: _KvChoice, why: dict[str, str]) -> LaunchConfig:
    spec, caps, warnings = profile.spec, ask.caps, ask.warnings
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
        for name, role, wanted in (("draft_k", "K", spec.draft_kv.k),
                                   ("draft_v", "V", spec.draft_kv.v)):
            changes[name], reason = ask.pick(name, wanted, f"draft {role}", role)
            why[name] = f"{reason}; the draft/MTP context's own (llama.cpp's default is f16)"
    return dataclasses.replace(cfg, **changes)


def _recipe_trade(profile: Profile, chosen_k: str) -> str | None:
    """The recipe's trade, named when a profile asks for both the fork's KV types and a draft
    depth per request class: the fork's server takes one fixed depth (its probe says
    `ignored`), upstream's takes the request's depth but has no TurboQuant KV."""
    fork_kv = [t for t in (*profile.kv.k, *profile.kv.v)
               if t in kv.TABLE and kv.TABLE[t].family in ("tbq", "rotor")]
    if not fork_kv or not profile.spec.policy:
        return None
    side = ("the fork's: TBQ KV and one fixed depth for every request (spec.depth); "
            "spec.policy is reported unsupported"
            if chosen_k in fork_kv else
            "upstream's: per-class depth with draft-mtp, and no TBQ KV (the profile's "
            f"fallback {chosen_k})")
    return (f"profile {profile.name} asks for TBQ KV ({fork_kv[0]}) and a draft depth per "
            "request class (spec.policy); no one llama-server gives both — the fork has TBQ KV "
            "and one fixed depth, upstream has draft-mtp, q4_0 KV and per-class depth. This "
            f"launch takes {side}.")


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


def plain(model: Path | str, *, context: int, slots: int = 1, cache: str = "f16",
          why: str, **fields: Any) -> LaunchConfig:
    """A launch that is no profile's (a smoke test, a measurement): `why` says what it is for."""
    return LaunchConfig(profile=why, model=str(model), context=context, cache_k=cache,
                        cache_v=cache, slots=slots, **fields)




# --------------------------------------------------------------------------- rendering


#: what sizes the memory llama-fit-params reports: it must take all of these
_MEMORY_FLAGS = frozenset({"model", "context", "gpu_layers", "slots", "batch", "ubatch",
                           "cache_k", "cache_v", "flash_attn"})


class _Argv:
    def __init__(self, caps: Capabilities, *, lenient: bool = False) -> None:
        self.caps = caps
        self.lenient = lenient  #: drop (and name) a flag the binary lacks, unless it sizes memory
        self.args: list[str] = []
        self.decisions: list[Decision] = []
        self.dropped: list[str] = []

    def add(self, logical: str, value: Any, reason: str, *, spellings: tuple[str, ...] = ()
            ) -> bool:
        text = None if value is None else str(value)
        names = spellings or SPELLINGS[logical]
        if self.lenient and logical not in _MEMORY_FLAGS and self.caps.first_of(names) is None:
            self.dropped.append(names[0] + ("" if text is None else f" {text}"))
            return False
        spelled = _flag(self.caps, logical, reason, spellings)
        self.args.append(spelled)
        if text is not None:
            self.args.append(text)
        self.decisions.append(Decision(spelled, text, reason))
        return True


def render(cfg: LaunchConfig, caps: Capabilities, *, binary: Path | str | None = None,
           host: str = "127.0.0.1", port: int | None = None, api_key: str | None = None,
           extra: Sequence[str] = (), serve: bool = True,
           slot_save_path: Path | str | None = None,
           endpoint: Endpoint | None = None, webui: bool = False) -> RenderedLaunch:
    """The argv and environment of `cfg` for this binary; the one place flags are spelled.
    serve=False: for llama-fit-params, which serves nothing: no serving flags, and a flag it
    lacks that does not size memory (e.g. --spec-type on the fork's) is left out and named in
    `dropped` instead of refused.
    slot_save_path: mtpwrap's KV snapshot directory, where llama-server saves slots.
    endpoint: where it listens (`listen_on`); when given it replaces `host` and `port`.
    webui: the front serves llama-server's own web UI (`proxy.enable_paths` lists webui), so
    --no-webui is left out."""
    b = _Argv(caps, lenient=not serve)
    r = cfg.reason
    b.add("model", cfg.model, r("model"))
    if serve:
        host, port, why = host_and_port(endpoint, caps, host, port)
        b.add("host", host, why)
        if port is not None:
            b.add("port", port, "internal port chosen by the supervisor (loopback TCP only)")
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
    if cfg.spec_type is not None and b.add("spec_type", cfg.spec_type, r("spec_type")):
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
    if cfg.serves is not None:
        b.add(cfg.serves, None, r("serves"))
    if cfg.pooling is not None:
        b.add("pooling", cfg.pooling, r("pooling"))
    if cfg.alias is not None and serve:
        b.add("alias", cfg.alias, r("alias"))
    if serve and slot_save_path is not None:
        b.add("slot_save_path", slot_save_path,
              "mtpwrap's KV snapshot directory (persist.dir), never a client's")
    if serve:
        b.add("metrics", None, "the proxy re-exports llama-server's Prometheus metrics")
        if caps.first_of(SPELLINGS["no_webui"]) and not webui:
            b.add("no_webui", None, "the built-in web UI stays off; the proxy does not serve it "
                  "(proxy.enable_paths: [webui] serves it)")

    env: dict[str, str] = dict(cfg.env)
    for name, value in cfg.env:
        b.decisions.append(Decision(f"{name}={value}", None, r("env") or "environment"))
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
                                       allow_rpc=cfg.allow_rpc, allow_tools=cfg.allow_tools)
        b.args += list(args)
        if args:
            b.decisions.append(Decision(" ".join(args), None, f"{source}, passed through"))

    exe = str(binary or caps.binary or "llama-server")
    warnings = list(cfg.warnings) + exposure + ([cfg.note] if cfg.note else [])
    return RenderedLaunch(argv=[exe, *b.args], env=env, decisions=b.decisions, warnings=warnings,
                          profile=cfg.profile, secret_env=frozenset(secret), dropped=b.dropped)


