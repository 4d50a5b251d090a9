"""Write GGUF models for checking the planner against llama.cpp, and tiny runnable ones for tests.

Two kinds of file:

- **shape-only**: real metadata and real tensor shapes and types of a published model, with the
  tensor data region extended to its full length by `truncate` — the file is sparse, so a 16 GB
  model costs a few MB of disk and a second to write. llama.cpp loads it (mmap) without reading
  the weights, so its own memory accounting can be observed on a CPU.
- **tiny random**: small dimensions, random weights, a working tokenizer; llama-server really runs
  it (the qwen35 one with an MTP/nextn block, so `--spec-type draft-mtp` drafts with it).

Tensor names and shapes follow llama.cpp's loaders (src/models/<arch>.cpp). The tokenizer is made
in code (`mtpwrap.build.tokenizer`: a byte-level BPE with as many tokens as the real model's
embedding has rows), so no file from a llama.cpp tree is needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.build import tokenizer
from mtpwrap.errors import ConfigError


def _add_tokenizer(w: Any, pre: str, n_vocab: int | None) -> int:
    """Write a byte-level BPE tokenizer (`tokenizer.vocabulary`) of n_vocab tokens into writer
    w, with llama.cpp pre-tokenizer `pre`. Returns the number of tokens."""
    from gguf.constants import GGUFValueType

    vocab = tokenizer.vocabulary(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(list(vocab.tokens))
    w.add_token_types(list(vocab.token_type))
    w.add_token_merges(list(vocab.merges))
    w.add_bos_token_id(vocab.bos)
    w.add_eos_token_id(vocab.eos)
    w.add_key_value("tokenizer.chat_template", tokenizer.CHAT_TEMPLATE, GGUFValueType.STRING)
    return len(vocab)


# --------------------------------------------------------------------------- model specs

@dataclass
class TensorSpec:
    name: str
    ne: tuple[int, ...]  #: ggml order: ne[0] is the row length
    qtype: str           #: GGMLQuantizationType name, lower case


@dataclass
class ModelSpec:
    arch: str
    name: str
    vocab: str                    #: llama.cpp's pre-tokenizer name (tokenizer.ggml.pre)
    n_vocab: int                  #: tokens, the embedding's rows
    meta: dict[str, Any]          #: keys without the "{arch}." prefix
    tensors: list[TensorSpec] = field(default_factory=list)


def _more_bits(il: int, n: int) -> bool:
    # llama.cpp's use_more_bits(): the Q4_K_M recipe gives these layers Q6_K for attn_v/ffn_down
    return il < n // 8 or il >= 7 * n // 8 or (il - n // 8) % 3 == 2


def _quant(name: str, ne: tuple[int, ...], il: int, n_layer: int, ftype: str) -> str:
    """The tensor type a llama-quantize recipe would give (close enough for sizing)."""
    if len(ne) == 1 or any(s in name for s in ("_norm", "ssm_a", "ssm_dt", "ssm_conv1d",
                                               "ffn_gate_inp", "exp_probs_b")):
        return "f32"
    if ftype == "f16":
        return "f16"
    if ftype == "q8_0":
        return "q8_0" if ne[0] % 32 == 0 else "f16"
    # q4_k_m
    more = ("attn_v." in name or "ffn_down" in name) and _more_bits(il, n_layer)
    want = "q6_k" if name.startswith("output.") or more else "q4_k"
    if ne[0] % 256 != 0:
        return "q5_0" if ne[0] % 32 == 0 else "f16"
    return want


class _Builder:
    """Adds a model's tensors to `spec`, starting with the embeddings, the output norm and (not
    `tied` to the embeddings) the output matrix."""

    def __init__(self, spec: ModelSpec, ftype: str, n_layer_quant: int, n_embd: int,
                 tied: bool = False) -> None:
        self.spec, self.ftype, self.n = spec, ftype, n_layer_quant
        self.t("token_embd.weight", n_embd, spec.n_vocab)
        self.t("output_norm.weight", n_embd)
        if not tied:
            self.t("output.weight", n_embd, spec.n_vocab)

    def t(self, name: str, *ne: int, il: int = -1) -> None:
        self.spec.tensors.append(TensorSpec(name, tuple(ne), _quant(name, ne, il, self.n,
                                                                   self.ftype)))


def _moe_ffn(b: _Builder, il: int, n_embd: int, moe: dict[str, int]) -> None:
    """A qwen35moe layer's routed experts and its shared expert."""
    ne, nf, nfs = moe["n_expert"], moe["n_ff_exp"], moe["n_ff_shexp"]
    b.t(f"blk.{il}.ffn_gate_inp.weight", n_embd, ne, il=il)
    b.t(f"blk.{il}.ffn_gate_exps.weight", n_embd, nf, ne, il=il)
    b.t(f"blk.{il}.ffn_up_exps.weight", n_embd, nf, ne, il=il)
    b.t(f"blk.{il}.ffn_down_exps.weight", nf, n_embd, ne, il=il)
    b.t(f"blk.{il}.ffn_gate_inp_shexp.weight", n_embd, il=il)
    b.t(f"blk.{il}.ffn_gate_shexp.weight", n_embd, nfs, il=il)
    b.t(f"blk.{il}.ffn_up_shexp.weight", n_embd, nfs, il=il)
    b.t(f"blk.{il}.ffn_down_shexp.weight", nfs, n_embd, il=il)


