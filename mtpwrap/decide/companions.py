"""Companions: embedding and rerank models served next to the chat model, each by its own
llama-server. What each one runs (`CompanionLaunch`: a `LaunchConfig` with --embeddings or
--reranking, its pooling and its name), what it costs (its own memory plan: on the GPU its
bytes come off the device before the chat model is planned, on the CPU they are counted
against RAM) and what it takes from the chat model (CPU threads).

Pure: the model files are found by `mtpwrap.supervision.inputs`, the headers read here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtpwrap.decide import gguf_facts, planner
from mtpwrap.decide.launch import LaunchConfig
from mtpwrap.decide.planner import MemoryPlan, PlanConfig
from mtpwrap.errors import ConfigError
from mtpwrap.units import GiB, MiB

if TYPE_CHECKING:
    from mtpwrap.decide.gguf_facts import ModelFacts
    from mtpwrap.decide.hardware import HardwareSnapshot
    from mtpwrap.decide.profile_types import Companion, Profile

#: the flag each role turns on
SERVES = {"embedding": "embeddings", "rerank": "reranking"}


@dataclass(frozen=True)
class CompanionLaunch:
    """One companion, decided: its launch and its memory plan (None: its header could not be
    read, and `plan_text` says why)."""

    companion: Companion
    launch: LaunchConfig
    plan: MemoryPlan | None
    plan_text: str
    facts: ModelFacts | None = None  #: its header, when it could be read

    @property
    def n_vocab(self) -> int | None:
        """Its vocabulary's size (the front checks token ids against it), None unknown."""
        return self.facts.n_vocab if self.facts is not None and self.facts.n_vocab > 0 \
            else None

    @property
    def name(self) -> str:
        return self.companion.name

    @property
    def role(self) -> str:
        return self.companion.role

    @property
    def on_gpu(self) -> bool:
        return self.companion.device == "gpu"

    @property
    def gpu_bytes(self) -> int:
        """What it holds on the GPU (0 on the CPU)."""
        return self.plan.total if self.on_gpu and self.plan is not None else 0

    @property
    def host_bytes(self) -> int:
        """What it holds in RAM: everything on the CPU (the planner's rows are all host
        rows there); on the GPU, the rows llama.cpp keeps on the host (the logits)."""
        return self.plan.host_total if self.plan is not None else 0

    def reserved_row(self) -> tuple[str, int, str]:
        """The chat model's plan row for this GPU companion."""
        assert self.plan is not None
        parts = ", ".join(f"{r.name} {r.bytes / MiB:,.0f} MiB" for r in self.plan.rows
                          if r.where == "gpu" and r.bytes and r.name != "margin")
        return (f"companion {self.name} ({self.role})", self.gpu_bytes,
                f"its own llama-server: {parts}")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "role": self.role, "device": self.companion.device,
                "model": self.launch.model, "context": self.launch.context,
                "slots": self.launch.slots, "threads": self.launch.threads,
                "pooling": self.launch.pooling, "gpu_bytes": self.gpu_bytes,
                "host_bytes": self.host_bytes, "plan": self.plan_text}


