"""Profile + capabilities (+ memory plan) → the llama-server command line, each choice explained.

Only flags the built binary lists are emitted; a flag it lacks is a ConfigError naming the flag
and the binary. Flags llama.cpp has removed (`--draft`, `--draft-n`, `--draft-max`,
`--draft-min`) still appear in its `--help` and abort the server, so they are never emitted,
not even from `extra_args`.

Secrets never go into argv (visible in `ps` to every user): the internal API key travels in the
environment variable the binary names for `--api-key` (`LLAMA_API_KEY`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.decide.hardware import HardwareSnapshot
from mtpwrap.decide.profiles import KvTypes, Profile
from mtpwrap.errors import ConfigError

#: logical option → spellings in order of preference (the recipe's spellings first).
SPELLINGS: dict[str, tuple[str, ...]] = {
    "model": ("-m", "--model"),
    "host": ("--host",),
    "port": ("--port",),
    "ctx": ("-c", "--ctx-size"),
    "ngl": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "parallel": ("-np", "--parallel"),
    "batch": ("-b", "--batch-size"),
    "ubatch": ("-ub", "--ubatch-size"),
    "threads": ("-t", "--threads"),
    "ctk": ("-ctk", "--cache-type-k"),
    "ctv": ("-ctv", "--cache-type-v"),
    "flash_attn": ("--flash-attn", "-fa"),
    "spec_type": ("--spec-type",),
    "draft_n_max": ("--spec-draft-n-max",),
    "draft_p_min": ("--spec-draft-p-min", "--draft-p-min"),
    "draft_model": ("-md", "--spec-draft-model", "--model-draft"),
    "ctkd": ("-ctkd", "--spec-draft-type-k", "--cache-type-k-draft"),
    "ctvd": ("-ctvd", "--spec-draft-type-v", "--cache-type-v-draft"),
    "mlock": ("--mlock",),
    "no_warmup": ("--no-warmup",),
    "metrics": ("--metrics",),
    "no_webui": ("--no-webui", "--no-ui"),
    "api_key": ("--api-key",),
}
#: flags mtpwrap owns: extra args may not set them (the child must stay on loopback, keyed).
RESERVED = frozenset({
    "-m", "--model", "--host", "--port", "--api-key", "--api-key-file", "--path",
    "--ssl-key-file", "--ssl-cert-file",
})
#: spec types per profile kind, in order of preference.
SPEC_TYPES: dict[str, tuple[str, ...]] = {
    "mtp": ("mtp", "draft-mtp"),
    "draft": ("draft-simple", "draft"),
    "ngram": ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-cache"),
}
FULL_PRECISION_KV = frozenset({"f32", "f16", "bf16"})


@dataclass(frozen=True)
class Decision:
    flag: str
    value: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value, "reason": self.reason}


@dataclass
class LaunchSpec:
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


class _Builder:
    def __init__(self, caps: Capabilities) -> None:
        self.caps = caps
        self.args: list[str] = []
        self.decisions: list[Decision] = []
        self.warnings: list[str] = []

    def flag(self, logical: str, *, why_needed: str) -> str:
        spelled = self.caps.first_of(SPELLINGS[logical])
        if spelled is None:
            removed = [s for s in SPELLINGS[logical] if self.caps.is_removed(s)]
            what = "lists it as removed" if removed else "does not accept it"
            raise ConfigError(
                f"{SPELLINGS[logical][0]}: {self.caps.describe()} {what}, but {why_needed}.",
                hint="Build a newer llama-server (`mtpwrap build`) or choose another profile.")
        return spelled

    def add(self, logical: str, value: Any, reason: str, *, why_needed: str | None = None) -> None:
        spelled = self.flag(logical, why_needed=why_needed or reason)
        self.args.append(spelled)
        text = None if value is None else str(value)
        if text is not None:
            self.args.append(text)
        self.decisions.append(Decision(spelled, text, reason))

    def warn(self, message: str) -> None:
        self.warnings.append(message)


def _pick_kv(b: _Builder, logical: str, wanted: Sequence[str], what: str) -> str:
    flag = b.flag(logical, why_needed=f"the profile sets the {what} KV type")
    allowed = b.caps.allowed(flag)
    if allowed is None:
        b.warn(f"{flag}: {b.caps.describe()} lists no allowed values; using {wanted[0]} unchecked")
        return wanted[0]
    for i, t in enumerate(wanted):
        if t in allowed:
            if i > 0:
                missing = ", ".join(wanted[:i])
                b.warn(f"{what} KV type {missing} is not offered by this llama-server "
                       f"({flag} allows {', '.join(allowed)}); falling back to {t}")
            return t
    raise ConfigError(
        f"{flag}: {b.caps.describe()} offers none of the profile's {what} KV types "
        f"({', '.join(wanted)}); it allows {', '.join(allowed)}.",
        hint="Add one of those to the profile's list, or build the fork.")


def _kv_pair(b: _Builder, kv: KvTypes, ctk: str, ctv: str, label: str) -> tuple[str, str]:
    k = _pick_kv(b, ctk, kv.k, f"{label}K")
    v = _pick_kv(b, ctv, kv.v, f"{label}V")
    return k, v


def build_command(
    profile: Profile,
    caps: Capabilities,
    snapshot: HardwareSnapshot | None,
    *,
    model: Path | str,
    listen_host: str = "127.0.0.1",
    listen_port: int | None = None,
    api_key: str | None = None,
    plan: Any = None,
    extra: Sequence[str] = (),
    binary: Path | str | None = None,
    draft_model: Path | str | None = None,
) -> LaunchSpec:
    """The llama-server argv for `profile` on this binary and machine, with reasons."""
    b = _Builder(caps)
    env: dict[str, str] = {}
    secret: set[str] = set()
    exe = str(binary or caps.binary or "llama-server")

    _check_hardware(b, profile, snapshot)

    b.add("model", str(model), f"model of profile {profile.name} ({profile.model})")
    b.add("host", listen_host, "llama-server is never exposed; the proxy is the public side")
    if listen_port is not None:
        b.add("port", listen_port, "internal port chosen by the supervisor")

    # Context
    if profile.context == "max":
        planned = getattr(plan, "context", None) if plan is not None else None
        if isinstance(planned, int) and planned > 0:
            b.add("ctx", planned, "context: max; the memory plan's largest context that fits")
        else:
            b.add("ctx", 0, "context: max and no memory plan given; 0 = the model's trained "
                            "length, and llama.cpp's --fit will not shrink it")
    else:
        b.add("ctx", profile.context, "context from the profile")

    # GPU layers
    if profile.gpu_layers is not None:
        ngl = profile.gpu_layers
        if snapshot is not None and not snapshot.has_gpu and ngl not in (0, "auto"):
            b.warn(f"gpu_layers {ngl} but no GPU here ({snapshot.error}); using 0")
            ngl = 0
        b.add("ngl", ngl, "GPU layers from the profile"
              if ngl == profile.gpu_layers else "no GPU: everything stays on the CPU")

    # Slots: MTP drafts for one sequence only
    slots = profile.slots
    reason = "slots from the profile"
    if profile.spec.kind == "mtp":
        if slots != 1:
            b.warn(f"profile asks for {slots} slots, but MTP speculation serves one; using 1")
        slots = 1
        reason = "MTP speculation drafts for a single sequence, so one slot"
    b.add("parallel", slots, reason)

    if profile.batch is not None:
        b.add("batch", profile.batch, "logical batch from the profile")
    if profile.ubatch is not None:
        b.add("ubatch", profile.ubatch, "physical batch from the profile; small at long "
                                        "context keeps the compute buffer small")
    if profile.threads is not None:
        b.add("threads", profile.threads, "threads from the profile")

    # KV cache
    k, v = _kv_pair(b, profile.kv, "ctk", "ctv", "")
    b.add("ctk", k, "K cache type: first of the profile's list this binary offers")
    b.add("ctv", v, "V cache type: first of the profile's list this binary offers")

    # Flash attention: quantized V needs it
    fa = profile.flash_attn
    fa_reason = "flash attention from the profile"
    if v not in FULL_PRECISION_KV:
        if fa == "off":
            b.warn(f"profile turns flash attention off, but a quantized V cache ({v}) "
                   "needs it; turning it on")
        fa_reason = (f"{fa_reason}; the quantized V cache ({v}) needs it too" if fa == "on"
                     else f"quantized V cache ({v}) needs flash attention")
        fa = "on"
    fa_flag = b.flag("flash_attn", why_needed="the profile sets flash attention")
    allowed_fa = caps.allowed(fa_flag)
    if allowed_fa is not None and fa not in allowed_fa:
        raise ConfigError(f"{fa_flag}: {caps.describe()} does not accept {fa!r} "
                          f"(allows {', '.join(allowed_fa)}).")
    b.add("flash_attn", fa, fa_reason)

    _speculation(b, profile, draft_model)

    if profile.mlock:
        if caps.has("--mlock"):
            deprecated = caps.option("--mlock").deprecated  # type: ignore[union-attr]
            b.add("mlock", None, "keep the weights in RAM (profile: mlock)"
                  + ("; deprecated in this build but still accepted" if deprecated else ""))
        elif "mlock" in (caps.allowed("--load-mode") or ()):
            b.args += ["--load-mode", "mlock"]
            b.decisions.append(Decision("--load-mode", "mlock",
                                        "profile: mlock; this build spells it --load-mode"))
        else:
            b.add("mlock", None, "profile: mlock")
    if profile.no_warmup:
        b.add("no_warmup", None, "skip the empty warm-up run (profile: no_warmup)")
    b.add("metrics", None, "the proxy re-exports llama-server's Prometheus metrics")
    if caps.first_of(SPELLINGS["no_webui"]):
        b.add("no_webui", None, "the built-in web UI stays off; the proxy does not serve it")

    if api_key is not None:
        flag = b.flag("api_key", why_needed="the proxy authenticates to llama-server with a key")
        name = caps.env_for(flag)
        if not name:
            raise ConfigError(f"{flag}: {caps.describe()} names no environment variable for it, "
                              "and the key must not appear in the process list.")
        env[name] = api_key
        secret.add(name)
        b.decisions.append(Decision(flag, None, f"internal key passed in ${name}, not in argv"))

    for source, args in (("profile extra_args", profile.extra_args), ("extra arguments", extra)):
        _check_extra(b, source, list(args))
        _check_exposure(b, profile, source, list(args))
        b.args += list(args)
        if args:
            b.decisions.append(Decision(" ".join(args), None, f"{source}, passed through"))

    return LaunchSpec(argv=[exe, *b.args], env=env, decisions=b.decisions, warnings=b.warnings,
                      profile=profile.name, secret_env=frozenset(secret))


def _check_hardware(b: _Builder, profile: Profile, snapshot: HardwareSnapshot | None) -> None:
    if snapshot is None or not profile.hardware.requires_gpu:
        return
    if not snapshot.has_gpu:
        raise ConfigError(f"profile {profile.name} needs a GPU ({profile.hardware.describe()}), "
                          f"but {snapshot.error or 'none was found'}.",
                          hint="Use --profile cpu-demo, or run on the machine with the GPU.")
    if not any(profile.hardware.matches(g) for g in snapshot.gpus):
        have = ", ".join(f"{g.name} ({g.memory_total_gib or 0:.1f} GiB)" for g in snapshot.gpus)
        b.warn(f"profile {profile.name} is meant for {profile.hardware.describe()}; "
               f"this machine has {have}")


def _speculation(b: _Builder, profile: Profile, draft_model: Path | str | None) -> None:
    spec = profile.spec
    if spec.kind == "none":
        return
    type_flag = b.flag("spec_type", why_needed=f"the profile asks for {spec.kind} speculation")
    allowed = b.caps.allowed(type_flag) or ()
    wanted = SPEC_TYPES[spec.kind]
    chosen = next((t for t in wanted if t in allowed), None)
    if chosen is None:
        raise ConfigError(
            f"{type_flag}: {b.caps.describe()} offers none of {', '.join(wanted)} "
            f"(it allows {', '.join(allowed) or 'nothing'}), but profile {profile.name} asks "
            f"for {spec.kind} speculation.",
            hint="Build the MTP fork (`mtpwrap build`) or choose a profile without speculation.")
    if chosen != wanted[0]:
        b.warn(f"speculation: this llama-server has no {wanted[0]!r} spec type; using its "
               f"{chosen!r} instead")
        reason = f"{spec.kind} speculation; this build names it {chosen}"
    else:
        reason = f"{spec.kind} speculation from the profile"
    b.add("spec_type", chosen, reason)

    if spec.depth is not None and spec.kind in ("mtp", "draft"):
        b.add("draft_n_max", spec.depth, "draft depth from the profile")
    if spec.p_min is not None:
        b.add("draft_p_min", f"{spec.p_min:g}", "minimum draft probability from the profile")
    if spec.kind == "draft":
        b.add("draft_model", str(draft_model or spec.draft_model), "draft model from the profile")
    if spec.draft_kv is not None:
        dk, dv = _kv_pair(b, spec.draft_kv, "ctkd", "ctvd", "draft ")
        b.add("ctkd", dk, "draft/MTP context K cache type (llama.cpp's default is f16)")
        b.add("ctvd", dv, "draft/MTP context V cache type (llama.cpp's default is f16)")


#: llama-server's default log verbosity (3, info): above it, prompts and answers are logged
DEFAULT_VERBOSITY = 3
VERBOSE = frozenset({"-v", "--verbose", "--log-verbose"})
VERBOSITY = frozenset({"-lv", "--verbosity", "--log-verbosity"})


def _check_exposure(b: _Builder, profile: Profile, source: str, args: list[str]) -> None:
    """Extra arguments that log what users send, or open an unauthenticated remote backend,
    only where the profile says so (log_prompts, allow_rpc)."""
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if flag in VERBOSE or (flag in VERBOSITY and not (
                value.isdigit() and int(value) <= DEFAULT_VERBOSITY)):
            if not profile.log_prompts:
                raise ConfigError(
                    f"{source}: {a} raises llama-server's log verbosity above its default "
                    f"({DEFAULT_VERBOSITY}), which writes prompts and answers to the logs.",
                    hint="Remove it, or set log_prompts: true in the profile if these logs may "
                         "hold what users send.")
            b.warn(f"prompts and answers are logged ({source}: {a}; the profile sets "
                   "log_prompts: true)")
        elif flag == "--rpc":
            if not profile.allow_rpc:
                raise ConfigError(
                    f"{source}: --rpc sends work to llama.cpp RPC servers, which have no "
                    "authentication and have had remote-code-execution bugs.",
                    hint="Remove it, or set allow_rpc: true in the profile once the RPC "
                         "servers sit on a network only this machine can reach.")
            b.warn(f"--rpc {value}: llama.cpp's RPC servers accept anyone who reaches them; "
                   "keep them on a private network (the profile sets allow_rpc: true)")


def _check_extra(b: _Builder, source: str, args: list[str]) -> None:
    for a in args:
        if not a.startswith("-") or len(a) < 2 or a[1].isdigit():
            continue  # a value, or a negative number
        flag = a.split("=", 1)[0]
        if flag in RESERVED:
            raise ConfigError(f"{source}: {flag} is set by mtpwrap (the child listens on "
                              "loopback with an internal key); remove it.")
        if b.caps.is_removed(flag):
            raise ConfigError(f"{source}: {flag} has been removed from llama.cpp and aborts "
                              f"{b.caps.describe()}; see its --help for the replacement.")
        if not b.caps.has(flag):
            raise ConfigError(f"{source}: {b.caps.describe()} does not accept {flag}.")
