"""The memory plan: will this model, at this context, with this KV type and MTP, fit this device?

Every row follows what llama.cpp allocates (src/llama-context.cpp, src/llama-kv-cache*.cpp,
src/llama-memory-recurrent.cpp, common/speculative.cpp), so the plan can be checked against
llama.cpp's own accounting on a CPU with shape-only GGUFs (benchmarks/planner_accuracy.py):

- n_ctx is padded to 256; unified KV is one stream of n_ctx cells, otherwise one stream per slot
  of n_ctx/slots cells (padded to 256 again);
- K and V rows are `values / block × block bytes` of their cache type; MLA caches K only;
- sliding-window layers hold `pad(min(n_ctx_seq, window × (unified ? slots : 1) + ubatch), 256)`;
- hybrid models keep KV only in full-attention layers; their recurrent layers hold f32 state of
  `max(1, slots) × (1 + snapshots)` rows, snapshots = draft depth for MTP-style speculation;
- MTP loads the nextn block's weights and opens a second context caching only that block, at the
  draft KV types (-ctkd/-ctvd, f16 unless set), with its own compute buffer.

The compute-buffer terms are fitted to llama.cpp's CPU allocations and scaled for CUDA; they are
the only estimated rows and are labelled so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from mtpwrap.decide import kv
from mtpwrap.decide.gguf_facts import ModelFacts
from mtpwrap.errors import ConfigError
from mtpwrap.units import GiB, MiB

#: cache type -> (values per block, bytes per block): the built-in table (mtpwrap.decide.kv,
#: each size with its source). Sizes measured from the binary (mtpwrap.calibrate) win.
SPEC_KINDS = ("mtp", "draft", "ngram", "none")
#: a fixed allowance per backend for what llama.cpp allocates outside the named buffers
#: (CUDA context, cuBLAS workspace, graph metadata). Measured CUDA contexts are 300-500 MiB.
BACKEND_OVERHEAD = {"cuda": 512 * MiB, "cpu": 0}
#: kept free on the device: llama.cpp's own --fit keeps the same (`--fit-target`, "default:
#: 1024" in llama-server --help of upstream 0c1e570 and of the fork at 0bc0a27).
DEFAULT_MARGIN = 1024 * MiB
#: the compute buffer of the fork's MTP context on CUDA: "-ub 32 keeps MTP compute buffer at
#: ~712 MiB" (README of Indras-Mirror/llama.cpp-mtp at 0bc0a27, Key Flags, measured there on an
#: RTX 4090 with Qwen3.6-27B). The CPU-fitted estimate is far below it, so it is the floor, at
#: FORK_MTP_UBATCH tokens; at a larger ubatch it grows in proportion (`mtp_compute_floor`).
FORK_MTP_COMPUTE = 712 * MiB
FORK_MTP_UBATCH = 32
#: the ubatches the plan chooses from when the profile leaves it open (`choose_ubatch`)
UBATCHES = (32, 64, 128, 256, 512, 1024, 2048)
#: contexts tried by largest_context, besides the exact search.
_CTX_STEP = 256


@dataclass
class PlanConfig:
    n_ctx: int = 4096
    type_k: str = "f16"
    type_v: str = "f16"
    n_slots: int = 1
    kv_unified: bool = True
    spec: str = "none"        #: "mtp" | "draft" | "ngram" | "none"
    draft_depth: int = 3
    type_k_draft: str = "f16"
    type_v_draft: str = "f16"
    ubatch: int = 512
    batch: int = 2048
    flash_attn: bool = True
    n_gpu_layers: int = 999
    backend: str = "cuda"     #: "cuda" | "cpu"
    margin: int = DEFAULT_MARGIN
    #: CPU weight repacking (llama.cpp's default): a tied output matrix then gets its own copy
    cpu_repack: bool = True
    #: logits rows the reserve graph takes; None: slots × (1 + depth), what llama-server of
    #: upstream 0c1e570 reserves (tools/server/server-context.cpp sets n_outputs_max from
    #: common_speculative_get_output_limits). llama-fit-params (both builds) and the fork's
    #: llama-server at 0bc0a27 (src/llama-context.cpp has no n_outputs_max) reserve a whole
    #: ubatch: set it to the ubatch for them.
    n_outputs: int | None = None
    #: the attention mask is built in f32 and cast to f16 for flash attention (the fork at
    #: 0bc0a27, src/llama-graph.cpp `ggml_cast(ctx0, inp->self_kq_mask, GGML_TYPE_F16)`);
    #: upstream 0c1e570 builds it in f16 directly (llama-graph.cpp, `type_mask`)
    mask_f32: bool = False
    #: spec "draft": the draft model's tensor bytes (on the device with the target)
    draft_weight_bytes: int = 0
    #: the fork's own --spec-type mtp: the MTP head is a second model loaded from the same file
    #: (tools/server/server-context.cpp, override_arch qwen35_mtp) with its own copy of the
    #: output matrix (src/models/qwen35_mtp.cpp shares only token_embd and output_norm); its
    #: context takes the main -ctk/-ctv and -ub (common_context_params_to_llama). Upstream's
    #: draft-mtp runs the nextn block inside the target model.
    mtp_head_model: bool = False
    #: device bytes other processes hold on the same GPU (companions), as (what, bytes, note)
    reserved: tuple[tuple[str, int, str], ...] = ()

    @property
    def reserved_bytes(self) -> int:
        """What the others (`reserved`) hold on the device, in all."""
        return sum(n for _what, n, _note in self.reserved)

    def __post_init__(self) -> None:
        if self.spec not in SPEC_KINDS:
            raise ConfigError(f"spec kind {self.spec!r} is not one of {', '.join(SPEC_KINDS)}.")
        if self.backend not in ("cuda", "cpu"):
            raise ConfigError(f"backend {self.backend!r} is not 'cuda' or 'cpu'.")
        if self.n_ctx <= 0 or self.n_slots <= 0 or self.ubatch <= 0:
            raise ConfigError("context, slots and ubatch must be positive "
                              f"(got {self.n_ctx}, {self.n_slots}, {self.ubatch}).")


@dataclass
class Row:
    name: str
    bytes: int
    where: str          #: "gpu" | "host"
    note: str = ""


@dataclass
class MemoryPlan:
    model: str
    architecture: str
    generic: bool
    config: PlanConfig
    context: int                       #: the resolved (padded) n_ctx
    device_bytes: int | None
    rows: list[Row]
    total: int                         #: bytes on the device (the GPU, or host for cpu)
    host_total: int
    fits: bool | None
    headroom: int | None               #: device - total - margin (negative: short by)
    largest_context: dict[str, int] = field(default_factory=dict)
    #: KV types the binary offers that the model does not take (kv.admits), with the reason
    not_admitted: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pad(x: int, n: int) -> int:
    return -(-x // n) * n


def kv_geometry(n_ctx: int, n_slots: int, unified: bool) -> tuple[int, int, int]:
    """(padded n_ctx, cells per stream, streams) as llama_context computes them."""
    n_ctx = _pad(n_ctx, 256)
    if unified:
        return n_ctx, n_ctx, 1
    seq = _pad(n_ctx // n_slots, 256)
    return seq * n_slots, seq, n_slots


def kv_bytes(facts: ModelFacts, layers: list[int], cells: int, streams: int, type_k: str,
             type_v: str, cfg: PlanConfig, kv_sizes: dict[str, Any] | None,
             swa_cells: int | None = None) -> int:
    total = 0
    v_max = max((facts.kv_row_values(il)[1] for il in layers), default=0)
    for il in layers:
        dk, dv, n_kv = facts.kv_heads(il)
        nk, nv = facts.kv_row_values(il)
        nk = kv.padded_head(type_k, dk) * n_kv
        nv = kv.padded_head(type_v, dv) * n_kv if nv else 0
        if not cfg.flash_attn and nv:
            nv = v_max  # transposed V is sized to the widest layer
        c = swa_cells if (swa_cells is not None and il in facts.swa_layers) else cells
        total += c * streams * (kv.row_bytes(type_k, nk, kv_sizes)
                                + (kv.row_bytes(type_v, nv, kv_sizes) if nv else 0))
    return total


def _swa_cells(facts: ModelFacts, cells: int, cfg: PlanConfig) -> int:
    win = facts.sliding_window * (cfg.n_slots if cfg.kv_unified else 1) + cfg.ubatch
    return _pad(min(cells, win), 256)


def _kq_heads(facts: ModelFacts) -> int:
    return max(facts.n_head) if facts.n_head else 1


_F_TYPES = ("f16", "bf16", "f32")


def n_outputs(cfg: PlanConfig) -> int:
    """Logit rows the context reserves: llama-server keeps slots × (1 + draft depth)."""
    if cfg.n_outputs:
        return min(cfg.n_outputs, cfg.ubatch)
    depth = cfg.draft_depth if cfg.spec != "none" else 0
    return min(cfg.ubatch, cfg.n_slots * (1 + depth))


def compute_bytes(facts: ModelFacts, n_ctx: int, cfg: PlanConfig, *, mtp_context: bool = False
                  ) -> int:
    """Compute-buffer estimate, fitted to what llama.cpp's graph allocator reserves on the CPU.

    The reserve graph is one ubatch; its peak is the larger of two phases:
    - output: the logits rows (n_outputs × vocabulary × 4 B) next to the last hidden states
      (8 B × n_embd per token; for hybrid Qwen3.5 the widest of FFN and DeltaNet projection;
      MLA adds 8 B × heads × latent width);
    - layers: per-token activations (16 B × FFN width for attention models, 44 B × the DeltaNet
      inner size for hybrid ones) plus the attention mask (f16, n_ctx × ubatch) with flash
      attention, or the f32 scores and mask (n_ctx × ubatch × (heads + 1) × 4 B) without.
    Dense hybrid models with float K keep the mask live in the output phase too (upstream); the
    MoE hybrid does not, keeps 36 B per DeltaNet value, and keeps capped logits rows live in the
    layer phase (fitted to upstream's llama-server at ubatch 32-2048). Where the
    mask is built in f32 and cast (cfg.mask_f32, the fork), it takes 4 + 2 bytes per cell in the
    layer phase and none in the output phase (fitted to the fork's CPU allocations: the
    recordings in tests/data/fit-params/fork-0bc0a27 and the grid in
    docs/measurements/planner-compute.md). On CUDA, quantized
    K/V are converted to f16 for one layer (2 B × n_ctx × K+V width); that part is an allowance
    from the same rules, not a measurement.
    """
    ub = min(cfg.ubatch, max(n_ctx, 1))
    n_out = n_outputs(cfg)
    hybrid = bool(facts.recurrent_layers) and not mtp_context
    widest = facts.n_ff or 4 * facts.n_embd  # MoE models carry no dense FFN width
    moe = hybrid and facts.n_expert > 0
    if hybrid:
        out_tok = 4 * (max(facts.n_ff, facts.recurrent_conv_dim) + 10)
        # the MoE hybrid (qwen35moe) keeps less per token: 36 B × the DeltaNet inner size
        # (upstream 0c1e570's llama-server at ubatch 512 and 2048, tests/data/fit-params)
        layer_tok = (36 if moe else 44) * facts.recurrent_inner
    else:
        out_tok = 8 * facts.n_embd
        if facts.is_mla:  # absorbed MLA keeps per-head latent rows (K and V width) around
            out_tok += 8 * _kq_heads(facts) * facts.head_dim_v
        layer_tok = 16 * widest
    mask = (6 if cfg.mask_f32 else 2) * n_ctx * ub
    type_k = cfg.type_k_draft if mtp_context else cfg.type_k
    out_phase = n_out * 4 * facts.n_vocab + ub * out_tok
    if cfg.flash_attn:
        if hybrid and type_k in _F_TYPES and not cfg.mask_f32 and not moe:
            out_phase += mask
        layer_phase = ub * layer_tok + mask
        if moe and n_out < ub:
            # with the logits rows capped (llama-server), the MoE hybrid's few rows of logits
            # stay live beside the layers (−26 % at ubatch 32 without them)
            layer_phase += n_out * 4 * facts.n_vocab
    else:
        layer_phase = n_ctx * ub * 4 * (_kq_heads(facts) + 1) + ub * facts.n_embd * 24
    total = max(out_phase, layer_phase)
    type_v = cfg.type_v_draft if mtp_context else cfg.type_v
    per_value = _dequant_bytes(facts, type_k, type_v, cfg)
    if per_value:
        layers = facts.kv_layers or [0]
        nk, nv = max((facts.kv_row_values(il) for il in layers), key=sum)
        total += per_value * n_ctx * (nk + nv)
    if mtp_context and cfg.mtp_head_model and cfg.backend == "cuda":
        total = max(total, mtp_compute_floor(cfg.ubatch))
    return int(total)


def mtp_compute_floor(ubatch: int) -> int:
    """The fork's MTP context's compute buffer on CUDA, from its one published figure (712 MiB
    at -ub 32): every buffer of a reserve graph is at most linear in its tokens (activations
    ub × width, logits ub × vocabulary, scores and mask ub × context), so a + b·ub measured
    at 32 is at most that figure × ub / 32 above it. An upper bound, until a GPU measures it
    (benchmarks/gpu_check.sh records the MTP context's compute buffer at each ubatch)."""
    return FORK_MTP_COMPUTE * max(ubatch, FORK_MTP_UBATCH) // FORK_MTP_UBATCH


def _dequant_bytes(facts: ModelFacts, type_k: str, type_v: str, cfg: PlanConfig) -> int:
    """Bytes per cached value of one layer's K and V that attention converts before it reads
    them (a compute-buffer allowance, not a measurement):
    - the fork's tbq4_0 K and V with head size 128 or 256 go into its fused CUDA kernel as they
      are (ggml-cuda/fattn.cu, BEST_FATTN_KERNEL_MMA_TBQ4): nothing;
    - the fork's planar/iso types are cast to f32 and then f16 on every backend
      (src/llama-graph.cpp build_attn_mha): 4 + 2 bytes;
    - any other quantized K on CUDA with flash attention is converted to f16: 2 bytes."""
    if type_k in _F_TYPES or not cfg.flash_attn:
        return 0
    fams = {kv.TABLE[t].family for t in (type_k, type_v) if t in kv.TABLE}
    if "rotor" in fams:
        return 6
    if cfg.backend != "cuda":
        return 0
    heads = {facts.kv_heads(il)[0] for il in facts.kv_layers}
    if type_k == type_v == "tbq4_0" and heads <= set(kv.FUSED_HEADS):
        return 0
    return 2


def limit_notes(types: list[str]) -> list[str]:
    """Why some listed KV types fit less context than their cache size suggests."""
    rotor = [t for t in types if t in kv.TABLE and kv.TABLE[t].family == "rotor"]
    if not rotor:
        return []
    return [f"{', '.join(rotor)}: attention reads these through an f32 and then an f16 copy of "
            "one layer's K and V at the whole context (the fork's src/llama-graph.cpp "
            "build_attn_mha casts them; no fused kernel), 6 bytes per cached value in the "
            "compute buffer, so they fit less context than q4_0 although their cache is as "
            "small as tbq4_0's"]


def require_mtp_head(facts: ModelFacts, who: str = "--spec-type mtp") -> None:
    """MTP speculation needs the model's nextn blocks: declared in the metadata and present as
    tensors (a fine-tune often keeps the key and loses the blocks)."""
    if facts.has_mtp and facts.mtp_bytes > 0:
        return
    what = ("has no MTP (nextn) layers" if not facts.has_mtp else
            f"declares {facts.n_layer_nextn} MTP (nextn) layer(s) but holds none of their "
            "tensors")
    raise ConfigError(
        f"{facts.path}: the model {what}, so {who} cannot be used.",
        hint="Give it the head of the model it was made from with `mtpwrap models graft "
             "--mtp-from BASE.gguf MODEL.gguf -o OUT.gguf`, or choose another speculative "
             "mode (spec.kind) or model.")


def _weight_rows(facts: ModelFacts, cfg: PlanConfig, gpu: str) -> list[Row]:
    """Token embeddings stay on the host; -ngl N offloads the last N trunk layers, and the
    output layer too once N exceeds the trunk (llama.cpp's i_gpu_start rule)."""
    trunk_layers = facts.n_layer
    n_off = max(0, min(cfg.n_gpu_layers, trunk_layers))
    layer_sum = sum(b for il, b in facts.layer_bytes.items() if il < trunk_layers)
    on_gpu_layers = sum(b for il, b in facts.layer_bytes.items()
                        if trunk_layers - n_off <= il < trunk_layers)
    other = facts.tensor_bytes - layer_sum - facts.mtp_bytes - facts.host_bytes
    out_on_gpu = cfg.n_gpu_layers > trunk_layers  # llama.cpp offloads output with -ngl > n_layer
    # A model without output.weight reuses token_embd as its output matrix; llama.cpp loads that
    # second copy into the output's buffer (the GPU, or the CPU repack buffer).
    tied = facts.token_embd_bytes if facts.output_bytes == 0 else 0
    if gpu == "host" and not cfg.cpu_repack:
        tied = 0
    w_gpu = on_gpu_layers + (other + tied if out_on_gpu else 0)
    w_host = facts.host_bytes + (layer_sum - on_gpu_layers) + (0 if out_on_gpu else other + tied)
    if gpu == "host":
        w_host, w_gpu = w_host + w_gpu, 0
    rows: list[Row] = []
    if gpu == "gpu":
        rows.append(Row("weights (GPU)", w_gpu, "gpu", f"{n_off}/{trunk_layers} layers"
                        + (" + output" if out_on_gpu else "")))
    rows.append(Row("weights (host)", w_host, "host",
                    "token embeddings" + (" + all layers" if gpu == "host" else "")))
    return rows


def _cache_rows(facts: ModelFacts, cfg: PlanConfig, cells: int, streams: int, kv_on: str,
                kv_sizes: dict[str, Any] | None) -> list[Row]:
    """The main KV cache and the recurrent state.

    Recurrent layers hold max(1, n_seq_max) × (1 + n_rs_seq) rows of f32 state
    (src/llama-memory-recurrent.cpp, `n_rows = mem_size * (1 + n_rs_seq)`, mem_size from
    src/llama-model.cpp); n_rs_seq is the draft depth with MTP (common/common.cpp of the fork
    at 0bc0a27 for --spec-type mtp; upstream's common.h need_n_rs_seq for draft-mtp)."""
    if not facts.kv_cache:  # an encoder (bert, ...): llama.cpp makes no KV cache for it
        return [Row("main KV", 0, kv_on, f"none: llama.cpp runs {facts.architecture} without "
                                         "a KV cache"),
                Row("recurrent state", 0, kv_on, "none (no recurrent layers)")]
    swa = _swa_cells(facts, cells, cfg) if facts.swa_layers else None
    main_kv = kv_bytes(facts, facts.kv_layers, cells, streams, cfg.type_k, cfg.type_v, cfg,
                       kv_sizes, swa)
    rows = [Row("main KV", main_kv, kv_on,
                f"{len(facts.kv_layers)} layers × {cells} cells × {streams} stream(s), "
                f"K {cfg.type_k} / V {cfg.type_v}")]
    if facts.recurrent_layers:
        snapshots = cfg.draft_depth if cfg.spec in ("mtp",) else 0
        n_rows = max(1, cfg.n_slots) * (1 + snapshots)
        rs = n_rows * len(facts.recurrent_layers) * (
            facts.recurrent_r_floats + facts.recurrent_s_floats) * 4
        rows.append(Row("recurrent state", rs, kv_on,
                        f"{len(facts.recurrent_layers)} layers × {n_rows} rows (f32)"))
    else:
        rows.append(Row("recurrent state", 0, kv_on, "none (no recurrent layers)"))
    return rows


def _mtp_rows(facts: ModelFacts, cfg: PlanConfig, n_ctx: int, cells: int, streams: int,
              gpu: str, kv_on: str, kv_sizes: dict[str, Any] | None) -> list[Row]:
    """MTP's nextn weights, the fork's head model output, the MTP context's KV and compute."""
    rows = [Row("MTP weights", facts.mtp_bytes, gpu,
                f"{facts.n_layer_nextn} nextn block(s), loaded only with MTP")]
    if cfg.mtp_head_model:
        # the head model's output layer: on the GPU once -ngl exceeds all its blocks
        head_out = facts.output_bytes or facts.token_embd_bytes
        on = gpu if cfg.n_gpu_layers > facts.n_layer_all else "host"
        rows.append(Row("MTP head output", head_out, on,
                        "the fork's MTP head model keeps its own output matrix; token "
                        "embeddings are shared with the trunk (link_shared_tensors)"))
    mtp_layers = list(range(facts.n_layer, facts.n_layer_all))
    mtp_kv = kv_bytes(facts, mtp_layers, cells, streams, cfg.type_k_draft, cfg.type_v_draft,
                      cfg, kv_sizes)
    rows.append(Row("MTP context KV", mtp_kv, kv_on,
                    f"{len(mtp_layers)} layer(s), K {cfg.type_k_draft} / "
                    f"V {cfg.type_v_draft} "
                    + ("(the fork's MTP context takes -ctk/-ctv)" if cfg.mtp_head_model
                       else "(-ctkd/-ctvd)")))
    mtp_compute = compute_bytes(facts, n_ctx, cfg, mtp_context=True)
    floor = cfg.mtp_head_model and cfg.backend == "cuda" \
        and mtp_compute == mtp_compute_floor(cfg.ubatch)
    rows.append(Row("MTP compute", mtp_compute, gpu,
                    ("the fork's published figure at -ub 32 (a floor)" if cfg.ubatch
                     <= FORK_MTP_UBATCH else "the fork's published 712 MiB at -ub 32, × "
                     f"{cfg.ubatch}/32 (an upper bound)") if floor else "estimate"))
    return rows


def _run_rows(facts: ModelFacts, cfg: PlanConfig, n_ctx: int, gpu: str) -> list[Row]:
    """A draft model's weights, the compute buffer, the logits and the backend's overhead."""
    rows: list[Row] = []
    if cfg.spec == "draft" and cfg.draft_weight_bytes:
        rows.append(Row("draft model weights", cfg.draft_weight_bytes, gpu,
                        "the draft model (-md), all layers with the target's"))
    rows.append(Row("compute", compute_bytes(facts, n_ctx, cfg), gpu,
                    f"estimate, ubatch {cfg.ubatch}, flash attention "
                    f"{'on' if cfg.flash_attn else 'off'}, logits for {n_outputs(cfg)} "
                    f"row(s){', f32 mask' if cfg.mask_f32 and cfg.flash_attn else ''}"))
    rows.append(Row("output", 4 * facts.n_vocab * cfg.n_slots, "host",
                    "logits for one token per slot"))
    overhead = BACKEND_OVERHEAD[cfg.backend]
    if overhead:
        rows.append(Row("overhead", overhead, gpu, f"{cfg.backend} context and workspace "
                        "(an allowance above the 300-500 MiB CUDA contexts measured)"))
    return rows


@dataclass(frozen=True)
class SequenceState:
    """What one slot's document costs outside the device plan: llama-server's RAM prompt cache
    keeps a sequence's whole state (`llama_state_seq_get_size`), and a context checkpoint the
    part of it that cannot be rolled back (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY): the recurrent
    row and the sliding-window cells — and, with MTP on a binary without patch 0003, the draft
    context's KV whole (a plain KV cache ignores PARTIAL_ONLY), so a checkpoint grows with its
    position."""

    kv_per_token: int  #: main KV and the MTP context's KV, bytes per cached token
    fixed: int         #: the recurrent state of one sequence (one row, f32)
    checkpoint: int    #: one checkpoint's fixed part: that row plus the sliding-window cells
    #: one checkpoint's part that grows with its position: the MTP context's KV per token
    checkpoint_per_token: int = 0

    def checkpoint_at(self, tokens: int) -> int:
        """One checkpoint taken `tokens` into a sequence."""
        return self.checkpoint + self.checkpoint_per_token * tokens

    def entry(self, tokens: int, checkpoints: int = 0) -> int:
        """One sequence of `tokens` with its checkpoints, as the RAM cache stores it (the
        checkpoints counted at the sequence's end: the newest are kept, near it)."""
        return self.kv_per_token * tokens + self.fixed + checkpoints * self.checkpoint_at(tokens)


def sequence_state(facts: ModelFacts, cfg: PlanConfig, kv_sizes: dict[str, Any] | None = None,
                   *, draft_in_checkpoints: bool = True) -> SequenceState:
    """The per-sequence sizes of a launch (`SequenceState`), from the same rows as `plan`.
    `draft_in_checkpoints`: the binary's checkpoints hold the MTP context's KV (all but a
    build with patch 0003, which leaves it out: a restore cuts it back instead)."""
    per_token = kv_bytes(facts, facts.kv_layers, 1, 1, cfg.type_k, cfg.type_v, cfg, kv_sizes)
    mtp = 0
    if cfg.spec == "mtp":
        mtp = kv_bytes(facts, list(range(facts.n_layer, facts.n_layer_all)), 1, 1,
                       cfg.type_k_draft, cfg.type_v_draft, cfg, kv_sizes)
    row = len(facts.recurrent_layers) * (facts.recurrent_r_floats + facts.recurrent_s_floats) * 4
    swa = 0
    if facts.swa_layers:
        cells = _swa_cells(facts, _pad(cfg.n_ctx, 256), dataclasses.replace(cfg, n_slots=1))
        swa = kv_bytes(facts, facts.swa_layers, cells, 1, cfg.type_k, cfg.type_v, cfg, kv_sizes)
        per_token -= kv_bytes(facts, facts.swa_layers, 1, 1, cfg.type_k, cfg.type_v, cfg,
                              kv_sizes)
    return SequenceState(kv_per_token=per_token + mtp, fixed=row + swa, checkpoint=row + swa,
                         checkpoint_per_token=mtp if draft_in_checkpoints else 0)


def plan(facts: ModelFacts, config: PlanConfig, device_memory_bytes: int | None,
         kv_sizes: dict[str, Any] | None = None) -> MemoryPlan:
    """The full plan for one configuration."""
    cfg = config
    for t in (cfg.type_k, cfg.type_v, cfg.type_k_draft, cfg.type_v_draft):
        kv.size(t, kv_sizes)  # unknown types fail here, with the list of known ones
    warnings = list(facts.warnings)
    n_ctx, cells, streams = kv_geometry(cfg.n_ctx, cfg.n_slots, cfg.kv_unified)
    if facts.n_ctx_train and cells > facts.n_ctx_train:
        warnings.append(f"context per slot {cells} exceeds the trained context "
                        f"{facts.n_ctx_train}")
    gpu = "gpu" if cfg.backend == "cuda" else "host"
    if cfg.spec == "mtp":
        require_mtp_head(facts)
    kv_on = gpu if cfg.n_gpu_layers > 0 else "host"
    rows = _weight_rows(facts, cfg, gpu) + _cache_rows(facts, cfg, cells, streams, kv_on,
                                                       kv_sizes)
    if cfg.spec == "mtp":
        rows += _mtp_rows(facts, cfg, n_ctx, cells, streams, gpu, kv_on, kv_sizes)
    rows += _run_rows(facts, cfg, n_ctx, gpu)
    if gpu == "gpu":
        rows += [Row(what, nbytes, gpu, note) for what, nbytes, note in cfg.reserved]

    total = sum(r.bytes for r in rows if r.where == gpu)
    host_total = sum(r.bytes for r in rows if r.where == "host")
    fits: bool | None = None
    headroom: int | None = None
    if device_memory_bytes is not None:
        headroom = device_memory_bytes - total - cfg.margin
        fits = headroom >= 0
    rows.append(Row("margin", cfg.margin if device_memory_bytes is not None else 0, gpu,
                    "kept free (llama.cpp's --fit keeps 1024 MiB)"))
    return MemoryPlan(model=facts.path, architecture=facts.architecture, generic=facts.generic,
                      config=cfg, context=n_ctx, device_bytes=device_memory_bytes, rows=rows,
                      total=total, host_total=host_total, fits=fits, headroom=headroom,
                      warnings=warnings)


@dataclass(frozen=True)
class UbatchChoice:
    """The ubatch the plan chose (`choose_ubatch`), its plan and why."""

    ubatch: int
    plan: MemoryPlan
    reason: str
    #: each ubatch tried, largest first, with its headroom beyond the margin (negative: short)
    tried: tuple[tuple[int, int], ...] = ()


def choose_ubatch(facts: ModelFacts, config: PlanConfig, device_memory_bytes: int,
                  kv_sizes: dict[str, Any] | None = None, *, limit: int | None = None
                  ) -> UbatchChoice:
    """The largest of UBATCHES (at most `limit`, the logical batch, and the context) whose plan
    fits the device with the same margin: the read (prefill) takes the ubatch as its step, and
    a larger one reads faster while its compute buffers (the main context's and the MTP
    context's) grow with it. When none fits, the smallest, whose plan says by how much."""
    n_ctx = _pad(config.n_ctx, 256)
    cands = [u for u in UBATCHES if u <= (limit or UBATCHES[-1]) and u <= n_ctx] or [UBATCHES[0]]
    tried: list[tuple[int, int]] = []
    chosen: MemoryPlan | None = None
    for u in reversed(cands):
        cfg = dataclasses.replace(config, ubatch=u,
                                  n_outputs=None if config.n_outputs is None else u)
        p = plan(facts, cfg, device_memory_bytes, kv_sizes)
        assert p.headroom is not None
        tried.append((u, p.headroom))
        chosen = p
        if p.fits:
            break
    assert chosen is not None
    u, head = tried[-1]
    compute = chosen.row("compute").bytes + sum(
        r.bytes for r in chosen.rows if r.name == "MTP compute")
    bound = ", ".join([f"{cands[-1]:,} is the largest offered" if u == cands[-1] else ""]
                      + [f"{b:,} would be {-h / MiB:,.0f} MiB short" for b, h in tried[-2:-1]])
    if not chosen.fits:
        reason = (f"no ubatch of {cands[0]}…{cands[-1]} fits: {u} is the smallest "
                  f"(compute buffers {compute / MiB:,.0f} MiB)")
    else:
        reason = (f"the largest of {cands[0]}…{cands[-1]} whose compute buffers "
                  f"({compute / MiB:,.0f} MiB) fit beside the weights, the KV cache"
                  f"{' and the MTP context' if config.spec == 'mtp' else ''} at context "
                  f"{n_ctx:,}, {head / MiB:,.0f} MiB left beyond the "
                  f"{config.margin / MiB:,.0f} MiB margin"
                  + (f" ({bound.strip(', ')})" if bound.strip(", ") else "")
                  + "; a larger ubatch reads a document faster")
    return UbatchChoice(ubatch=u, plan=chosen, reason=reason, tried=tuple(tried))


def plan_with_limits(facts: ModelFacts, config: PlanConfig, device_memory_bytes: int | None,
                     kv_sizes: dict[str, Any] | None = None,
                     kv_types: list[str] | None = None) -> MemoryPlan:
    """plan() plus the largest context that fits for each KV type (device size required)."""
    p = plan(facts, config, device_memory_bytes, kv_sizes)
    if device_memory_bytes is not None:
        types = kv_types if kv_types is not None else supported_kv_types(kv_sizes)
        for t in types:
            try:
                p.largest_context[t] = largest_context(facts, config, device_memory_bytes,
                                                       kv_sizes, kv_type=t)
            except ConfigError:
                continue
    return p


def supported_kv_types(kv_sizes: dict[str, Any] | None = None) -> list[str]:
    order = ["f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"]
    extra = sorted(t for t in (kv_sizes or {}) if t not in order and t not in ("f32", "bf16"))
    return [t for t in order if t in kv.known(kv_sizes)] + extra


def largest_context(facts: ModelFacts, config: PlanConfig, device_memory_bytes: int,
                    kv_sizes: dict[str, Any] | None = None, kv_type: str | None = None) -> int:
    """The largest n_ctx (multiple of 256) that fits, with K and V at kv_type; 0 if none."""
    from dataclasses import replace

    base = replace(config, type_k=kv_type, type_v=kv_type) if kv_type else config
    # a slot count > 1 needs n_ctx/slots per slot: search over the total
    hi_limit = max(facts.n_ctx_train * (1 if base.kv_unified else base.n_slots), 256)

    def fits(n: int) -> bool:
        p = plan(facts, replace(base, n_ctx=n), device_memory_bytes, kv_sizes)
        return bool(p.fits)

    if not fits(_CTX_STEP * max(1, base.n_slots if not base.kv_unified else 1)):
        return 0
    lo, hi = 1, hi_limit // _CTX_STEP
    if fits(hi * _CTX_STEP):
        return hi * _CTX_STEP
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if fits(mid * _CTX_STEP):
            lo = mid
        else:
            hi = mid
    return lo * _CTX_STEP


def check_fits(p: MemoryPlan) -> None:
    """Raise ConfigError with the numbers when a plan does not fit its device."""
    if p.fits is None or p.fits:
        return
    assert p.device_bytes is not None and p.headroom is not None
    best = ", ".join(f"{t}: {n:,}" for t, n in p.largest_context.items() if n > 0)
    hint = f" Largest context that fits per KV type — {best}." if best else (
        " No context fits with these settings; use fewer GPU layers or a smaller model.")
    others = "".join(f", {what} {n / GiB:.2f} GiB" for what, n, _note in p.config.reserved)
    raise ConfigError(
        f"{p.model}: context {p.context:,} with KV {p.config.type_k}/{p.config.type_v}"
        f"{' and MTP' if p.config.spec == 'mtp' else ''}{' beside its' if others else ''}"
        f"{others.removeprefix(',')} needs {p.total / GiB:.2f} GiB on the "
        f"device plus a {p.config.margin / GiB:.2f} GiB margin, but the device has "
        f"{p.device_bytes / GiB:.2f} GiB (short by {-p.headroom / GiB:.2f} GiB).{hint}"
    )
