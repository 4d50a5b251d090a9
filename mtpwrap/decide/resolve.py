"""One resolved launch: profile + hardware snapshot + capabilities (+ model facts and measured KV
sizes) → the `LaunchConfig` and its memory plan, with the reasons. Pure: the inputs are found,
and llama-fit-params asked, by `mtpwrap.supervision.inputs`.

`resolve` is the only caller of the planner. `up`, `args`, `plan`, `bench` and `tune` all go
through it, with the snapshot and the capabilities passed in, so they cannot disagree about a
profile. `mtpwrap.supervision.inputs.gather` finds those inputs the way every command does (the
binary, its manifest and capabilities, the snapshot or a recording of one, the profile, the
model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide import companions, documents, gguf_facts, kv, planner
from mtpwrap.decide.choice import choose
from mtpwrap.decide.companions import CompanionLaunch
from mtpwrap.decide.documents import DocumentPlan
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.decide.gguf_facts import ModelFacts
from mtpwrap.decide.ladder import step_down
from mtpwrap.decide.launch import ChildCommand, LaunchConfig, render
from mtpwrap.decide.planner import MemoryPlan, PlanConfig
from mtpwrap.decide.vocab import ROPE_FLAGS, SPELLINGS
from mtpwrap.errors import ConfigError, MissingToolError
from mtpwrap.units import GiB

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.hardware import HardwareSnapshot
    from mtpwrap.decide.profile_types import Profile



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
    manifest: Any = None  #: the build's manifest when `binary` is the built one
    #: each companion's model file, by the companion's name (its `model` as given otherwise)
    companion_models: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Resolved:
    """The launch and its memory plan (made now on a device or for `context: max`, else on
    demand: planning reads the model's header).

    Frozen: made once by `resolve`. What is learnt later is a new Resolved, never a change to
    this one: `ensure_plan` returns the planned launch, `mtpwrap.supervision.inputs.measure` the
    measured one, and a step-down (`step_down`) is a new LaunchConfig."""

    inputs: Inputs
    launch: LaunchConfig
    plan: MemoryPlan | None = None
    plan_text: str | None = None
    #: what llama.cpp itself would allocate for this launch (llama-fit-params), when measured
    measured: dict[str, int] | None = None
    measured_text: str | None = None
    facts: ModelFacts | None = None  #: the model's header, once planned
    #: the embedding and rerank models served next to this one, decided and planned
    companions: tuple[CompanionLaunch, ...] = ()
    #: how documents stay warm (checkpoints, the RAM cache), when the model's header was read
    documents: DocumentPlan | None = None

    @property
    def measured_headroom(self) -> int | None:
        """Device bytes left once llama.cpp's own figures and the margin are taken (negative:
        it does not fit); None without both a measurement and a device. The one verdict on a
        measured launch, for `plan` and for the refusal before a start."""
        device = device_bytes(self.profile, self.inputs.snapshot)
        if device is None or self.plan is None or not self.measured:
            return None
        return (device - self.measured["total"] - self.plan.config.reserved_bytes
                - self.plan.config.margin)

    @property
    def near_edge(self) -> bool:
        """The planned (or measured) launch leaves less than a tenth of the device, or under
        2 GiB, free: out-of-memory starts are then likely enough to step down by default."""
        device = device_bytes(self.profile, self.inputs.snapshot)
        if device is None or self.plan is None:
            return False
        used = ((self.measured or {}).get("total") or 0) + self.plan.config.reserved_bytes \
            if self.measured else self.plan.total
        return device - used - self.plan.config.margin < max(device // 10, 2 * GiB)

    def cost(self) -> Callable[[LaunchConfig], int] | None:
        """Planned device bytes of a launch derived from this one (the step-down ladder orders
        and checks its steps with it); None when there is no plan to ask."""
        if self.plan is None or self.facts is None:
            return None
        facts, pc0, kv_sizes = self.facts, self.plan.config, self.inputs.kv_sizes
        device = self.plan.device_bytes

        def cost(c: LaunchConfig) -> int:
            pc = plan_config(c, facts, backend=pc0.backend,
                             draft_weight_bytes=pc0.draft_weight_bytes, caps=self.inputs.caps)
            try:
                return planner.plan(facts, pc, device, kv_sizes).total
            except ConfigError:
                return 1 << 62  # cannot be sized: never counted as a saving
        return cost

    @property
    def profile(self) -> Profile:
        return self.inputs.profile

    @property
    def planned(self) -> bool:
        return self.plan_text is not None

    @property
    def memory_text(self) -> str | None:
        """The plan in a line, with llama.cpp's own figures when they were measured."""
        if self.plan_text is None:
            return None
        return self.plan_text + (f"; {self.measured_text}" if self.measured_text else "")

    def step_down(self, step: int) -> LaunchConfig | None:
        """The launch itself for step 0, else the `step`-th cheaper one after out-of-memory
        starts (only KV types the binary offers and the model admits), None past the end."""
        inp = self.inputs
        return step_down(self.launch, step, inp.caps, inp.kv_sizes, cost=self.cost(),
                         facts=self.facts, target=kv_target(inp))

    def render(self, *, host: str = "127.0.0.1", port: int | None = None,
               api_key: str | None = None, cfg: LaunchConfig | None = None,
               slot_save_path: Path | str | None = None,
               endpoint: Endpoint | None = None, webui: bool = False) -> ChildCommand:
        caps = self.inputs.caps
        if caps is None:
            raise MissingToolError("no llama-server to spell the command line for.",
                                   hint="Run `mtpwrap build`, or pass --binary PATH.")
        return render(cfg or self.launch, caps, binary=self.inputs.binary, host=host,
                      port=port, api_key=api_key, slot_save_path=slot_save_path,
                      endpoint=endpoint, webui=webui)

    def companion(self, name: str) -> CompanionLaunch:
        return next(c for c in self.companions if c.name == name)


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


