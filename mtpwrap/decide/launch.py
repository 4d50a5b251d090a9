"""The one launch: a typed, frozen `LaunchConfig` chosen from profile + capabilities + hardware,
and rendered once into llama-server's argv and environment.

The flag spellings and the KV and speculation vocabularies live in `vocab`. `choice.choose`
decides (each choice with its reason), `render` spells, and `ladder.step_down` makes cheaper
variants after out-of-memory starts — all on `LaunchConfig`, never on argv strings.

Only flags the built binary lists are emitted; a flag it lacks is a ConfigError naming the flag
and the binary. Flags llama.cpp has removed (`--draft`, `--draft-n`, `--draft-max`,
`--draft-min`) still appear in its `--help` and abort the server, so they are never emitted,
not even from `extra_args`.

Secrets never go into argv (visible in `ps` to every user): the internal API key travels in the
environment variable the binary names for `--api-key` (`LLAMA_API_KEY`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide.endpoint import Endpoint, host_and_port
from mtpwrap.decide.extra_args import check_exposure, check_extra
from mtpwrap.decide.vocab import DEPTH_FLAGS, DOCUMENT_FLAGS, NGRAM_N_FLAGS, SPELLINGS
from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities


@dataclass(frozen=True)
class Decision:
    flag: str
    value: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value, "reason": self.reason}

    def line(self) -> str:
        """`flag value: reason`, as `up`'s log, the state file and `status` show it."""
        return f"{self.flag} {self.value or ''}".strip() + f": {self.reason}"


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
    #: how documents stay warm (mtpwrap.decide.documents); None: llama.cpp's default
    ctx_checkpoints: int | None = None
    checkpoint_every: int | None = None  #: --checkpoint-every-n-tokens
    cache_reuse: int | None = None
    cache_ram: int | None = None  #: MiB of host RAM for llama-server's prompt cache
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


@dataclass(frozen=True)
class ChildCommand:
    """What to run: a LaunchConfig rendered for one binary and endpoint (`render`), or any
    other command a supervisor is given. `env` is added to mtpwrap's own environment (minus
    systemd's variables)."""

    argv: list[str]
    env: Mapping[str, str] = field(default_factory=dict)
    note: str = ""  #: e.g. "step-down 1: context 131072"; logged when the child starts
    #: the launch `argv` renders (what KV snapshots depend on); None for other commands
    launch: LaunchConfig | None = None
    decisions: Sequence[Decision] = ()  #: why each flag is there
    warnings: Sequence[str] = ()
    #: names in `env` whose values are secrets (the internal key): never shown
    secret_env: frozenset[str] = frozenset()
    #: flags left out because this binary lacks them (render(serve=False) only)
    dropped: Sequence[str] = ()

    def _env(self, reveal: bool = False) -> dict[str, str]:
        return {k: v if reveal or k not in self.secret_env else "***"
                for k, v in self.env.items()}

    def shown(self) -> dict[str, Any]:
        """The command as the state file, `status` and an admin's /healthz show it: argv,
        the environment with its secrets as "***", the step-down note, the reasons."""
        return {"argv": list(self.argv), "env": self._env(), "note": self.note or None,
                "decisions": [d.line() for d in self.decisions]}

    def to_dict(self, *, reveal: bool = False) -> dict[str, Any]:
        return {"profile": self.launch.profile if self.launch else None,
                "argv": list(self.argv), "env": self._env(reveal),
                "decisions": [d.to_dict() for d in self.decisions],
                "warnings": list(self.warnings)}


def spell(caps: Capabilities, logical: str, why_needed: str,
          spellings: tuple[str, ...] = ()) -> str:
    """How this binary spells `logical` (or one of `spellings`); a ConfigError naming the flag
    and the binary, saying `why_needed`, when it spells it no way."""
    names = spellings or SPELLINGS[logical]
    spelled = caps.first_of(names)
    if spelled is None:
        removed = [s for s in names if caps.is_removed(s)]
        what = "lists it as removed" if removed else "does not accept it"
        raise ConfigError(
            f"{names[0]}: {caps.describe()} {what}, but {why_needed}.",
            hint="Build a newer llama-server (`mtpwrap build`) or choose another profile.")
    return spelled




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
        spelled = spell(self.caps, logical, reason, spellings)
        self.args.append(spelled)
        if text is not None:
            self.args.append(text)
        self.decisions.append(Decision(spelled, text, reason))
        return True


def render(cfg: LaunchConfig, caps: Capabilities, *, binary: Path | str | None = None,
           host: str = "127.0.0.1", port: int | None = None, api_key: str | None = None,
           extra: Sequence[str] = (), serve: bool = True,
           slot_save_path: Path | str | None = None,
           endpoint: Endpoint | None = None, webui: bool = False) -> ChildCommand:
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
    if serve:  # decided with the binary in view (decide.documents): it takes each one set
        for name in DOCUMENT_FLAGS:
            if (value := getattr(cfg, name)) is not None:
                b.add(name, value, r(name))
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
        flag = spell(caps, "api_key", "the proxy authenticates to llama-server with a key")
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
    return ChildCommand(argv=[exe, *b.args], env=env, note=cfg.note or "", launch=cfg,
                        decisions=b.decisions, warnings=warnings, secret_env=frozenset(secret),
                        dropped=b.dropped)