def _qwen35_spec(*, name: str, n_embd: int, n_layer: int, n_nextn: int, n_head: int,
                 n_head_kv: int, head_dim: int, n_ff: int, d_conv: int, d_state: int,
                 n_group: int, n_v_heads: int, n_vocab: int | None, n_ctx: int,
                 rope_dim: int, sections: list[int], ftype: str, interval: int = 4,
                 moe: dict[str, int] | None = None, tied: bool = False) -> ModelSpec:
    arch = "qwen35moe" if moe else "qwen35"
    d_inner = n_v_heads * d_state
    meta: dict[str, Any] = {
        "block_count": n_layer + n_nextn, "context_length": n_ctx, "embedding_length": n_embd,
        "attention.head_count": n_head, "attention.head_count_kv": n_head_kv,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "rope.dimension_count": rope_dim, "rope.dimension_sections": sections,
        "rope.freq_base": 10_000_000.0, "attention.layer_norm_rms_epsilon": 1e-6,
        "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner, "ssm.state_size": d_state,
        "ssm.time_step_rank": n_v_heads, "ssm.group_count": n_group,
        "full_attention_interval": interval,
    }
    if not moe:
        meta["feed_forward_length"] = n_ff
    else:
        meta.update({"expert_count": moe["n_expert"], "expert_used_count": moe["n_used"],
                     "expert_feed_forward_length": moe["n_ff_exp"],
                     "expert_shared_feed_forward_length": moe["n_ff_shexp"]})
    if n_nextn:
        meta["nextn_predict_layers"] = n_nextn
    spec = ModelSpec(arch, name, "qwen35", n_vocab or 151936, meta)
    b = _Builder(spec, ftype, n_layer, n_embd, tied)
    key_dim, value_dim = d_state * n_group, d_state * n_v_heads

    def attn(il: int) -> None:
        b.t(f"blk.{il}.attn_q.weight", n_embd, head_dim * n_head * 2, il=il)
        b.t(f"blk.{il}.attn_k.weight", n_embd, head_dim * n_head_kv, il=il)
        b.t(f"blk.{il}.attn_v.weight", n_embd, head_dim * n_head_kv, il=il)
        b.t(f"blk.{il}.attn_output.weight", head_dim * n_head, n_embd, il=il)
        b.t(f"blk.{il}.attn_q_norm.weight", head_dim, il=il)
        b.t(f"blk.{il}.attn_k_norm.weight", head_dim, il=il)

    def ffn(il: int) -> None:
        if moe:
            _moe_ffn(b, il, n_embd, moe)
        else:
            b.t(f"blk.{il}.ffn_gate.weight", n_embd, n_ff, il=il)
            b.t(f"blk.{il}.ffn_up.weight", n_embd, n_ff, il=il)
            b.t(f"blk.{il}.ffn_down.weight", n_ff, n_embd, il=il)

    for il in range(n_layer):
        b.t(f"blk.{il}.attn_norm.weight", n_embd, il=il)
        b.t(f"blk.{il}.post_attention_norm.weight", n_embd, il=il)
        if (il + 1) % interval == 0:
            attn(il)
        else:
            b.t(f"blk.{il}.attn_qkv.weight", n_embd, key_dim * 2 + value_dim, il=il)
            b.t(f"blk.{il}.attn_gate.weight", n_embd, value_dim, il=il)
            b.t(f"blk.{il}.ssm_conv1d.weight", d_conv, key_dim * 2 + value_dim, il=il)
            b.t(f"blk.{il}.ssm_dt.bias", n_v_heads, il=il)
            b.t(f"blk.{il}.ssm_a", n_v_heads, il=il)
            b.t(f"blk.{il}.ssm_beta.weight", n_embd, n_v_heads, il=il)
            b.t(f"blk.{il}.ssm_alpha.weight", n_embd, n_v_heads, il=il)
            b.t(f"blk.{il}.ssm_norm.weight", d_state, il=il)
            b.t(f"blk.{il}.ssm_out.weight", value_dim, n_embd, il=il)
        ffn(il)
    for il in range(n_layer, n_layer + n_nextn):
        b.t(f"blk.{il}.attn_norm.weight", n_embd, il=il)
        b.t(f"blk.{il}.post_attention_norm.weight", n_embd, il=il)
        attn(il)
        ffn(il)
        b.t(f"blk.{il}.nextn.eh_proj.weight", 2 * n_embd, n_embd, il=il)
        b.t(f"blk.{il}.nextn.enorm.weight", n_embd, il=il)
        b.t(f"blk.{il}.nextn.hnorm.weight", n_embd, il=il)
        b.t(f"blk.{il}.nextn.shared_head_norm.weight", n_embd, il=il)
    return spec


