"""`models inspect`: what a GGUF is, from its header alone — what it is made for (chat,
embedding, rerank: `gguf_facts.model_role`), architecture, size, quantisation, attention shape,
MTP head —, the KV cache types it admits (the one admission rule, `decide.kv.admits`) and the
profiles that fit it on a GPU (through `decide.resolve`, the one planner caller); an embedding or
rerank model is served as a companion instead."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide import gguf_facts, kv, profiles, resolve
from mtpwrap.decide.gguf_facts import SPLIT
from mtpwrap.decide.vocab import KV_TYPES, SPELLINGS
from mtpwrap.errors import ConfigError
from mtpwrap.units import GiB

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities
    from mtpwrap.decide.gguf_facts import ModelFacts
    from mtpwrap.decide.hardware import HardwareSnapshot

_BLK = re.compile(r"^blk\.(\d+)\.")


def in_head(tensor_name: str, trunk_layers: int) -> bool:
    """Whether a tensor belongs to a block after the trunk: the MTP (nextn) head."""
    m = _BLK.match(tensor_name)
    return m is not None and int(m.group(1)) >= trunk_layers


def _shards(path: Path, meta: dict[str, Any]) -> list[Path]:
    n = int(meta.get("split.count", 1) or 1)
    m = SPLIT.match(path.name)
    if n <= 1 or not m:
        return [path]
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def mtp_state(facts: ModelFacts, tensors: Sequence[gguf_facts.TensorInfo]) -> dict[str, Any]:
    """The MTP (nextn) head as the metadata declares it and as the tensors hold it: a fine-tune
    that lost its head may still declare one."""
    head = [t for t in tensors if in_head(t.name, facts.n_layer)]
    present = facts.n_layer_nextn > 0 and bool(head)
    state = ("yes" if present else "declared, but its tensors are missing"
             if facts.n_layer_nextn else "no")
    return {"present": present, "state": state, "layers": facts.n_layer_nextn,
            "tensors": len(head), "bytes": sum(t.n_bytes for t in head)}


def describe(path: Path) -> tuple[dict[str, Any], ModelFacts]:
    """The header's facts as a person reads them (`models inspect`, `models list`)."""
    facts = gguf_facts.read_facts(path)
    meta, tensors, _, _ = gguf_facts.read_header(path)
    for shard in _shards(path, meta)[1:]:
        tensors = tensors + gguf_facts.read_header(shard)[1]
    mix: dict[str, dict[str, int]] = {}
    for t in tensors:
        row = mix.setdefault(t.ggml_type, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += t.n_bytes
    mix = dict(sorted(mix.items(), key=lambda kv_: -kv_[1]["bytes"]))
    trunk_kv = sorted({facts.kv_heads(il)[2] for il in facts.kv_layers})
    role, role_why = gguf_facts.model_role(facts)
    info: dict[str, Any] = {
        "file": str(path),
        "size_bytes": facts.file_size,
        "architecture": facts.architecture,
        "name": facts.name,
        "role": role,
        "role_why": role_why,
        "pooling": facts.pooling,
        "embedding_dimensions": facts.n_cls_out if role == "rerank" else facts.n_embd_out,
        "causal_attention": facts.causal_attention,
        "parameters": sum(math.prod(t.shape) for t in tensors),
        "quantisation": mix,
        "file_type": next(iter(mix), None),
        "context_trained": facts.n_ctx_train,
        "layers": facts.n_layer,
        "blocks": facts.n_layer_all,
        "embedding": facts.n_embd,
        "vocab": facts.n_vocab,
        "heads": max(facts.n_head) if facts.n_head else 0,
        "kv_heads": trunk_kv,
        "head_size": {"k": facts.head_dim_k, "v": facts.head_dim_v,
                      **({"k_swa": facts.head_dim_k_swa, "v_swa": facts.head_dim_v_swa}
                         if facts.head_dim_k_swa else {})},
        "kv_cache": facts.kv_cache,
        "kv_layers": len(facts.kv_layers) if facts.kv_cache else 0,
        "swa_layers": len(facts.swa_layers),
        "sliding_window": facts.sliding_window or None,
        "recurrent_layers": len(facts.recurrent_layers),
        "mtp": mtp_state(facts, tensors),
        "chat_template": isinstance(meta.get("tokenizer.chat_template"), str),
        "warnings": list(facts.warnings),
    }
    return info, facts


def offered_kv_types(caps: Capabilities | None) -> tuple[list[str], str]:
    """(types, where from): the binary's `-ctk` values, else every type the product knows."""
    if caps is not None:
        flag = caps.first_of(SPELLINGS["cache_k"])
        allowed = caps.allowed(flag) if flag else None
        if allowed:
            return list(allowed), caps.describe()
    return list(KV_TYPES), "no built llama-server: every type the product knows"


def kv_admission(facts: ModelFacts, types: Sequence[str], *, backend: str) -> list[dict[str, Any]]:
    target = kv.Target(backend=backend, flash_attn="on")
    out = []
    for t in types:
        k, v = kv.admits(facts, t, "K", target), kv.admits(facts, t, "V", target)
        bits = kv.TABLE[t].bits if t in kv.TABLE else None
        out.append({"type": t, "bits": bits, "k": k.admitted, "v": v.admitted,
                    "reason": k.reason if not k.admitted else v.reason,
                    "checked": t in kv.TABLE})
    return out


def fitting_profiles(path: Path, snapshot: HardwareSnapshot | None, caps: Capabilities | None,
                     kv_sizes: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Each shipped (and user) profile with this model: fits or not, at which context and KV
    type, and how much memory, on `snapshot` — through `resolve`."""
    rows = []
    for p in profiles.list_profiles():
        row: dict[str, Any] = {"profile": p.name, "fits": False, "where": None,
                               "context": None, "kv": None, "total_gib": None,
                               "headroom_gib": None, "note": ""}
        rows.append(row)
        if p.hardware.requires_gpu and not (snapshot and snapshot.gpus):
            row["note"] = "needs a GPU"
            continue
        try:
            prof = profiles.with_overrides(p, {"model": str(path)}, where=f"profile {p.name}")
            r = resolve.resolve(prof, snapshot=snapshot, caps=caps, model=path,
                                kv_sizes=kv_sizes, plan=True, refuse=False,
                                kv_limits=list(dict.fromkeys(p.kv.k)))
        except ConfigError as exc:
            row["note"] = str(exc)
            continue
        row.update(where="gpu" if resolve.on_device(prof, snapshot) else "host",
                   context=r.plan.context if r.plan else r.launch.context,
                   kv=f"{r.launch.cache_k}/{r.launch.cache_v}")
        if r.plan is None:
            row["note"] = r.plan_text or "not planned"
            continue
        row["total_gib"] = round(r.plan.total / GiB, 2)
        if r.plan.headroom is not None:
            row["headroom_gib"] = round(r.plan.headroom / GiB, 2)
        if r.plan.fits is None:  # the host: what the machine has free
            free = snapshot.ram_available if snapshot else None
            row["fits"] = free is None or r.plan.total + r.plan.host_total <= free
            row["note"] = ("host memory" + (f", {free / GiB:.1f} GiB free" if free else ""))
        else:
            row["fits"] = bool(r.plan.fits)
            if not r.plan.fits and r.plan.largest_context:
                row["note"] = "largest context that fits: " + ", ".join(
                    f"{t} {n:,}" if n > 0 else f"{t} none"
                    for t, n in r.plan.largest_context.items())
    return rows


def inspect(path: Path, *, snapshot: HardwareSnapshot | None = None,
            caps: Capabilities | None = None, kv_sizes: dict[str, Any] | None = None,
            profiles: bool = True) -> dict[str, Any]:
    """Everything `models inspect` shows, as data."""
    info, facts = describe(path)
    backend = "cuda" if snapshot is not None and snapshot.gpus else "cpu"
    if facts.kv_cache:
        types, source = offered_kv_types(caps)
        info["kv_types_from"] = source
        info["kv"] = kv_admission(facts, types, backend=backend)
    else:
        info["kv_types_from"] = f"none: llama.cpp runs {facts.architecture} without a KV cache"
        info["kv"] = []
    if snapshot is not None:
        gpu = (snapshot.gpus[0].name or "GPU 0") if snapshot.gpus else "CPU only"
        info["hardware"] = f"{gpu} ({snapshot.source})"
    if profiles and info["role"] != "chat":
        info["profiles"] = []
        info["companion"] = companion_note(info["role"], facts.pooling)
    elif profiles:
        info["profiles"] = fitting_profiles(path, snapshot, caps, kv_sizes)
    return info


def companion_note(role: str, pooling: str | None) -> str:
    """Where an embedding or rerank model goes instead of a chat profile, in one line."""
    serves = ("--reranking" if role == "rerank"
              else "--embeddings" + (f" --pooling {pooling}" if pooling else ""))
    article = "an" if role[:1] in "aeiou" else "a"
    return (f"{article} {role} model is served as a companion next to a chat model (a profile's "
            f"`companions:` list, role: {role}; llama-server {serves}), not by a chat profile")
