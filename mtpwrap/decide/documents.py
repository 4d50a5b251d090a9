"""Long documents asked many times: how llama-server keeps a document warm between questions —
context checkpoints, its host RAM prompt cache and KV shifting — decided from the model's
header, the launch's per-sequence sizes (`planner.sequence_state`) and the host's RAM.

What llama-server does (docs/facts.md, "Documents asked many times"):
- on a model whose memory cannot be cut back to any position (hybrid: recurrent layers; or
  sliding-window attention) a request that diverges inside the cached prompt goes back to the
  newest context checkpoint at or before the divergence, else reads everything again. With the
  product's patch 0002 a checkpoint is made every `--checkpoint-min-step` tokens (at the batch
  boundaries), so a new question after a document re-reads at most about that much of it;
- `--cache-ram` MiB of host RAM keep whole sequence states (KV, the MTP context, the recurrent
  state and the checkpoints) of documents no longer in a slot; an entry over the limit is
  skipped without a word, so the plan says how many full-context documents it holds;
- `--cache-reuse` shifts KV to reuse chunks, which leaves a recurrent state describing other
  tokens: it stays 0 on hybrid models.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mtpwrap.decide.gguf_facts import ModelFacts
from mtpwrap.decide.planner import SequenceState
from mtpwrap.decide.vocab import DOCUMENT_FLAGS, SPELLINGS
from mtpwrap.units import GiB, MiB

#: a new question re-reads at most about this many tokens of its document (the checkpoint
#: spacing, and the logical batch the checkpoints are placed at)
REREAD_TOKENS = 1024
#: the checkpoints kept per slot reach this far back from the end of the last prompt, so a
#: question (or instructions) this long still finds a checkpoint before it
QUESTION_TOKENS = 8192
#: checkpoints llama-server places whatever the spacing: the start of the last user message,
#: and 4 + ubatch and 4 tokens before the end of the prompt
EDGE_CHECKPOINTS = 3
#: the host RAM left to the operating system and everything else: this share of the RAM, at
#: least OS_RESERVE_MIN
OS_RESERVE_SHARE = 0.10
OS_RESERVE_MIN = 4 * GiB


@dataclass(frozen=True)
class DocumentPlan:
    """How documents stay warm under one launch; each decided value with its reason."""

    needs_checkpoints: bool  #: hybrid or sliding-window: reuse goes back to checkpoints only
    checkpoints: int | None  #: --ctx-checkpoints (None: llama.cpp's default)
    min_step: int | None  #: --checkpoint-min-step
    batch: int | None  #: -b: checkpoints are placed at batch boundaries
    cache_reuse: int | None  #: --cache-reuse (0 on hybrid models)
    cache_ram_mib: int | None  #: --cache-ram (None: llama.cpp's default)
    context: int  #: tokens of one slot: a full-context document
    entry_bytes: int  #: one full-context document in the RAM cache, checkpoints included
    checkpoint_bytes: int
    ram_budget: int | None  #: host RAM left for the cache (None: RAM not known)
    documents: int | None  #: full-context documents the RAM cache holds
    why: tuple[tuple[str, str], ...] = ()
    warnings: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["why"] = dict(self.why)
        d["warnings"] = list(self.warnings)
        d["summary"] = self.summary()
        return d

    def summary(self) -> str:
        """One line for `plan`, `up` and the status page."""
        held = ("RAM size unknown" if self.documents is None else
                f"holds {self.documents} full-context document(s) of {self.context:,} tokens "
                f"({self.entry_bytes / GiB:.2f} GiB each)")
        ram = ("llama.cpp's default RAM cache" if self.cache_ram_mib is None else
               "no RAM cache" if self.cache_ram_mib == 0 else
               f"RAM cache {self.cache_ram_mib / 1024:.1f} GiB")
        ckpt = (f"a checkpoint every {self.min_step:,} tokens, {self.checkpoints} kept per "
                "slot" if self.needs_checkpoints and self.min_step else
                "only llama.cpp's own checkpoints (the binary lacks the spacing flag)"
                if self.needs_checkpoints else "no checkpoints needed (plain attention)")
        return f"{ram}, {held}; {ckpt}"


def _flag(field: str) -> str:
    """A LaunchConfig field's flag as upstream's --help spells it (its first long spelling)."""
    return next(s for s in SPELLINGS[field] if s.startswith("--"))


def decide(facts: ModelFacts, state: SequenceState, *, slot_context: int, ubatch: int | None,
           batch: int | None, ram_total: int | None, host_used: int, slots: int = 1,
           has: Callable[[str], bool] | None = None) -> DocumentPlan:
    """The document cache of a launch whose `slots` slots hold `slot_context` tokens each.

    `state`: the launch's per-sequence sizes; `batch`/`ubatch`: the profile's, None when it
    leaves them to llama.cpp; `host_used`: RAM the launch itself and its companions take (the
    model's host share, its KV on a CPU, the companions), from the memory plans; `has`: whether
    the binary takes a flag (a LaunchConfig field name; None: not known, all assumed)."""
    why: dict[str, str] = {}
    warnings: list[str] = []
    has = has or (lambda _flag: True)
    lacks = [_flag(f) for f in DOCUMENT_FLAGS if not has(f)]
    needs = bool(facts.recurrent_layers or facts.swa_layers)
    kind = ("hybrid (recurrent layers)" if facts.recurrent_layers else
            "sliding-window attention" if facts.swa_layers else "plain attention")
    checkpoints = min_step = chosen_batch = cache_reuse = None
    n_ckpt = 0
    if needs and not has("checkpoint_min_step"):
        n_ckpt = EDGE_CHECKPOINTS
        why["min_step"] = (
            f"{kind}, and this binary lacks {_flag('checkpoint_min_step')}: only "
            "llama.cpp's own checkpoints (at a user message's start and before the prompt's "
            "end), so a new question after a long one in the same message re-reads the "
            "document")
    elif needs:
        ub = ubatch or 512
        step = max(REREAD_TOKENS, ub)
        chosen_batch = step if batch is None else batch
        min_step = max(step, chosen_batch)
        n_ckpt = math.ceil(QUESTION_TOKENS / min_step) + EDGE_CHECKPOINTS
        checkpoints = n_ckpt if has("ctx_checkpoints") else None
        why["min_step"] = (
            f"{kind}: a new question goes back to the newest checkpoint before it, so one "
            f"every {min_step:,} tokens bounds what it re-reads of the document")
        why["batch"] = ("the profile's logical batch; checkpoints fall on its boundaries"
                        if batch is not None else
                        f"checkpoints fall on batch boundaries: a batch of {chosen_batch:,} "
                        "places them every step")
        grows = (f", up to {state.checkpoint_at(slot_context) / MiB:,.0f} MiB at the "
                 "document's end (each carries the MTP context's KV)"
                 if state.checkpoint_per_token else "")
        why["checkpoints"] = (
            f"{QUESTION_TOKENS:,} tokens of question reach back over {n_ckpt - EDGE_CHECKPOINTS}"
            f" checkpoints, plus the {EDGE_CHECKPOINTS} llama-server places at the message "
            f"and prompt ends; {state.checkpoint / MiB:.1f} MiB each{grows}")
    if facts.recurrent_layers and has("cache_reuse"):
        cache_reuse = 0
        why["cache_reuse"] = ("off: KV shifting leaves the recurrent state describing "
                              "other tokens on a hybrid model")
    entry = state.entry(slot_context, n_ckpt)
    budget = None
    cache_ram = None
    documents = None
    if ram_total:
        reserve = max(OS_RESERVE_MIN, int(ram_total * OS_RESERVE_SHARE))
        # the slots' own checkpoints live in host RAM beside the cache
        held = slots * n_ckpt * state.checkpoint_at(slot_context)
        budget = ram_total - reserve - host_used - held
        cache_ram = max(0, budget // MiB) if has("cache_ram") else None
        documents = max(0, budget) // entry if entry else 0
        why["cache_ram"] = (
            f"host RAM {ram_total / GiB:.1f} GiB less {reserve / GiB:.1f} GiB for the system, "
            f"{host_used / GiB:.2f} GiB the model and its companions hold and "
            f"{held / GiB:.2f} GiB of the slots' checkpoints: "
            f"{max(0, budget) / GiB:.1f} GiB, {documents} full-context document(s) of "
            f"{entry / GiB:.2f} GiB")
        if not has("cache_ram"):
            why["cache_ram"] = "this binary lacks --cache-ram: llama.cpp's own prompt cache"
            documents = None
        elif documents < 1:
            warnings.append(
                f"one full-context document ({slot_context:,} tokens, {entry / GiB:.2f} GiB of "
                f"state) is larger than the RAM left for llama-server's prompt cache "
                f"({max(0, budget) / GiB:.2f} GiB): a document that long is not kept in RAM "
                "when another takes its slot (llama-server skips an entry over its limit), "
                "shorter ones are. Use a smaller context or KV type, or add RAM.")
    return DocumentPlan(
        needs_checkpoints=needs, checkpoints=checkpoints, min_step=min_step,
        batch=chosen_batch, cache_reuse=cache_reuse, cache_ram_mib=cache_ram,
        context=slot_context, entry_bytes=entry, checkpoint_bytes=state.checkpoint,
        ram_budget=budget, documents=documents, why=tuple(why.items()),
        warnings=tuple(warnings) + ((f"this binary lacks {', '.join(lacks)}: documents stay "
                                     "warm as llama.cpp's defaults allow (see the plan's "
                                     "documents lines)",) if lacks else ()))