def _llama_spec(*, name: str, n_embd: int, n_layer: int, n_head: int, n_head_kv: int,
                n_ff: int, n_ctx: int, ftype: str, vocab: str = "llama-bpe",
                n_vocab: int | None = None, tied: bool = False) -> ModelSpec:
    head_dim = n_embd // n_head
    meta = {"block_count": n_layer, "context_length": n_ctx, "embedding_length": n_embd,
            "feed_forward_length": n_ff, "attention.head_count": n_head,
            "attention.head_count_kv": n_head_kv, "rope.freq_base": 500000.0,
            "rope.dimension_count": head_dim, "attention.layer_norm_rms_epsilon": 1e-5}
    spec = ModelSpec("llama", name, vocab, n_vocab or 128256, meta)
    b = _Builder(spec, ftype, n_layer, n_embd, tied)
    for il in range(n_layer):
        b.t(f"blk.{il}.attn_norm.weight", n_embd, il=il)
        b.t(f"blk.{il}.attn_q.weight", n_embd, n_embd, il=il)
        b.t(f"blk.{il}.attn_k.weight", n_embd, head_dim * n_head_kv, il=il)
        b.t(f"blk.{il}.attn_v.weight", n_embd, head_dim * n_head_kv, il=il)
        b.t(f"blk.{il}.attn_output.weight", n_embd, n_embd, il=il)
        b.t(f"blk.{il}.ffn_norm.weight", n_embd, il=il)
        b.t(f"blk.{il}.ffn_gate.weight", n_embd, n_ff, il=il)
        b.t(f"blk.{il}.ffn_up.weight", n_embd, n_ff, il=il)
        b.t(f"blk.{il}.ffn_down.weight", n_ff, n_embd, il=il)
    return spec


