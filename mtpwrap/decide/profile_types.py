"""What a profile says, as frozen types: the hardware it is for, the KV types with fallbacks,
speculation (with the per-class depth policy), batch sizes and the opt-ins. `profiles` reads
and checks the YAML files that make them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from mtpwrap.decide.hardware import GpuInfo


@dataclass(frozen=True)
class HardwareReq:
    requires_gpu: bool = True
    gpu_name: str | None = None  # regular expression, searched case-insensitively
    min_memory_gib: float | None = None

    def matches(self, gpu: GpuInfo) -> bool:
        if self.gpu_name and not re.search(self.gpu_name, gpu.name or "", re.IGNORECASE):
            return False
        if self.min_memory_gib is not None:
            have = gpu.memory_total_gib
            if have is None or have < self.min_memory_gib:
                return False
        return True

    def describe(self) -> str:
        if not self.requires_gpu:
            return "any machine (no GPU needed)"
        parts = [f"GPU /{self.gpu_name}/" if self.gpu_name else "any GPU"]
        if self.min_memory_gib is not None:
            parts.append(f">= {self.min_memory_gib:g} GiB")
        return " ".join(parts)


@dataclass(frozen=True)
class KvTypes:
    k: tuple[str, ...] = ("f16",)
    v: tuple[str, ...] = ("f16",)
    #: why the lists are in this order (e.g. the figures `bench kv --write` measured); the
    #: launch's reason for its KV choice quotes it
    why: str | None = None


@dataclass(frozen=True)
class ClassPolicy:
    """spec.policy.<class>: the draft depth for one request class (0 = no speculation)."""

    depth: int
    p_min: float | None = None


@dataclass(frozen=True)
class SpecAdapt:
    """spec.adapt: online learning of each request class's draft depth (front/depth_policy)."""

    enabled: bool = True
    #: the verification step's cost model r(k) = overhead + per_draft·k, in decode steps
    #: (what `mtpwrap tune` fits as a and c)
    overhead: float = 1.0
    per_draft: float = 0.1
    #: share of a class's requests that still speculate while the class is off
    probe_share: float = 0.05
    #: drafted tokens after which an old observation weighs half as much
    half_life_tokens: float = 256.0


@dataclass(frozen=True)
class Speculation:
    kind: str = "none"
    depth: int | None = None
    p_min: float | None = None
    draft_model: str | None = None
    draft_kv: KvTypes | None = None
    ngram_n: int | None = None  #: ngram kind: length of the lookup n-gram
    #: spec.policy: request class -> ClassPolicy, as sorted (class, policy) pairs
    policy: tuple[tuple[str, ClassPolicy], ...] = ()
    adapt: SpecAdapt = field(default_factory=SpecAdapt)


@dataclass(frozen=True)
class Companion:
    """companions[i]: an embedding or rerank model served by its own llama-server next to the
    chat model (keys: `mtpwrap.config.table.COMPANION`)."""

    name: str
    role: str  #: embedding | rerank
    model: str
    device: str = "cpu"  #: cpu | gpu
    context: int = 2048
    slots: int = 1
    threads: int | None = None
    pooling: str | None = None
    ubatch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    model: str
    context: int | str  # tokens, or "max"
    hardware: HardwareReq = field(default_factory=HardwareReq)
    kv: KvTypes = field(default_factory=KvTypes)
    spec: Speculation = field(default_factory=Speculation)
    gpu_layers: int | str | None = None  # a number, "all" or "auto"
    threads: int | None = None
    batch: int | None = None
    ubatch: int | None = None
    slots: int = 1
    flash_attn: str = "auto"
    mlock: bool = False
    no_warmup: bool = False
    extra_args: tuple[str, ...] = ()
    #: extra_args may raise llama-server's log verbosity, which logs prompts and answers
    log_prompts: bool = False
    #: extra_args may pass --rpc (llama.cpp's RPC protocol has no authentication)
    allow_rpc: bool = False
    #: extra_args may pass --tools, --agent, MCP flags (the model acts on the machine)
    allow_tools: bool = False
    supervisor: Mapping[str, Any] = field(default_factory=dict)
    proxy: Mapping[str, Any] = field(default_factory=dict)
    #: embedding and rerank models served next to the chat model
    companions: tuple[Companion, ...] = ()
    source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "hardware": {"requires_gpu": self.hardware.requires_gpu,
                         "gpu_name": self.hardware.gpu_name,
                         "min_memory_gib": self.hardware.min_memory_gib},
            "model": self.model,
            "context": self.context,
            "kv": {"k": list(self.kv.k), "v": list(self.kv.v), "why": self.kv.why},
            "spec": {"kind": self.spec.kind, "depth": self.spec.depth, "p_min": self.spec.p_min,
                     "draft_model": self.spec.draft_model,
                     "draft_kv": None if self.spec.draft_kv is None else
                     {"k": list(self.spec.draft_kv.k), "v": list(self.spec.draft_kv.v)},
                     "ngram_n": self.spec.ngram_n,
                     "policy": {name: {"depth": p.depth, "p_min": p.p_min}
                                for name, p in self.spec.policy},
                     "adapt": asdict(self.spec.adapt)},
            "gpu_layers": self.gpu_layers,
            "threads": self.threads,
            "batch": self.batch,
            "ubatch": self.ubatch,
            "slots": self.slots,
            "flash_attn": self.flash_attn,
            "mlock": self.mlock,
            "no_warmup": self.no_warmup,
            "extra_args": list(self.extra_args),
            "log_prompts": self.log_prompts,
            "allow_rpc": self.allow_rpc,
            "allow_tools": self.allow_tools,
            "supervisor": dict(self.supervisor),
            "proxy": dict(self.proxy),
            "companions": [c.to_dict() for c in self.companions],
            "source": self.source,
        }
        return d

    def summary(self) -> dict[str, Any]:
        """One row of `mtpwrap profiles list`."""
        spec = self.spec.kind if self.spec.kind == "none" else (
            f"{self.spec.kind} depth {self.spec.depth}" if self.spec.depth else self.spec.kind)
        return {
            "name": self.name,
            "hardware": self.hardware.describe(),
            "context": self.context,
            "kv": f"K {'>'.join(self.kv.k)} / V {'>'.join(self.kv.v)}",
            "speculation": spec,
            "description": self.description,
            "source": self.source,
        }