def plan_config(cfg: LaunchConfig, facts: ModelFacts, *, backend: str,
                draft_weight_bytes: int = 0, caps: Capabilities | None = None) -> PlanConfig:
    """The planner's view of a launch: llama.cpp's defaults where the launch leaves one open.
    llama-server with an explicit -np keeps one KV stream per slot unless -kvu is given (its
    unified pool is the default only when -np is left to "auto").

    The compute buffer follows the binary's llama.cpp (`caps.outputs_capped`, read from its
    strings): one that caps the logits rows (upstream 0c1e570) reserves slots × (1 + depth)
    of them and builds the attention mask in f16; one without the cap (the fork at 0bc0a27)
    reserves a whole ubatch and builds the mask in f32 before casting it. Where that is not
    known (no binary), the larger figure of the two is planned."""
    capped = caps is not None and caps.outputs_capped is True
    # the fork's own MTP (--spec-type mtp) is a second model whose context takes -ctk/-ctv
    fork_mtp = cfg.spec_type == "mtp"
    ngl = cfg.gpu_layers
    return PlanConfig(
        n_ctx=cfg.context or int(facts.n_ctx_train or 4096),
        type_k=cfg.cache_k, type_v=cfg.cache_v, n_slots=cfg.slots,
        kv_unified=bool(cfg.kv_unified) or cfg.slots == 1, spec=cfg.spec,
        draft_weight_bytes=draft_weight_bytes,
        draft_depth=cfg.depth or 3,
        type_k_draft=cfg.cache_k if fork_mtp else cfg.draft_k or "f16",
        type_v_draft=cfg.cache_v if fork_mtp else cfg.draft_v or "f16",
        mtp_head_model=fork_mtp, ubatch=cfg.ubatch or 512, batch=cfg.batch or 2048,
        reserved=cfg.reserved,
        flash_attn=cfg.flash_attn != "off",
        n_gpu_layers=ngl if isinstance(ngl, int) else 999, backend=backend,
        cpu_repack=cfg.repack is not False,
        n_outputs=None if capped else cfg.ubatch or 512, mask_f32=not capped)


def limit_types(kv_sizes: dict[str, Any] | None, caps: Capabilities | None = None
                ) -> list[str]:
    """The KV types `mtpwrap plan` lists the largest context for: those the binary offers
    (its `-ctk` values) that are sized (measured or in the built-in table); without a binary,
    the measured ones, else upstream's. Whether the model takes each is `ensure_plan`'s to ask
    (kv.admits)."""
    types = list(kv_sizes) if kv_sizes else planner.supported_kv_types()
    flag = caps.first_of(SPELLINGS["cache_k"]) if caps is not None else None
    offered = (caps.allowed(flag) if caps is not None and flag else None)
    if offered:
        types = [t for t in types if t in offered]
        types += [t for t in kv.TABLE if t in offered and t not in types]
    return [t for t in types if t not in ("f32", "bf16")]


