"""One resolved launch: profile + hardware snapshot + capabilities (+ model facts and measured KV
sizes) → the `LaunchConfig` and its memory plan, with the reasons.

`resolve` is the only caller of the planner. `up`, `args`, `plan`, `bench` and `tune` all go
through it, with the snapshot and the capabilities passed in, so they cannot disagree about a
profile. `gather` finds those inputs the way every command does (the binary, its manifest and
capabilities, the snapshot or a recording of one, the profile, the model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide.launch import LaunchConfig, LaunchSpec, choose, render
from mtpwrap.errors import ConfigError, MissingToolError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.gguf_facts import ModelFacts
    from mtpwrap.decide.hardware import HardwareSnapshot
    from mtpwrap.decide.planner import MemoryPlan, PlanConfig
    from mtpwrap.decide.profiles import Profile

GiB = 2**30


@dataclass
class Inputs:
    """What a command found before deciding anything."""

    profile: Profile
    profile_reason: str
    snapshot: HardwareSnapshot | None
    caps: Capabilities | None
    binary: Path | None
    model: str  #: a path, or the name as given when it could not be found (preview only)
    commit: str | None = None
    kv_sizes: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class Resolved:
    """The launch and its memory plan (made now on a device or for `context: max`, else on
    demand: planning reads the model's header)."""

    inputs: Inputs
    launch: LaunchConfig
    plan: MemoryPlan | None = None
    plan_text: str | None = None

    @property
    def profile(self) -> Profile:
        return self.inputs.profile

    @property
    def planned(self) -> bool:
        return self.plan_text is not None

    def render(self, *, host: str = "127.0.0.1", port: int | None = None,
               api_key: str | None = None, cfg: LaunchConfig | None = None
               ) -> LaunchSpec:
        caps = self.inputs.caps
        if caps is None:
            raise MissingToolError("no llama-server to spell the command line for.",
                                   hint="Run `mtpwrap build`, or pass --binary PATH.")
        return render(cfg or self.launch, caps, binary=self.inputs.binary, host=host,
                             port=port, api_key=api_key)


# --------------------------------------------------------------------------- planning


def on_device(profile: Profile, snapshot: HardwareSnapshot | None) -> bool:
    return bool(snapshot is not None and snapshot.gpus and profile.hardware.requires_gpu)


def device_bytes(profile: Profile, snapshot: HardwareSnapshot | None) -> int | None:
    """Free memory of the first GPU the profile runs on; None on the CPU."""
    if not on_device(profile, snapshot):
        return None
    assert snapshot is not None
    g = snapshot.gpus[0]
    return g.memory_free if g.memory_free is not None else g.memory_total


def plan_config(cfg: LaunchConfig, facts: ModelFacts, *, backend: str) -> PlanConfig:
    """The planner's view of a launch: llama.cpp's defaults where the launch leaves one open."""
    from mtpwrap.decide.planner import PlanConfig

    ngl = cfg.gpu_layers
    return PlanConfig(
        n_ctx=cfg.context or int(facts.n_ctx_train or 4096),
        type_k=cfg.cache_k, type_v=cfg.cache_v, n_slots=cfg.slots, spec=cfg.spec,
        draft_depth=cfg.depth or 3, type_k_draft=cfg.draft_k or "f16",
        type_v_draft=cfg.draft_v or "f16", ubatch=cfg.ubatch or 512, batch=cfg.batch or 2048,
        flash_attn=cfg.flash_attn != "off",
        n_gpu_layers=ngl if isinstance(ngl, int) else 999, backend=backend)


def limit_types(kv_sizes: dict[str, Any] | None) -> list[str]:
    """The KV types `mtpwrap plan` lists the largest context for."""
    from mtpwrap.decide.planner import supported_kv_types

    types = list(kv_sizes) if kv_sizes else supported_kv_types()
    return [t for t in types if t not in ("f32", "bf16")]


def sized_types(kv_sizes: dict[str, Any] | None) -> set[str]:
    from mtpwrap.decide.planner import BUILTIN_KV_TYPES

    return set(BUILTIN_KV_TYPES) | set(kv_sizes or {})


def resolve(profile: Profile, *, snapshot: HardwareSnapshot | None,
            caps: Capabilities | None, model: Path | str, binary: Path | None = None,
            facts: ModelFacts | None = None, kv_sizes: dict[str, Any] | None = None,
            draft_model: Path | str | None = None, plan: bool | None = None,
            kv_limits: Sequence[str] | None = None, profile_reason: str = "",
            inputs: Inputs | None = None, refuse: bool = True) -> Resolved:
    """The launch for `profile` on this binary and machine, and its memory plan.

    plan None: plan now when the result can change the launch or refuse it (a GPU profile on a
    GPU, or `context: max`), else later through `ensure_plan`. kv_limits: also compute the
    largest context for each of these KV types (`mtpwrap plan`). A plan that does not fit the
    device is a ConfigError with the numbers (refuse=False: a plan with fits False, to show).
    """
    inp = inputs or Inputs(profile=profile, profile_reason=profile_reason, snapshot=snapshot,
                           caps=caps, binary=binary, model=str(model), kv_sizes=kv_sizes)
    cfg = choose(profile, caps, snapshot, model=model, draft_model=draft_model,
                        sized_types=sized_types(kv_sizes) if caps is None else None)
    r = Resolved(inputs=inp, launch=cfg)
    must = profile.context == "max" or on_device(profile, snapshot)
    if plan or (plan is None and must):
        ensure_plan(r, facts=facts, kv_limits=kv_limits, refuse=refuse)
    return r


def ensure_plan(r: Resolved, *, facts: ModelFacts | None = None,
                kv_limits: Sequence[str] | None = None, refuse: bool = True) -> Resolved:
    """Make r's memory plan (once). Sets `plan_text` to "not planned (why)" when the planner
    cannot size this configuration; raises ConfigError when it does not fit the device."""
    if r.planned and kv_limits is None:
        return r
    from mtpwrap.decide import gguf_facts, planner

    prof, inp = r.profile, r.inputs
    device = device_bytes(prof, inp.snapshot)
    backend = "cuda" if on_device(prof, inp.snapshot) else "cpu"
    try:
        facts = facts or gguf_facts.read_facts(Path(r.launch.model))
        pc = plan_config(r.launch, facts, backend=backend)
        if prof.context == "max" and device:
            n = planner.largest_context(facts, pc, device, inp.kv_sizes)
            if n > 0:
                r.launch = r.launch.replace(
                    context=n, why={"context": "context: max; the memory plan's largest "
                                               "context that fits"})
                pc = dataclasses.replace(pc, n_ctx=n)
        if kv_limits is not None:
            p = planner.plan_with_limits(facts, pc, device, inp.kv_sizes, kv_types=list(kv_limits))
        else:
            p = planner.plan(facts, pc, device, inp.kv_sizes)
    except ConfigError as exc:
        # e.g. a KV type the planner has no size for yet: plan nothing rather than refuse.
        r.plan, r.plan_text = None, f"not planned ({exc})"
        return r
    if device is not None and refuse:
        planner.check_fits(p)
    r.plan = p
    where = "GPU" if device is not None else "host"
    text = f"{p.total / GiB:.2f} GiB on the {where} at context {p.context:,}"
    if p.headroom is not None:
        text += f", headroom {p.headroom / GiB:.2f} GiB"
    r.plan_text = text
    return r


# --------------------------------------------------------------------------- inputs


def find_server(explicit: str | Path | None, snapshot: HardwareSnapshot | None = None,
                *, required: bool = True) -> tuple[Path | None, Capabilities | None,
                                                   Any | None]:
    """(binary, its capabilities, its manifest when it is the built one). `--binary` /
    `MTPWRAP_BINARY` win over the build. Without a build and with required=False: all None."""
    from mtpwrap.build import builder
    from mtpwrap.decide import capabilities

    try:
        binary = builder.find_binary(explicit=explicit, snap=snapshot)
    except MissingToolError:
        if required or explicit:
            raise
        return None, None, None
    manifest = builder.load_manifest()
    built = manifest.binaries.get("llama-server", {}).get("path") if manifest else None
    if manifest is not None and built != str(binary):
        manifest = None  # another binary: its own facts count
    caps = (capabilities.Capabilities.from_dict(manifest.capabilities)
            if manifest is not None and manifest.capabilities else capabilities.probe(binary))
    return binary, caps, manifest


def load_snapshot(replay: str | Path | None) -> HardwareSnapshot:
    """This machine through NVML, or a recording of one (`--replay`, MTPWRAP_HW_REPLAY)."""
    from mtpwrap.decide import hardware

    return hardware.load_snapshot(Path(replay)) if replay else hardware.snapshot()


def load_profile(name: str, snapshot: HardwareSnapshot) -> tuple[Profile, str]:
    from mtpwrap.decide import profiles

    if name == "auto":
        return profiles.select_profile(snapshot)
    return profiles.load_profile(name), "chosen with --profile"


def find_model(name: str, *, what: str, fetch: bool) -> tuple[str, str | None]:
    """(path, warning). fetch=False: a preview; the demo model is not downloaded and a missing
    model is a warning (shown as given)."""
    from mtpwrap.decide import models

    if fetch:
        return str(models.resolve_model(name, what=what)), None
    if name in models.DEMO_ALIASES:
        demo = models.cached_demo_model() or models.demo_model_path()
        if Path(demo).is_file():
            return str(demo), None
        return str(demo), f"the demo model is not fetched yet ({demo}); `mtpwrap models` gets it"
    try:
        return str(models.resolve_model(name, what=what)), None
    except ConfigError as exc:
        return name, f"{exc} (shown as given)"


def gather(profile: str | Profile, *, model: str | None = None, binary: str | Path | None = None,
           replay: str | Path | None = None, snapshot: HardwareSnapshot | None = None,
           fetch: bool = True, need_binary: bool = True) -> Inputs:
    """Everything a command needs before `resolve`, found the same way for every command."""
    from mtpwrap.build import calibrate

    snap = snapshot if snapshot is not None else load_snapshot(replay)
    if isinstance(profile, str):
        prof, why = load_profile(profile, snap)
    else:
        prof, why = profile, "given"
    what = "--model" if model else f"profile {prof.name}: model"
    path, warning = find_model(model or prof.model, what=what, fetch=fetch)
    exe, caps, manifest = find_server(binary, snap, required=need_binary)
    commit = manifest.commit if manifest is not None else (caps.commit if caps else None)
    return Inputs(profile=prof, profile_reason=why, snapshot=snap, caps=caps, binary=exe,
                  model=path, commit=commit, kv_sizes=calibrate.load_kv_sizes(manifest),
                  warnings=[warning] if warning else [])


def resolve_inputs(inp: Inputs, *, plan: bool | None = None, facts: ModelFacts | None = None,
                   kv_limits: Sequence[str] | None = None, profile: Profile | None = None,
                   refuse: bool = True) -> Resolved:
    """`resolve` on gathered inputs (optionally for a profile derived from theirs)."""
    if profile is not None:
        inp = dataclasses.replace(inp, profile=profile)
    return resolve(inp.profile, snapshot=inp.snapshot, caps=inp.caps, model=inp.model,
                   binary=inp.binary, facts=facts, kv_sizes=inp.kv_sizes, plan=plan,
                   kv_limits=kv_limits, inputs=inp, refuse=refuse)