def _gemma3_spec(*, name: str, n_embd: int, n_layer: int, n_head: int, n_head_kv: int,
                 head_dim: int, n_ff: int, n_ctx: int, window: int, ftype: str) -> ModelSpec:
    meta = {"block_count": n_layer, "context_length": n_ctx, "embedding_length": n_embd,
            "feed_forward_length": n_ff, "attention.head_count": n_head,
            "attention.head_count_kv": n_head_kv, "attention.key_length": head_dim,
            "attention.value_length": head_dim, "attention.sliding_window": window,
            "rope.freq_base": 1_000_000.0, "rope.freq_base_swa": 10_000.0,
            "attention.layer_norm_rms_epsilon": 1e-6}
    # Gemma's own tokenizer is SentencePiece-like; the byte-level one loads the same tensors.
    spec = ModelSpec("gemma3", name, "llama-bpe", 262144, meta)
    b = _Builder(spec, ftype, n_layer, n_embd, tied=True)
    for il in range(n_layer):
        b.t(f"blk.{il}.attn_norm.weight", n_embd, il=il)
        b.t(f"blk.{il}.attn_q.weight", n_embd, head_dim * n_head, il=il)
        b.t(f"blk.{il}.attn_k.weight", n_embd, head_dim * n_head_kv, il=il)
        b.t(f"blk.{il}.attn_v.weight", n_embd, head_dim * n_head_kv, il=il)
        b.t(f"blk.{il}.attn_output.weight", head_dim * n_head, n_embd, il=il)
        b.t(f"blk.{il}.post_attention_norm.weight", n_embd, il=il)
        b.t(f"blk.{il}.attn_k_norm.weight", head_dim, il=il)
        b.t(f"blk.{il}.attn_q_norm.weight", head_dim, il=il)
        b.t(f"blk.{il}.ffn_norm.weight", n_embd, il=il)
        b.t(f"blk.{il}.ffn_gate.weight", n_embd, n_ff, il=il)
        b.t(f"blk.{il}.ffn_up.weight", n_embd, n_ff, il=il)
        b.t(f"blk.{il}.ffn_down.weight", n_ff, n_embd, il=il)
        b.t(f"blk.{il}.post_ffw_norm.weight", n_embd, il=il)
    return spec


def _deepseek2_lite_spec(ftype: str) -> ModelSpec:
    """DeepSeek-V2-Lite: MLA attention (one compressed K row per token) and a 64-expert MoE."""
    n_embd, n_layer, n_head, kv_rank, rope, nope, v_mla = 2048, 27, 16, 512, 64, 128, 128
    n_ff, n_ff_exp, n_expert, n_shared = 10944, 1408, 64, 2
    meta = {"block_count": n_layer, "context_length": 163840, "embedding_length": n_embd,
            "feed_forward_length": n_ff, "attention.head_count": n_head,
            "attention.head_count_kv": 1, "attention.key_length": kv_rank + rope,
            "attention.value_length": kv_rank, "attention.key_length_mla": nope + rope,
            "attention.value_length_mla": v_mla, "attention.kv_lora_rank": kv_rank,
            "rope.dimension_count": rope, "rope.freq_base": 10000.0,
            "attention.layer_norm_rms_epsilon": 1e-6, "leading_dense_block_count": 1,
            "expert_feed_forward_length": n_ff_exp, "expert_count": n_expert,
            "expert_used_count": 6, "expert_shared_count": n_shared,
            "expert_weights_scale": 1.0}
    spec = ModelSpec("deepseek2", "DeepSeek-V2-Lite (shape only)", "deepseek-llm", 102400, meta)
    b = _Builder(spec, ftype, n_layer, n_embd)
    for il in range(n_layer):
        p = f"blk.{il}."
        b.t(p + "attn_norm.weight", n_embd, il=il)
        b.t(p + "attn_kv_a_norm.weight", kv_rank, il=il)
        b.t(p + "attn_q.weight", n_embd, n_head * (nope + rope), il=il)
        b.t(p + "attn_kv_a_mqa.weight", n_embd, kv_rank + rope, il=il)
        b.t(p + "attn_k_b.weight", nope, kv_rank, n_head, il=il)
        b.t(p + "attn_v_b.weight", kv_rank, v_mla, n_head, il=il)
        b.t(p + "attn_output.weight", n_head * v_mla, n_embd, il=il)
        b.t(p + "ffn_norm.weight", n_embd, il=il)
        if il < 1:
            b.t(p + "ffn_gate.weight", n_embd, n_ff, il=il)
            b.t(p + "ffn_down.weight", n_ff, n_embd, il=il)
            b.t(p + "ffn_up.weight", n_embd, n_ff, il=il)
        else:
            b.t(p + "ffn_gate_inp.weight", n_embd, n_expert, il=il)
            b.t(p + "ffn_down_exps.weight", n_ff_exp, n_embd, n_expert, il=il)
            b.t(p + "ffn_gate_exps.weight", n_embd, n_ff_exp, n_expert, il=il)
            b.t(p + "ffn_up_exps.weight", n_embd, n_ff_exp, n_expert, il=il)
            b.t(p + "ffn_gate_shexp.weight", n_embd, n_ff_exp * n_shared, il=il)
            b.t(p + "ffn_down_shexp.weight", n_ff_exp * n_shared, n_embd, il=il)
            b.t(p + "ffn_up_shexp.weight", n_embd, n_ff_exp * n_shared, il=il)
    return spec