def admitted_types(types: Sequence[str], facts: ModelFacts, target: kv.Target
                   ) -> tuple[list[str], dict[str, str]]:
    """(the types the model takes for K and V on target, {refused type: the reason})."""
    ok: list[str] = []
    refused: dict[str, str] = {}
    for t in types:
        no = [a for a in (kv.admits(facts, t, "K", target), kv.admits(facts, t, "V", target))
              if not a.admitted]
        if no:
            refused[t] = no[0].reason
        else:
            ok.append(t)
    return ok, refused


def read_model(model: Path | str) -> ModelFacts | None:
    """The model's header when the file is here and readable (a preview may name a model not
    fetched yet; a damaged header is reported by the memory plan)."""
    path = Path(model)
    try:
        return gguf_facts.read_facts(path) if path.is_file() else None
    except ConfigError:
        return None


def kv_target(inp: Inputs) -> kv.Target:
    """Where the KV cache will live, and what the build manifest records about the binary."""
    cuda = on_device(inp.profile, inp.snapshot)
    options = getattr(inp.manifest, "cmake_options", None) or {}
    fa_all = options.get("GGML_CUDA_FA_ALL_QUANTS")
    return kv.Target(backend="cuda" if cuda else "cpu",
                     fa_all_quants=None if fa_all is None else str(fa_all).upper() == "ON")


def resolve(profile: Profile, *, snapshot: HardwareSnapshot | None,
            caps: Capabilities | None, model: Path | str, binary: Path | None = None,
            kv_sizes: dict[str, Any] | None = None, plan: bool | None = None,
            kv_limits: Sequence[str] | None = None, inputs: Inputs | None = None,
            refuse: bool = True) -> Resolved:
    """The launch for `profile` on this binary and machine, and its memory plan.

    plan None: plan now when the result can change the launch or refuse it (a GPU profile on a
    GPU, or `context: max`), else later through `ensure_plan`. kv_limits: also compute the
    largest context for each of these KV types (`mtpwrap plan`). A plan that does not fit the
    device is a ConfigError with the numbers (refuse=False: a plan with fits False, to show).
    """
    inp = inputs or Inputs(profile=profile, profile_reason="", snapshot=snapshot, caps=caps,
                           binary=binary, model=str(model), kv_sizes=kv_sizes)
    facts = read_model(model)
    cfg = choose(profile, caps, snapshot, model=model,
                 sized_types=kv.known(kv_sizes) if caps is None else None, facts=facts,
                 target=kv_target(inp))
    cfg = cfg.replace(warnings=cfg.warnings + tuple(kv.differences(kv_sizes)))
    if cfg.spec == "mtp" and facts is not None:
        # planned or not (--no-plan), an MTP launch needs the model's head: llama-server
        # would otherwise fail at load, after the service said it was starting

        planner.require_mtp_head(facts, f"profile {profile.name}'s spec.kind: mtp")
    cfg = _within_trained_context(cfg, facts)
    gpu = on_device(profile, snapshot)
    comps = companions.resolve_companions(
        profile, {c.name: inp.companion_models.get(c.name, c.model)
                  for c in profile.companions}, snapshot, refuse=refuse)
    cfg = companions.chat_threads(cfg, comps, snapshot)
    if gpu:
        cfg = cfg.replace(reserved=companions.reserved_rows(comps))
    elif refuse:
        _check_gpu_companions(comps, snapshot)
    r = Resolved(inputs=inp, launch=cfg, facts=facts, companions=comps)
    if plan or (plan is None and (profile.context == "max" or gpu)):
        r = ensure_plan(r, kv_limits=kv_limits, refuse=refuse)
        if refuse and r.plan is None and gpu:
            why = (r.plan_text or "").removeprefix("not planned (").removesuffix(")")
            raise ConfigError(
                f"profile {profile.name}: the memory plan could not be made ({why}), and a "
                "GPU launch is not started unchecked.",
                hint="Run `mtpwrap build` (it measures the binary's KV types), choose KV types "
                     "the planner knows, or pass --no-plan (MTPWRAP_PLAN=skip) to launch "
                     "unchecked.")
    if gpu and r.plan is None and r.launch.ubatch is None:
        # no plan chose the ubatch (--no-plan, or a plan that could not be made): the
        # smallest, whose compute buffers are the least a GPU launch can have
        r = dataclasses.replace(r, launch=r.launch.replace(
            ubatch=planner.UBATCHES[0],
            why={"ubatch": f"no memory plan chose it: the smallest, {planner.UBATCHES[0]}, "
                           "keeps the compute buffers least"}))
    if refuse and comps:
        chat_host = r.plan.host_total if r.plan is not None else (
            0 if gpu or facts is None else facts.file_size)
        companions.check_ram(chat_host, comps, snapshot)
    return _with_documents(r)