def default_threads(c: Companion, snapshot: HardwareSnapshot | None) -> int:
    """A CPU companion's threads when the profile gives none: a quarter of the cores (at
    least 1); a GPU companion computes on the device and needs one."""
    if c.threads is not None:
        return c.threads
    if c.device == "gpu":
        return 1
    cores = (snapshot.cpu_physical or snapshot.cpu_logical or 1) if snapshot else 1
    return max(1, cores // 4)


def choose(c: Companion, model: Path | str, profile: str,
           snapshot: HardwareSnapshot | None, facts: ModelFacts | None = None,
           where: str = "") -> LaunchConfig:
    """The launch of one companion: all layers on its device, f16 KV, one physical batch as
    large as its context (llama-server refuses an embedding input longer than the ubatch).

    With mean pooling (the profile's, or the model's own from its header) llama.cpp's
    reserve graph splits the physical batch evenly among the slots and aborts at load
    (`GGML_ASSERT(ggml_can_mul_mat(a, b))`) when it cannot: the default batch is rounded
    down to a multiple of the slots, a batch the profile gives is refused."""
    ubatch = c.ubatch or c.context
    pooling = c.pooling or (facts.pooling if facts is not None else None)
    if c.role == "embedding" and (c.pooling == "none" or (facts is not None and not pooling)):
        whose = ("the profile sets pooling: none" if c.pooling else
                 f"{Path(str(model)).name} names no pooling type in its header and the profile "
                 "gives none")
        raise ConfigError(
            f"{where or c.name}: {whose}, so llama-server would pool with none and refuse "
            "every /v1/embeddings request (400, not OpenAI-compatible); set pooling: mean, cls "
            "or last.")
    ubatch_why = ("from the profile" if c.ubatch else
                  "the whole context: an input longer than the physical batch is refused")
    if c.role == "embedding" and pooling == "mean" and ubatch % c.slots:
        fitted = ubatch - ubatch % c.slots
        if c.ubatch:
            raise ConfigError(
                f"{where or c.name}: ubatch {c.ubatch} with {c.slots} slots and mean pooling: "
                "llama.cpp aborts at load unless the physical batch is a multiple of the "
                f"slots; use {fitted}" + (f" or {fitted + c.slots}." if fitted + c.slots
                                           <= c.context else "."))
        ubatch, ubatch_why = fitted, (f"the context rounded down to a multiple of the "
                                      f"{c.slots} slots (mean pooling splits it evenly)")
    pooling_why = ("a reranker scores with rank pooling (--reranking)" if c.role == "rerank"
                   else "pooling from the profile" if c.pooling else "")
    why = {
        "model": f"companion {c.name} of profile {profile} ({c.model})",
        "context": "the companion's context",
        "slots": "the companion's slots",
        "gpu_layers": f"device: {c.device}",
        "threads": ("the companion's threads" if c.threads is not None else
                    "a quarter of the cores, at least 1" if c.device == "cpu" else
                    "it computes on the GPU"),
        "batch": "as large as the physical batch",
        "ubatch": ubatch_why,
        "cache_k": "f16: a companion's cache is small",
        "cache_v": "f16: a companion's cache is small",
        "flash_attn": "llama.cpp's default",
        "serves": f"role {c.role}: only the {c.role} endpoints",
        "alias": "the name clients send as `model`",
    }
    if pooling_why:
        why["pooling"] = pooling_why
    return LaunchConfig(
        profile=f"{profile}/{c.name}", model=str(model), context=c.context, cache_k="f16",
        cache_v="f16", slots=c.slots, gpu_layers=999 if c.device == "gpu" else 0,
        threads=default_threads(c, snapshot), batch=ubatch, ubatch=ubatch,
        serves=SERVES[c.role], pooling=c.pooling if c.role == "embedding" else None,
        alias=c.name, why=tuple(why.items()))


def plan_companion(cfg: LaunchConfig, on_gpu: bool, facts: ModelFacts | None
                   ) -> tuple[MemoryPlan | None, str]:
    """The companion's own memory plan (weights, KV, compute, the backend's context), or None
    and why not."""
    try:
        facts = facts or gguf_facts.read_facts(Path(cfg.model))
        pc = PlanConfig(n_ctx=cfg.context, type_k="f16", type_v="f16", n_slots=cfg.slots,
                        kv_unified=cfg.slots == 1, ubatch=cfg.ubatch or 512,
                        batch=cfg.batch or 2048, n_gpu_layers=999 if on_gpu else 0,
                        backend="cuda" if on_gpu else "cpu", margin=0, n_outputs=cfg.slots)
        p = planner.plan(facts, pc, None)
    except ConfigError as exc:
        return None, f"not planned ({exc})"
    where = "GPU" if on_gpu else "host"
    return p, f"{(p.total if on_gpu else p.host_total) / GiB:.2f} GiB on the {where}"


def resolve_companions(profile: Profile, models: Mapping[str, Path | str],
                       snapshot: HardwareSnapshot | None, *, refuse: bool = True
                       ) -> tuple[CompanionLaunch, ...]:
    """Every companion of `profile` decided and planned; `models` maps each name to its file.
    A GPU companion on a machine without a GPU, or one whose file cannot be sized, is refused
    here (refuse=False: shown as not planned): its bytes would otherwise go uncounted."""
    out: list[CompanionLaunch] = []
    for i, c in enumerate(profile.companions):
        where = f"profile {profile.name}: companions[{i}] ({c.name})"
        if refuse and c.device == "gpu" and (snapshot is None or not snapshot.has_gpu):
            why = snapshot.error if snapshot is not None and snapshot.error else "none was found"
            raise ConfigError(f"{where}: device gpu, but this machine has no GPU ({why}).",
                              hint="Set the companion's device: cpu, or run on the machine "
                                   "with the GPU.")
        try:
            facts: ModelFacts | None = gguf_facts.read_facts(Path(models[c.name])) \
                if Path(models[c.name]).is_file() else None
        except ConfigError:
            facts = None  # the plan says why
        cfg = choose(c, models[c.name], profile.name, snapshot, facts, where)
        plan, text = plan_companion(cfg, c.device == "gpu", facts)
        if refuse and plan is None and c.device == "gpu":
            raise ConfigError(f"{where}: its memory cannot be planned, and its GPU bytes would "
                              f"go uncounted: {text.removeprefix('not planned (')[:-1]}")
        out.append(CompanionLaunch(c, cfg, plan, text, facts))
    return tuple(out)


def reserved_rows(companions: Sequence[CompanionLaunch]) -> tuple[tuple[str, int, str], ...]:
    """The chat model's plan rows for what GPU companions hold."""
    return tuple(c.reserved_row() for c in companions if c.on_gpu and c.plan is not None)


def chat_threads(chat: LaunchConfig, companions: Sequence[CompanionLaunch],
                 snapshot: HardwareSnapshot | None) -> LaunchConfig:
    """The chat model's launch with its threads adjusted to what CPU companions take, so that
    the processes together never ask for more threads than the machine has cores. A profile
    that sets threads that no longer fit beside the companions is refused with the numbers."""
    taken = sum(c.launch.threads or 0 for c in companions if not c.on_gpu)
    if not taken or snapshot is None:
        return chat
    cores = snapshot.cpu_physical or snapshot.cpu_logical
    if not cores:
        return chat
    names = ", ".join(f"{c.name} {c.launch.threads}" for c in companions if not c.on_gpu)
    if chat.threads is not None:
        if chat.threads + taken > cores:
            raise ConfigError(
                f"profile {chat.profile}: threads {chat.threads} for the chat model and "
                f"{taken} for CPU companions ({names}) exceed the {cores} cores here.",
                hint="Lower the profile's threads or a companion's threads, or leave the "
                     "profile's threads unset so that the chat model takes what is left.")
        return chat
    left = cores - taken
    if left < 1:
        raise ConfigError(
            f"profile {chat.profile}: CPU companions take {taken} threads ({names}), all "
            f"{cores} cores here, and leave none for the chat model.",
            hint="Give the companions fewer threads (companions[].threads), or place one on "
                 "the GPU (device: gpu).")
    return chat.replace(threads=left, why={
        "threads": f"{cores} cores less {taken} for CPU companions ({names})"})


def check_ram(chat_host_bytes: int, companions: Sequence[CompanionLaunch],
              snapshot: HardwareSnapshot | None) -> None:
    """CPU companions are planned against RAM: they and the chat model's host share must fit
    in the memory available now."""
    if snapshot is None or not snapshot.ram_available or not companions:
        return
    need = chat_host_bytes + sum(c.host_bytes for c in companions)
    if need <= snapshot.ram_available:
        return
    parts = ", ".join(f"{c.name} {c.host_bytes / GiB:.2f} GiB" for c in companions)
    raise ConfigError(
        f"the chat model ({chat_host_bytes / GiB:.2f} GiB in RAM) and its companions ({parts}) "
        f"need {need / GiB:.2f} GiB of RAM, but {snapshot.ram_available / GiB:.2f} GiB is "
        "available.",
        hint="Give a companion a smaller context or fewer slots, place it on the GPU, or free "
             "memory.")
