"""KV cache types: what each costs per value, and whether a model admits it.

One table (`TABLE`) gives the block size and bytes per block of every cache type the product
knows, with where that size comes from; one rule (`admits`) says whether a model (its K/V rows
and head sizes, from `gguf_facts`) can take a type on a backend, and why not when it cannot.
The memory plan, the launch's KV choice, `models inspect` and the KV benchmark all ask here.

Sizes measured from a built binary (`mtpwrap.build.calibrate`, stored in the build manifest)
win over the table; `differences` names every type where the two disagree, so a fork whose
type names mean another format shows up instead of being planned wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.decide.vocab import FULL_PRECISION_KV, TBQ3_V_ENV
from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.gguf_facts import ModelFacts

_UPSTREAM = "ggml/src/ggml-common.h (block_{0}, upstream llama.cpp)"
_FORK = ("ggml/src/ggml-common.h (block_{0}) of Indras-Mirror/llama.cpp-mtp at 0bc0a27; "
         "docs/facts.md §7")
_TURBO = ("ggml/src/ggml-common.h (block_{0}_0, QK_{1} = 128) of TheTom/llama-cpp-turboquant "
          "at 69d8e4b")

#: the fork's types whose fused flash-attention path takes only head sizes 128 and 256
#: (src/llama-graph.cpp build_attn_mha: other head sizes are dequantized to f32 every step)
FUSED_HEADS = (128, 256)


@dataclass(frozen=True)
class KvType:
    name: str
    block: int      #: values per block
    bytes: int      #: bytes per block
    #: float | upstream | tbq (the fork's TurboQuant) | rotor (the fork's planar/iso) |
    #: turbo (TheTom's)
    family: str
    source: str     #: where the size and the rules below come from

    @property
    def bits(self) -> float:
        return 8.0 * self.bytes / self.block

    @property
    def quantized(self) -> bool:
        return self.family != "float"


TABLE: dict[str, KvType] = {t.name: t for t in (
    KvType("f32", 1, 4, "float", "4-byte IEEE float"),
    KvType("f16", 1, 2, "float", "2-byte IEEE half"),
    KvType("bf16", 1, 2, "float", "2-byte bfloat16"),
    KvType("q8_0", 32, 34, "upstream", _UPSTREAM.format("q8_0")),
    KvType("q5_1", 32, 24, "upstream", _UPSTREAM.format("q5_1")),
    KvType("q5_0", 32, 22, "upstream", _UPSTREAM.format("q5_0")),
    KvType("q4_1", 32, 20, "upstream", _UPSTREAM.format("q4_1")),
    KvType("q4_0", 32, 18, "upstream", _UPSTREAM.format("q4_0")),
    KvType("iq4_nl", 32, 18, "upstream", _UPSTREAM.format("iq4_nl")),
    # the fork: 2-byte norm + 64 bytes of 4-bit indices / 48 bytes of 3-bit (or 32 + 16 signs)
    KvType("tbq4_0", 128, 66, "tbq", _FORK.format("tbq4_0")),
    KvType("planar4_0", 128, 66, "rotor", _FORK.format("planar4_0 = block_tbq4_0")),
    KvType("iso4_0", 128, 66, "rotor", _FORK.format("iso4_0 = block_tbq4_0")),
    KvType("tbq3_0", 128, 50, "tbq", _FORK.format("tbq3_0")),
    KvType("planar3_0", 128, 50, "rotor", _FORK.format("planar3_0")),
    KvType("iso3_0", 128, 50, "rotor", _FORK.format("iso3_0")),
    # TheTom's: 2-byte norm + 2-bit indices (+ 1-bit signs); turbo4 adds a reserved norm
    KvType("turbo2", 128, 34, "turbo", _TURBO.format("turbo2", "TURBO2")),
    KvType("turbo3", 128, 50, "turbo", _TURBO.format("turbo3", "TURBO3")),
    KvType("turbo4", 128, 68, "turbo", _TURBO.format("turbo4", "TURBO4")),
)}


def size(t: str, measured: Mapping[str, Any] | None = None) -> tuple[int, int]:
    """(values per block, bytes per block) of a cache type; measured sizes win."""
    if measured and t in measured:
        v = measured[t]
        if isinstance(v, Mapping):
            return int(v["block"]), int(v["bytes"])
        return int(v[0]), int(v[1])
    if t in TABLE:
        return TABLE[t].block, TABLE[t].bytes
    raise ConfigError(f"KV cache type {t!r} has no known size; use one of "
                      f"{', '.join(sorted(known(measured)))} or run `mtpwrap build` so the "
                      "binary's types are measured.")


def known(measured: Mapping[str, Any] | None = None) -> set[str]:
    """Every type with a size: the table's and the measured ones."""
    return set(TABLE) | set(measured or {})