def _within_trained_context(cfg: LaunchConfig, facts: ModelFacts | None) -> LaunchConfig:
    """A slot's context above the model's trained one is capped by llama-server ("exceeds the
    training context of the model - capping") while the plan would show the profile's: cap it
    here, with the reason, unless the profile stretches the model (rope or YaRN flags in its
    extra_args)."""
    train = facts.n_ctx_train if facts is not None else 0
    if not train or not cfg.context or ROPE_FLAGS.intersection(cfg.extra_args):
        return cfg
    per_slot = cfg.context if cfg.kv_unified else cfg.context // max(1, cfg.slots)
    if per_slot <= train:
        return cfg
    capped = train if cfg.kv_unified else train * max(1, cfg.slots)
    note = (f"context {cfg.context:,} asks {per_slot:,} tokens per slot, past the model's "
            f"trained context of {train:,} (its GGUF header), which llama-server caps it to; "
            f"using {capped:,}. Set the context to at most that, or stretch the model with "
            "rope/YaRN flags in the profile's extra_args.")
    return cfg.replace(context=capped, warnings=cfg.warnings + (note,),
                       why={"context": f"{cfg.reason('context')}, capped to the model's trained "
                                       f"context of {train:,} tokens per slot"})


#: the patch whose checkpoints leave the MTP context's KV out (patches/llama.cpp)
CHECKPOINTS_PATCH = "0003-draft-context-checkpoint-size"


def _applied(inp: Inputs, patch: str) -> bool:
    """Whether the binary's build applied `patch` (its manifest says; no manifest: no)."""
    m = inp.manifest
    return m is not None and any(r.get("name") == patch and r.get("status") == "applied"
                                 for r in m.patches or [])


def _with_documents(r: Resolved) -> Resolved:
    """r with its document cache decided (`documents.decide`) and the launch carrying it;
    r itself when the model's header was not read or its KV types cannot be sized."""
    facts, launch, inp = r.facts, r.launch, r.inputs
    if facts is None or not facts.kv_cache or launch.serves is not None:
        return r
    backend = "cuda" if on_device(r.profile, inp.snapshot) else "cpu"
    try:
        pc = plan_config(launch, facts, backend=backend, caps=inp.caps)
        state = planner.sequence_state(facts, pc, inp.kv_sizes,
                                       draft_in_checkpoints=not _applied(inp, CHECKPOINTS_PATCH))
        host = (r.plan if r.plan is not None else
                planner.plan(facts, pc, None, inp.kv_sizes)).host_total
    except ConfigError:
        return r
    slot_context = planner.kv_geometry(pc.n_ctx, pc.n_slots, pc.kv_unified)[1]
    caps, asked = inp.caps, documents.asked_cache_ram(launch.extra_args)
    doc = documents.decide(
        facts, state, slot_context=slot_context, ubatch=launch.ubatch, batch=launch.batch,
        ram=inp.snapshot, host_used=host + sum(c.host_bytes for c in r.companions),
        slots=pc.n_slots, asked=asked,
        has=None if caps is None else lambda f: caps.first_of(SPELLINGS[f]) is not None)
    why = dict(doc.why)
    launch = launch.replace(
        why={field: why[key] for field, key in (
            ("ctx_checkpoints", "checkpoints"), ("checkpoint_every", "min_step"),
            ("batch", "batch"), ("cache_reuse", "cache_reuse"), ("cache_ram", "cache_ram"))
            if key in why},
        ctx_checkpoints=doc.checkpoints, checkpoint_every=doc.min_step,
        batch=doc.batch if doc.batch is not None else launch.batch,
        cache_reuse=doc.cache_reuse, cache_ram=doc.cache_ram_mib if asked is None else None,
        warnings=launch.warnings + doc.warnings)
    return dataclasses.replace(r, launch=launch, documents=doc)


