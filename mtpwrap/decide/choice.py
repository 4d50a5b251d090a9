"""Choosing the launch: a profile, the binary's capabilities and the machine's hardware give a
`LaunchConfig`, each field with the reason it has its value.

Here the profile's lists (KV types, speculation kinds) meet what the binary accepts and what the
model admits; `launch.render` then spells the result for one binary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide import kv
from mtpwrap.decide.extra_args import check_exposure, check_extra
from mtpwrap.decide.launch import LaunchConfig, spell
from mtpwrap.decide.vocab import DEPTH_FLAGS, FULL_PRECISION_KV, NGRAM_N_FLAGS, SPEC_TYPES
from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.gguf_facts import ModelFacts
    from mtpwrap.decide.hardware import HardwareSnapshot
    from mtpwrap.decide.profile_types import Profile


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
        fa_flag = spell(caps, "flash_attn", "the profile sets flash attention")
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
        flag = spell(self.caps, logical, f"the profile sets the {what} KV type")
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
        type_flag = spell(caps, "spec_type", f"the profile asks for {spec.kind} speculation")
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