#: name -> builder(ftype). Dimensions are the published configs of these models.
SHAPES: dict[str, Callable[[str], ModelSpec]] = {
    "qwen3.6-27b": lambda ft: _qwen35_spec(
        name="Qwen3.6-27B (shape only)", n_embd=5120, n_layer=64, n_nextn=1, n_head=24,
        n_head_kv=4, head_dim=256, n_ff=17408, d_conv=4, d_state=128, n_group=16,
        n_v_heads=48, n_vocab=248320, n_ctx=262144, rope_dim=64, sections=[11, 11, 10, 0],
        ftype=ft),
    "qwen3.6-35b-a3b": lambda ft: _qwen35_spec(
        name="Qwen3.6-35B-A3B (shape only)", n_embd=2048, n_layer=40, n_nextn=1, n_head=16,
        n_head_kv=2, head_dim=256, n_ff=0, d_conv=4, d_state=128, n_group=16, n_v_heads=32,
        n_vocab=248320, n_ctx=262144, rope_dim=64, sections=[11, 11, 10, 0], ftype=ft,
        moe={"n_expert": 256, "n_used": 8, "n_ff_exp": 512, "n_ff_shexp": 512}),
    "llama3-8b": lambda ft: _llama_spec(
        name="Llama-3.1-8B (shape only)", n_embd=4096, n_layer=32, n_head=32, n_head_kv=8,
        n_ff=14336, n_ctx=131072, ftype=ft),
    "gemma3-12b": lambda ft: _gemma3_spec(
        name="Gemma-3-12B (shape only)", n_embd=3840, n_layer=48, n_head=16, n_head_kv=8,
        head_dim=256, n_ff=15360, n_ctx=131072, window=1024, ftype=ft),
    "deepseek2-lite": _deepseek2_lite_spec,
    # the dimensions of the demo model and of gemma-3-270m (their own GGUF headers)
    "smollm2-135m": lambda ft: _llama_spec(
        name="SmolLM2-135M (shape only)", n_embd=576, n_layer=30, n_head=9, n_head_kv=3,
        n_ff=1536, n_ctx=8192, ftype=ft, n_vocab=49152, tied=True),
    "gemma3-270m": lambda ft: _gemma3_spec(
        name="Gemma-3-270M (shape only)", n_embd=640, n_layer=18, n_head=4, n_head_kv=1,
        head_dim=256, n_ff=2048, n_ctx=32768, window=512, ftype=ft),
}


def _add_meta(w: Any, arch: str, meta: dict[str, Any]) -> None:
    from gguf.constants import GGUFValueType

    for key, val in meta.items():
        full = f"{arch}.{key}"
        if isinstance(val, bool):
            w.add_bool(full, val)
        elif isinstance(val, int):
            w.add_uint32(full, val)
        elif isinstance(val, float):
            w.add_float32(full, val)
        elif isinstance(val, str):
            w.add_string(full, val)
        elif isinstance(val, list):
            sub = GGUFValueType.INT32 if isinstance(val[0], int) else None
            w.add_key_value(full, val, GGUFValueType.ARRAY, sub_type=sub)
        else:
            raise TypeError(f"{full}: unsupported metadata value {val!r}")


def _tensor_nbytes(ne: tuple[int, ...], qtype: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype.upper()]]
    n = 1
    for d in ne:
        n *= d
    return n // block * size


