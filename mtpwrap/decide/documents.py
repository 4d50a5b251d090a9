"""Long documents asked many times: how llama-server keeps a document warm between questions —
context checkpoints, its host RAM prompt cache and KV shifting — decided from the model's
header, the launch's per-sequence sizes (`planner.sequence_state`) and the host's RAM.

What llama-server does (docs/facts.md, "Documents asked many times"):
- on a model whose memory cannot be cut back to any position (hybrid: recurrent layers; or
  sliding-window attention) a request that diverges inside the cached prompt goes back to the
  newest context checkpoint at or before the divergence, else reads everything again. With
  `--checkpoint-every-n-tokens` (the fork's flag; the product's patch 0002 adds it upstream) a
  checkpoint is made every that many tokens of a read, so a new question after a document
  re-reads at most about that much of it;
- `--cache-ram` MiB of host RAM keep whole sequence states (KV, the MTP context, the recurrent
  state and the checkpoints) of documents no longer in a slot; an entry over the limit is
  skipped without a word, so the plan says how many full-context documents it holds; 0 turns
  the cache off, so the plan never sets it (a profile's extra_args may);
- `--cache-reuse` shifts KV to reuse chunks, which leaves a recurrent state describing other
  tokens: it stays 0 on hybrid models.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from mtpwrap.decide.gguf_facts import ModelFacts
from mtpwrap.decide.planner import SequenceState
from mtpwrap.decide.vocab import DOCUMENT_FLAGS, SPELLINGS
from mtpwrap.units import GiB, MiB

if TYPE_CHECKING:
    from mtpwrap.decide.hardware import HardwareSnapshot

#: a new question re-reads at most about this many tokens of its document (the checkpoint
#: spacing, and the logical batch the checkpoints are placed at)
REREAD_TOKENS = 1024
#: the checkpoints kept per slot reach this far back from the end of the last prompt, so a
#: question (or instructions) this long still finds a checkpoint before it
QUESTION_TOKENS = 8192
#: checkpoints llama-server places whatever the spacing: the start of the last user message,
#: and 4 + ubatch and 4 tokens before the end of the prompt
EDGE_CHECKPOINTS = 3
#: the RAM available at start left free beside the cache: this share of the host's RAM, at
#: least OS_RESERVE_MIN
OS_RESERVE_SHARE = 0.10
OS_RESERVE_MIN = 4 * GiB
#: the least RAM cache the plan sets, however little RAM is left (0 would turn it off): one
#: document of FLOOR_TOKENS with its checkpoints, and at least FLOOR_MIN
FLOOR_TOKENS = 8192
FLOOR_MIN = GiB


@dataclass(frozen=True)
class DocumentPlan:
    """How documents stay warm under one launch; each decided value with its reason."""

    needs_checkpoints: bool  #: hybrid or sliding-window: reuse goes back to checkpoints only
    checkpoints: int | None  #: --ctx-checkpoints (None: llama.cpp's default)
    min_step: int | None  #: the checkpoint spacing: --checkpoint-every-n-tokens
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
        return {**asdict(self), "why": dict(self.why), "warnings": list(self.warnings),
                "summary": self.summary()}

    def summary(self) -> str:
        """One line for `plan`, `up` and the status page."""
        held = ("RAM size unknown" if self.documents is None else
                f"holds {self.documents} full-context document(s) of {self.context:,} tokens "
                f"({self.entry_bytes / GiB:.2f} GiB each)")
        ram = ("llama.cpp's default RAM cache" if self.cache_ram_mib is None else
               "no RAM cache" if self.cache_ram_mib == 0 else "RAM cache without a limit"
               if self.cache_ram_mib < 0 else f"RAM cache {self.cache_ram_mib / 1024:.1f} GiB")
        ckpt = (f"a checkpoint every {self.min_step:,} tokens, {self.checkpoints} kept per "
                "slot" if self.needs_checkpoints and self.min_step else
                "only llama.cpp's own checkpoints (the binary lacks the spacing flag)"
                if self.needs_checkpoints else "no checkpoints needed (plain attention)")
        return f"{ram}, {held}; {ckpt}"


def _flag(field: str) -> str:
    """A LaunchConfig field's flag as upstream's --help spells it (its first long spelling)."""
    return next(s for s in SPELLINGS[field] if s.startswith("--"))


def asked_cache_ram(extra_args: Sequence[str]) -> int | None:
    """The --cache-ram a profile's extra_args set (passed after the planned flags, the last
    one counts), None when they set none."""
    asked = None
    for a, after in zip(extra_args, [*extra_args[1:], ""], strict=False):
        flag, eq, value = a.partition("=")
        if flag in SPELLINGS["cache_ram"] and re.fullmatch(r"-?[0-9]+", v := value if eq
                                                            else after):
            asked = int(v)
    return asked


def decide(facts: ModelFacts, state: SequenceState, *, slot_context: int, ubatch: int | None,
           batch: int | None, ram: HardwareSnapshot | None, host_used: int, slots: int = 1,
           asked: int | None = None, has: Callable[[str], bool] | None = None) -> DocumentPlan:
    """The document cache of a launch whose `slots` slots hold `slot_context` tokens each.

    `state`: the launch's per-sequence sizes; `batch`/`ubatch`: the profile's, None when it
    leaves them to llama.cpp; `ram`: the snapshot whose RAM (available when it was read, else
    the total) sizes the cache; `host_used`: RAM the launch itself and its companions will take
    (the model's host share, its KV on a CPU, the companions), from the memory plans; `asked`:
    the profile's own --cache-ram (`asked_cache_ram`), which stands; `has`: whether the binary
    takes a flag (a LaunchConfig field name; None: not known, all assumed)."""
    why: dict[str, str] = {}
    warnings: list[str] = []
    has = has or (lambda _flag: True)
    lacks = [_flag(f) for f in DOCUMENT_FLAGS if not has(f)]
    needs = bool(facts.recurrent_layers or facts.swa_layers)
    kind = ("hybrid (recurrent layers)" if facts.recurrent_layers else
            "sliding-window attention" if facts.swa_layers else "plain attention")
    checkpoints = min_step = chosen_batch = cache_reuse = None
    n_ckpt = 0
    if needs and not has("checkpoint_every"):
        n_ckpt = EDGE_CHECKPOINTS
        why["min_step"] = (
            f"{kind}, and this binary lacks {_flag('checkpoint_every')}: only "
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
    budget, cache_ram, flag = None, asked, _flag("cache_ram")
    if ram is not None and (base := ram.ram_available or ram.ram_total):
        reserve = max(OS_RESERVE_MIN, int((total := ram.ram_total or base) * OS_RESERVE_SHARE))
        # the slots' own checkpoints live in host RAM beside the cache
        held = slots * n_ckpt * state.checkpoint_at(slot_context)
        budget = base - reserve - host_used - held
        floor = -(-max(FLOOR_MIN, state.entry(min(slot_context, FLOOR_TOKENS), n_ckpt)) // MiB)
        if mine := asked is None and has("cache_ram"):
            cache_ram = max(floor, budget // MiB)
        when = (time.strftime("read at %Y-%m-%d %H:%M:%S", time.localtime(ram.ram_read_at))
                if ram.ram_read_at is not None else f"as {ram.source} gives it")
        why["cache_ram"] = (
            (f"{base / GiB:.1f} GiB of RAM available (of {total / GiB:.1f} GiB) {when}"
             if ram.ram_available else f"{base / GiB:.1f} GiB of RAM, the total ({ram.source} "
             "does not say how much is available)")
            + f", less a {reserve / GiB:.1f} GiB reserve, {host_used / GiB:.2f} GiB the model and"
            f" its companions will hold and {held / GiB:.2f} GiB of the slots' checkpoints: "
            f"{budget / GiB:.2f} GiB" + (f"; the cache gets its floor, {floor:,} MiB (one "
            f"document of {min(slot_context, FLOOR_TOKENS):,} tokens; 0 would turn it off)"
            if mine and budget // MiB < floor else ""))
    if asked is not None:
        why["cache_ram"] = (f"the profile's extra_args set {flag} {asked}" + (
            ": the RAM cache is off" if asked == 0 else ": no limit" if asked < 0 else "")
            + (f" ({why['cache_ram']})" if "cache_ram" in why else ""))
    elif not has("cache_ram"):
        why["cache_ram"] = f"this binary lacks {flag}: llama.cpp's own prompt cache"
    limit = None if cache_ram is None else budget if cache_ram < 0 else cache_ram * MiB
    documents = None if limit is None else max(0, limit) // max(1, entry)
    if limit and documents == 0 and asked is None:  # the floor keeps FLOOR_TOKENS at least
        per_token = state.entry(1, n_ckpt) - state.entry(0, n_ckpt)
        fits = (limit - state.entry(0, n_ckpt)) // max(1, per_token)
        warnings.append(
            f"one full-context document ({slot_context:,} tokens, {entry / GiB:.2f} GiB of "
            f"state) is larger than llama-server's prompt cache ({flag} {cache_ram:,} MiB): "
            f"llama-server skips an entry over its limit, so a document longer than about "
            f"{fits:,} tokens is not kept in RAM when another takes its slot and is read again "
            "when it returns; shorter ones are kept. Use a smaller context or KV type, or free "
            "or add RAM.")
    return DocumentPlan(
        needs_checkpoints=needs, checkpoints=checkpoints, min_step=min_step,
        batch=chosen_batch, cache_reuse=cache_reuse, cache_ram_mib=cache_ram,
        context=slot_context, entry_bytes=entry, checkpoint_bytes=state.checkpoint,
        ram_budget=budget, documents=documents, why=tuple(why.items()),
        warnings=tuple(warnings) + ((f"this binary lacks {', '.join(lacks)}: documents stay "
                                     "warm as llama.cpp's defaults allow (see the plan's "
                                     "documents lines)",) if lacks else ()))