def _check_gpu_companions(comps: Sequence[CompanionLaunch],
                          snapshot: HardwareSnapshot | None) -> None:
    """GPU companions beside a chat model that is not planned on the GPU: they alone must fit
    its free memory, with the margin."""
    need = sum(c.gpu_bytes for c in comps)
    if not need or snapshot is None or not snapshot.gpus:
        return
    g = snapshot.gpus[0]
    free = g.memory_free if g.memory_free is not None else g.memory_total
    if free is not None and need + planner.DEFAULT_MARGIN > free:
        names = ", ".join(f"{c.name} {c.gpu_bytes / GiB:.2f} GiB" for c in comps if c.on_gpu)
        raise ConfigError(
            f"the GPU companions ({names}) need {need / GiB:.2f} GiB plus a "
            f"{planner.DEFAULT_MARGIN / GiB:.2f} GiB margin, but GPU {g.index} has "
            f"{free / GiB:.2f} GiB free.",
            hint="Place a companion on the CPU (device: cpu), or give it a smaller context.")


def ensure_plan(r: Resolved, *, kv_limits: Sequence[str] | None = None,
                refuse: bool = True) -> Resolved:
    """r with its memory plan (r itself when it is planned already): a new Resolved, whose
    `plan_text` is "not planned (why)" when the planner cannot size this configuration; raises
    ConfigError when it does not fit the device. For `context: max` on a device the new one's
    launch has the largest context that fits; where the profile leaves the ubatch open, the
    largest ubatch whose compute buffers fit beside the rest (`planner.choose_ubatch`), with
    the reason."""
    if r.planned and kv_limits is None:
        return r
    prof, inp = r.profile, r.inputs
    device = device_bytes(prof, inp.snapshot)
    backend = "cuda" if on_device(prof, inp.snapshot) else "cpu"
    launch = r.launch
    try:
        facts = r.facts or gguf_facts.read_facts(Path(launch.model))
        draft = (gguf_facts.read_facts(Path(launch.draft_model)).tensor_bytes
                 if launch.spec == "draft" and launch.draft_model else 0)
        pc = plan_config(launch, facts, backend=backend, draft_weight_bytes=draft,
                         caps=inp.caps)
        if prof.context == "max" and device:
            n = planner.largest_context(facts, pc, device, inp.kv_sizes)
            if n > 0:
                launch = launch.replace(
                    context=n, why={"context": "context: max; the memory plan's largest "
                                               "context that fits"})
                pc = dataclasses.replace(pc, n_ctx=n)
        if device and launch.ubatch is None:
            # the profile leaves the ubatch open: the largest whose compute buffers fit
            choice = planner.choose_ubatch(facts, pc, device, inp.kv_sizes,
                                           limit=launch.batch)
            launch = launch.replace(ubatch=choice.ubatch, why={"ubatch": choice.reason})
            pc = choice.plan.config
        if kv_limits is not None:
            target = dataclasses.replace(kv_target(inp), flash_attn=launch.flash_attn or "auto")
            listed, refused = admitted_types(kv_limits, facts, target)
            p = planner.plan_with_limits(facts, pc, device, inp.kv_sizes, kv_types=listed)
            p.not_admitted = refused
        else:
            p = planner.plan(facts, pc, device, inp.kv_sizes)
    except ConfigError as exc:
        # e.g. a KV type the planner has no size for yet: plan nothing rather than refuse.
        return dataclasses.replace(r, launch=launch, plan=None, plan_text=f"not planned ({exc})")
    if device is not None and refuse and not p.fits:
        # the largest context that does fit, for the chosen KV type and each of the profile's
        # fallbacks (it is the context, not everything, that no longer fits)
        wanted = list(dict.fromkeys([pc.type_k, *prof.kv.k, *prof.kv.v]))
        offered = set(limit_types(inp.kv_sizes, inp.caps)) if inp.caps is not None else None
        target = dataclasses.replace(kv_target(inp), flash_attn=launch.flash_attn or "auto")
        listed, _ = admitted_types([t for t in wanted if offered is None or t in offered
                                    or t == pc.type_k], facts, target)
        for t in listed:
            try:
                p.largest_context[t] = planner.largest_context(facts, pc, device, inp.kv_sizes,
                                                               kv_type=t)
            except ConfigError:
                continue  # a type without a known size
        planner.check_fits(p)
    where = "GPU" if device is not None else "host"
    text = f"{p.total / GiB:.2f} GiB on the {where} at context {p.context:,}"
    if p.headroom is not None:
        text += f", headroom {p.headroom / GiB:.2f} GiB"
    return dataclasses.replace(r, launch=launch, facts=facts, plan=p, plan_text=text)