def bits_per_value(t: str, measured: Mapping[str, Any] | None = None) -> float:
    block, nbytes = size(t, measured)
    return 8.0 * nbytes / block


def padded_head(t: str, head: int) -> int:
    """Values a head takes in the cache: TheTom's turbo types zero-pad each head to a multiple
    of 128 (src/llama-kv-cache.cpp there); every other type stores the head as it is."""
    fam = TABLE[t].family if t in TABLE else ""
    return -(-head // 128) * 128 if fam == "turbo" else head


def row_bytes(t: str, n_values: int, measured: Mapping[str, Any] | None = None) -> int:
    """Bytes of one row of n_values. Measured sizes are per 256 values (every ggml block size
    divides 256), so a row is n_values/256 of that, not a whole 256-value block."""
    block, nbytes = size(t, measured)
    return -(-n_values * nbytes // block)


def differences(measured: Mapping[str, Any] | None) -> list[str]:
    """One sentence per type whose measured size is not the table's."""
    out: list[str] = []
    for t, _ in sorted((measured or {}).items()):
        if t not in TABLE:
            continue
        block, nbytes = size(t, measured)
        ref = TABLE[t]
        if nbytes * ref.block != ref.bytes * block:
            out.append(f"KV type {t}: the binary measures {8 * nbytes / block:.3f} bits per "
                       f"value, the built-in table {ref.bits:.3f} ({ref.source}); the measured "
                       "size is used")
    return out


# --------------------------------------------------------------------------- admission


@dataclass(frozen=True)
class Admission:
    """Whether a model takes a KV type for K or V, and the one sentence saying why."""

    kv_type: str
    role: str            #: "K" | "V"
    admitted: bool
    reason: str
    #: environment llama-server needs for this choice (name → value)
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Target:
    """Where the cache lives and how the binary was built, as far as admission cares."""

    backend: str = "cpu"                #: cpu | cuda
    flash_attn: str = "on"              #: what the launch asks for: on | off | auto
    #: GGML_CUDA_FA_ALL_QUANTS as the build manifest records it; None: not recorded
    fa_all_quants: bool | None = None


def _layers(facts: ModelFacts) -> list[tuple[int, int, int, int]]:
    """(layer, K head, V head, KV heads) of every layer with a KV cache, MTP layers included
    (llama.cpp checks all of hparams.n_layer)."""
    layers = list(facts.kv_layers) + list(range(facts.n_layer, facts.n_layer_all))
    return [(il, *facts.kv_heads(il)) for il in dict.fromkeys(layers)]


def admits(facts: ModelFacts, t: str, role: str = "K", target: Target | None = None
           ) -> Admission:
    """Does this model take `t` for its K (or V) cache on `target`? The rules are the fork's
    and llama.cpp's own checks at context creation (src/llama-context.cpp
    llama_init_from_model), so a refusal here is a start that would have failed there."""
    tg = target or Target()
    where = Path(facts.path).name or facts.architecture

    def no(why: str) -> Admission:
        return Admission(t, role, False, f"{role} cache type {t}: {why}")

    kt = TABLE.get(t)
    if kt is None:
        return Admission(t, role, True, f"{role} cache type {t}: not in the built-in table; "
                         "the model's fit is not checked")
    if role == "V" and facts.is_mla:
        return Admission(t, role, True, f"{role} cache type {t}: {where} uses MLA and keeps "
                         "no V cache")
    layers = _layers(facts)
    if not layers:
        return Admission(t, role, True, f"{role} cache type {t}: {where} has no KV cache")
    if kt.quantized and tg.flash_attn == "off" and (role == "V" or kt.family == "turbo"):
        return no("needs flash attention, which the launch turns off")
    heads = {(dk if role == "K" else dv) for _, dk, dv, _ in layers}
    rows = {(dk if role == "K" else dv) * n for _, dk, dv, n in layers}
    if kt.family == "tbq":
        bad = sorted(r for r in rows if r % kt.block)
        if bad:
            return no(f"{where}'s {role} row (head size × KV heads) is {bad[0]}, not a multiple "
                      f"of its block of {kt.block} values (the fork refuses the context: "
                      f"\"does not divide n_embd_{role.lower()}_gqa\")")
    elif kt.family in ("upstream", "rotor"):
        bad = sorted(h for h in heads if h % kt.block)
        if bad:
            return no(f"{where}'s {role} head size {bad[0]} is not a multiple of its block of "
                      f"{kt.block} values (llama.cpp refuses the context: \"does not divide "
                      f"n_embd_head_{role.lower()}\")")
    if kt.family in ("tbq", "rotor"):
        off = sorted(h for h in heads if h not in FUSED_HEADS)
        if off:
            return no(f"{where}'s head size is {off[0]}; the fork's flash-attention path for "
                      f"its types takes head sizes {' and '.join(map(str, FUSED_HEADS))} only "
                      "(others are dequantized to f32 on every step)")
    if kt.family == "rotor" and tg.backend == "cuda" and tg.fa_all_quants is False:
        return no("on CUDA needs a build with GGML_CUDA_FA_ALL_QUANTS=ON, and the build "
                  "manifest records it off (`mtpwrap build --fa-all-quants` makes one)")
    if kt.family == "rotor" and tg.backend == "cpu":
        return no("the fork's CPU path crashes with it (llama-server exits with SIGSEGV at "
                  "warm-up, measured at 0bc0a27: docs/measurements/fork-0bc0a27.md); it is "
                  "for CUDA builds")
    env: tuple[tuple[str, str], ...] = ()
    notes = []
    if t == "tbq3_0" and tg.backend == "cpu":
        notes.append("on the CPU its output was measured unusable (gibberish at 0bc0a27, "
                     "docs/measurements/fork-0bc0a27.md): prefer tbq4_0 or q4_0 there")
    if t == "tbq3_0" and role == "V":
        env = ((TBQ3_V_ENV, "1"),)
        notes.append(f"the fork takes it for V only with {TBQ3_V_ENV}=1, which the launch sets")
    if kt.family == "turbo" and any(h % 128 for h in heads):
        notes.append("heads are zero-padded to a multiple of 128 values")
    if kt.quantized and t not in FULL_PRECISION_KV and role == "V":
        notes.append("needs flash attention")
    row = sorted(rows)[0]
    text = f"{role} cache type {t}: {where} admits it ({role} row {row}"
    text += f", head size {sorted(heads)[0]})" + (f"; {'; '.join(notes)}" if notes else "")
    return Admission(t, role, True, text, env)


def first_admitted(facts: ModelFacts, wanted: list[str] | tuple[str, ...], role: str,
                   target: Target | None = None
                   ) -> tuple[Admission | None, list[Admission]]:
    """The first type of `wanted` the model admits, and the refusals before it."""
    refused: list[Admission] = []
    for t in wanted:
        a = admits(facts, t, role, target)
        if a.admitted:
            return a, refused
        refused.append(a)
    return None, refused