def write_spec_shape_only(spec: ModelSpec, path: Path) -> Path:
    """Write header + tensor infos, then extend the file to full length (sparse, no data)."""
    import numpy as np
    from gguf import GGUFWriter
    from gguf.constants import GGMLQuantizationType

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, spec.arch)
    w.add_name(spec.name)
    w.add_file_type(15)  # MOSTLY_Q4_K_M; informational only
    w.add_quantization_version(2)
    _add_meta(w, spec.arch, spec.meta)
    _add_tokenizer(w, spec.vocab, spec.n_vocab)
    total = 0
    for t in spec.tensors:
        nbytes = _tensor_nbytes(t.ne, t.qtype)
        w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), nbytes,
                          raw_dtype=GGMLQuantizationType[t.qtype.upper()])
        total += GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    header_end = w.fout[0].tell()
    w.close()
    data_start = GGUFWriter.ggml_pad(header_end, w.data_alignment)
    # Extending with truncate leaves a hole: no data blocks are written, reads return zeros.
    os.truncate(path, data_start + total)
    return path


def write_shape_only(path: Path, model: str = "qwen3.6-27b", ftype: str = "q4_k_m") -> Path:
    """A shape-only GGUF of a known model (see SHAPES) at a quantization recipe."""
    if model not in SHAPES:
        raise ConfigError(f"unknown shape model {model!r}; known: {', '.join(sorted(SHAPES))}.")
    return write_spec_shape_only(SHAPES[model](ftype), path)


# --------------------------------------------------------------------------- tiny random


def tiny_spec(arch: str = "qwen35", mtp: bool = True, ftype: str = "f16",
              context: int = 4096) -> ModelSpec:
    """Small dimensions, every tensor f32/f16 (or q8_0 matrices), a working tokenizer: loads
    and runs in seconds. `context`: the trained context its header states."""
    if arch == "qwen35":
        return _qwen35_spec(
            name="tiny-qwen35-mtp" if mtp else "tiny-qwen35", n_embd=128, n_layer=4,
            n_nextn=1 if mtp else 0, n_head=4, n_head_kv=2, head_dim=64, n_ff=256, d_conv=4,
            d_state=32, n_group=2, n_v_heads=4, n_vocab=None, n_ctx=context, rope_dim=16,
            sections=[3, 3, 2, 0], ftype="f16", tied=True)
    if arch == "llama":
        # head size 128: fork cache types with 128-value blocks need whole heads per block
        return _llama_spec(name="tiny-llama", n_embd=256, n_layer=2, n_head=2, n_head_kv=1,
                           n_ff=256, n_ctx=context, ftype=ftype, tied=True)
    raise ConfigError(f"no tiny model for architecture {arch!r}; use 'qwen35' or 'llama'.")


def _random_tensors(spec: ModelSpec, seed: int) -> Iterator[tuple[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    for t in spec.tensors:
        shape = tuple(reversed(t.ne))
        if "_norm" in t.name or t.name.endswith(("enorm.weight", "hnorm.weight")):
            arr = np.ones(shape, dtype=np.float32)
        elif t.name.endswith("ssm_a"):
            arr = -np.exp(rng.uniform(-1, 0.5, size=shape)).astype(np.float32)
        elif t.name.endswith("ssm_dt.bias"):
            arr = rng.uniform(-1, 1, size=shape).astype(np.float32)
        else:
            fan_in = t.ne[0]
            arr = rng.normal(0, 1 / np.sqrt(fan_in), size=shape).astype(np.float32)
        if t.qtype == "q8_0":
            from gguf import GGMLQuantizationType
            from gguf.quants import quantize

            yield t.name, (quantize(arr, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        else:
            yield t.name, (arr if t.qtype == "f32" else arr.astype(np.float16), None)


def write_tiny_random(path: Path, arch: str = "qwen35", mtp: bool = True, seed: int = 0,
                      ftype: str = "f16", context: int = 4096) -> Path:
    """A tiny random-weight model llama-server runs; the qwen35 one has an MTP (nextn) block.
    `ftype="q8_0"` (llama only) quantizes its matrices, so quantized CPU kernels run too;
    `context` is the trained context in its header (longer documents for a benchmark)."""
    from gguf import GGUFWriter

    spec = tiny_spec(arch, mtp, ftype, context)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, spec.arch)
    w.add_name(spec.name)
    w.add_file_type(7 if ftype == "q8_0" else 1)  # LLAMA_FTYPE_MOSTLY_Q8_0 / _F16
    _add_meta(w, spec.arch, spec.meta)
    _add_tokenizer(w, spec.vocab, spec.n_vocab)
    for name, (arr, raw_dtype) in _random_tensors(spec, seed):
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
