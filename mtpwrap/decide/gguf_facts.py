"""Model facts from a GGUF header: what the memory planner needs, and what the model is made
for (chat, embedding, rerank: `model_role`), without reading tensor data.

The header is walked directly with the `gguf` package's constants (value types, quantization
block sizes) instead of `gguf.GGUFReader`: the reader materialises every vocabulary string and
merge as numpy objects, which takes tens of seconds on a 250K-token vocabulary. Here long arrays
are skipped and only their length is kept, so a 16 GB model answers in a fraction of a second and
tensor data is never touched (the file is memory-mapped; only header pages are faulted in).

The layer semantics follow llama.cpp (src/llama-model.cpp, src/llama-hparams.cpp):
- hybrid Qwen3.5/Qwen3-Next: every `full_attention_interval`-th layer has KV, the others are
  Gated DeltaNet layers with a fixed f32 recurrent state;
- `nextn_predict_layers` trailing blocks are MTP layers: not run, not cached and not loaded unless
  MTP decoding is on;
- sliding-window layers (Gemma) keep a window-sized cache;
- MLA (DeepSeek-2 style) caches one compressed K row per token and no V.
"""

from __future__ import annotations

import mmap
import re
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mtpwrap.errors import ConfigError

GGUF_MAGIC = b"GGUF"
#: arrays longer than this are skipped (their length is kept); per-layer arrays are far shorter.
_MAX_KEPT_ARRAY = 4096

#: Architectures whose cache layout this module knows. Others get a generic estimate.
HYBRID_RECURRENT = {"qwen35", "qwen35moe", "qwen3next"}
#: default SWA pattern (every n-th layer is global) where the GGUF carries no explicit pattern.
SWA_DEFAULT_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gemma3n": 5}
KNOWN_ARCHS = {
    "llama", "mistral3", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "qwen35", "qwen35moe",
    "qwen3next", "gemma", "gemma2", "gemma3", "deepseek2", "phi3", "granite", "olmo2", "smollm3",
    "cohere2", "exaone", "internlm2", "starcoder2", "stablelm", "gpt-oss", "openai-moe",
    "glm4", "glm4moe",
}
#: llama.cpp's enum llama_pooling_type (include/llama.h), the values of `{arch}.pooling_type`;
#: -1 (unspecified) is read as no pooling type at all.
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
#: bidirectional encoders (llama.cpp builds them without a causal mask): a text encoder without a
#: classifier head is made for embeddings.
ENCODER_ARCHS = frozenset({
    "bert", "modern-bert", "nomic-bert", "nomic-bert-moe", "neo-bert", "jina-bert-v2",
    "jina-bert-v3", "eurobert", "gemma-embedding", "t5encoder",
})
#: architectures llama.cpp runs without a KV cache (llama_model::create_memory gives none).
NO_KV_CACHE = frozenset({
    "bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe", "neo-bert",
    "eurobert", "wavtokenizer-dec", "modern-bert", "gemma-embedding", "dream", "llada",
    "llada-moe", "rnd1",
})
#: the classifier head (llama.cpp's LLM_TENSOR_CLS "cls", CLS_OUT "cls.output", CLS_NORM
#: "cls.norm"): llama.cpp applies it only with rank pooling.
CLASSIFIER_TENSORS = ("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias",
                      "cls.norm.weight")
#: `general.type` values of GGUF files that are not models (gguf's GGUFType)
NOT_A_MODEL = {"adapter": "a LoRA adapter", "imatrix": "an importance matrix",
               "mmproj": "a multimodal projector"}
#: tensors llama.cpp always keeps in host memory (the input embedding is a row lookup).
HOST_TENSORS = re.compile(r"^(token_embd|per_layer_token_embd|token_types)\.")
_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str
    shape: tuple[int, ...]
    n_bytes: int
    offset: int


@dataclass
class ModelFacts:
    path: str
    file_size: int
    architecture: str
    name: str | None
    generic: bool
    n_layer_all: int           #: block_count, MTP layers included
    n_layer_nextn: int         #: trailing MTP/nextn blocks
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: list[int]          #: per layer (all blocks)
    n_head_kv: list[int]       #: per layer (all blocks)
    head_dim_k: int
    head_dim_v: int
    head_dim_k_swa: int
    head_dim_v_swa: int
    kv_layers: list[int]       #: trunk layers that hold KV in the main context
    swa_layers: list[int]      #: subset of kv_layers with a sliding window
    sliding_window: int
    is_mla: bool
    recurrent_layers: list[int]
    recurrent_r_floats: int    #: conv state floats per layer per row
    recurrent_s_floats: int    #: ssm state floats per layer per row
    recurrent_conv_dim: int    #: width of the DeltaNet qkv projection (2 × key dim + value dim)
    recurrent_inner: int       #: DeltaNet inner size (value heads × head size)
    n_expert: int
    n_expert_used: int
    n_ff: int
    tensor_bytes: int          #: every tensor
    bytes_by_type: dict[str, int]
    host_bytes: int            #: tensors that stay in host memory whatever -ngl says
    mtp_bytes: int             #: tensors of the nextn blocks (loaded only with MTP on)
    output_bytes: int          #: output.weight (0 when tied to token_embd)
    token_embd_bytes: int
    layer_bytes: dict[int, int]  #: per block
    data_offset: int
    warnings: list[str] = field(default_factory=list)
    #: `{arch}.pooling_type` (llama_pooling_type); None when absent or -1 (unspecified)
    pooling_type: int | None = None
    #: `{arch}.attention.causal`; None when absent (llama.cpp's default is causal)
    causal_attention: bool | None = None
    #: entries of `{arch}.classifier.output_labels`
    classifier_labels: int = 0
    #: classifier head tensors present (CLASSIFIER_TENSORS), name → shape (ggml order)
    classifier_tensors: dict[str, list[int]] = field(default_factory=dict)
    #: `{arch}.embedding_length_out` (0: absent, the output is n_embd wide)
    embedding_length_out: int = 0
    #: whether llama.cpp keeps a KV cache for this architecture (encoders: none)
    kv_cache: bool = True

    @property
    def n_layer(self) -> int:
        """Trunk layers (what the main context runs)."""
        return self.n_layer_all - self.n_layer_nextn

    @property
    def has_mtp(self) -> bool:
        return self.n_layer_nextn > 0

    @property
    def hybrid(self) -> bool:
        return bool(self.recurrent_layers)

    @property
    def pooling(self) -> str | None:
        """The pooling type's name (llama-server's --pooling spelling), None when absent."""
        return POOLING_NAMES.get(self.pooling_type) if self.pooling_type is not None else None

    @property
    def n_embd_out(self) -> int:
        """Values per embedding (llama.cpp's n_embd_out)."""
        return self.embedding_length_out or self.n_embd

    @property
    def n_cls_out(self) -> int:
        """Scores per input with rank pooling (llama.cpp's n_cls_out: the labels, else 1)."""
        return self.classifier_labels or 1

    def kv_heads(self, il: int) -> tuple[int, int, int]:
        """(K head size, V head size, KV heads) of layer il."""
        swa = il in self.swa_layers
        dk = self.head_dim_k_swa if swa and self.head_dim_k_swa else self.head_dim_k
        dv = self.head_dim_v_swa if swa and self.head_dim_v_swa else self.head_dim_v
        nkv = self.n_head_kv[il] if il < len(self.n_head_kv) else self.n_head_kv[-1]
        return dk, dv, nkv

    def kv_row_values(self, il: int) -> tuple[int, int]:
        """(K values, V values) per token for layer il (V is 0 for MLA)."""
        dk, dv, nkv = self.kv_heads(il)
        return dk * nkv, (0 if self.is_mla else dv * nkv)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["n_layer"] = self.n_layer
        d["layer_bytes"] = {str(k): v for k, v in self.layer_bytes.items()}
        return d


def model_role(f: ModelFacts) -> tuple[str, str]:
    """What the file is made for — "embedding", "rerank" or "chat" — and which header facts
    decided it, in one line. Rank pooling or a classifier head that scores (cls.output, or a
    one-row cls.weight as jina-reranker-v1 has) is a reranker; a pooling type (mean, cls, last)
    or a bidirectional encoder without one is an embedding model; anything else is a chat model
    (which llama-server can still serve with --embeddings)."""
    a = f.architecture
    pooled = f"{a}.pooling_type is {f.pooling_type} ({f.pooling})" if f.pooling else None
    head = [n for n, shape in f.classifier_tensors.items()
            if n.startswith("cls.output.") or (n == "cls.weight" and shape[1:] == [1])]
    labels = f", {f.classifier_labels} classifier label(s)" if f.classifier_labels else ""
    if f.pooling == "rank":
        tensors = (f", classifier tensors {', '.join(f.classifier_tensors)}"
                   if f.classifier_tensors else ", no classifier tensors")
        return "rerank", f"{pooled}{tensors}{labels}"
    if head:
        return "rerank", (f"classifier tensors {', '.join(head)} score the input"
                          f"{labels} ({pooled or f'no {a}.pooling_type'})")
    if pooled and f.pooling != "none":
        return "embedding", pooled
    causal = (f"no {a}.attention.causal" if f.causal_attention is None
              else f"{a}.attention.causal is {'true' if f.causal_attention else 'false'}")
    if a in ENCODER_ARCHS and f.causal_attention is not True:
        return "embedding", (f"{a} is a bidirectional encoder ({causal}) without classifier "
                             f"tensors ({pooled or f'no {a}.pooling_type'})")
    why = [pooled or f"no {a}.pooling_type", "no classifier head"]
    if f.causal_attention is False:
        why.append(f"{causal}, but {a} is not an encoder architecture")
    elif f.causal_attention is None:
        why.append(f"causal attention ({causal}: llama.cpp's default)")
    else:
        why.append(f"causal attention ({causal})")
    return "chat", ", ".join(why)


def _role_facts(meta: dict[str, Any], infos: list[TensorInfo], arch: str, path: Path,
                warnings: list[str]) -> dict[str, Any]:
    """The header facts that say what a model is made for (`model_role`), as ModelFacts
    fields."""
    a = arch + "."
    pooling: int | None = None
    raw = meta.get(a + "pooling_type")
    if raw is not None:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(f"{path}: {a}pooling_type is {raw!r}; an integer "
                              "(llama_pooling_type, 0 none … 4 rank) was expected.")
        pooling = raw - (1 << 32) if raw >= 1 << 31 else raw  # -1 written as uint32
        if pooling == -1:
            pooling = None
        elif pooling not in POOLING_NAMES:
            warnings.append(f"{a}pooling_type is {pooling}, which llama.cpp does not know "
                            "(0 none, 1 mean, 2 cls, 3 last, 4 rank); the role ignores it")
    causal = meta.get(a + "attention.causal")
    labels = meta.get(a + "classifier.output_labels")
    return {
        "pooling_type": pooling,
        "causal_attention": None if causal is None else bool(causal),
        "classifier_labels": len(labels) if isinstance(labels, (list, _Skipped)) else 0,
        "classifier_tensors": {t.name: list(t.shape) for t in infos
                               if t.name in CLASSIFIER_TENSORS},
        "embedding_length_out": int(meta.get(a + "embedding_length_out", 0) or 0),
        "kv_cache": arch not in NO_KV_CACHE,
    }


class _Header:
    """A bounds-checked cursor over the mapped file; running off the end means truncation."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path
        self.size = len(buf)

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise ConfigError(
                f"{self.path}: the GGUF header is cut off at byte {self.size} (truncated or "
                "corrupt download); download the model again and check its sha256."
            )

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        val = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return val[0] if len(val) == 1 else val

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 30:
            raise ConfigError(f"{self.path}: corrupt GGUF header (a string of {n} bytes); "
                              "download the model again.")
        self.need(n)
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8)
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos
        self.need(0)


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_value(h: _Header, vtype: int) -> Any:
    if vtype in _SCALAR:
        return h.unpack(_SCALAR[vtype])
    if vtype == _STRING:
        return h.string()
    if vtype == _ARRAY:
        etype = h.unpack("<I")
        count = h.unpack("<Q")
        if etype == _STRING:
            if count > _MAX_KEPT_ARRAY:
                h.skip_strings(count)
                return _Skipped(count)
            return [h.string() for _ in range(count)]
        if etype in _SCALAR:
            width = struct.calcsize(_SCALAR[etype])
            if count > _MAX_KEPT_ARRAY:
                h.need(width * count)
                h.pos += width * count
                return _Skipped(count)
            return [h.unpack(_SCALAR[etype]) for _ in range(count)]
        raise ConfigError(f"{h.path}: corrupt GGUF header (array of unknown type {etype}); "
                          "download the model again.")
    raise ConfigError(f"{h.path}: corrupt GGUF header (unknown value type {vtype}); "
                      "download the model again.")


@dataclass(frozen=True)
class _Skipped:
    length: int

    def __len__(self) -> int:
        return self.length


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo], int, int]:
    """(metadata, tensor infos, data offset, file size). Long arrays come back as their length."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such model file; pass the path of a .gguf file.")
    size = path.stat().st_size
    if size < 24:
        raise ConfigError(f"{path}: not a GGUF file ({size} bytes); pass a .gguf model file.")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != GGUF_MAGIC:
            raise ConfigError(f"{path}: not a GGUF file (it does not start with 'GGUF'); "
                              "pass a llama.cpp .gguf model file.")
        h = _Header(mm, path)
        h.pos = 4
        version = h.unpack("<I")
        if version not in (2, 3):
            raise ConfigError(f"{path}: GGUF version {version} is not supported (2 or 3 expected); "
                              "convert the model with a current llama.cpp.")
        n_tensors, n_kv = h.unpack("<Q"), h.unpack("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ConfigError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys); "
                              "download the model again.")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = h.string()
            meta[key] = _read_value(h, h.unpack("<I"))
        infos: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = h.string()
            n_dims = h.unpack("<I")
            if n_dims > 8:
                raise ConfigError(f"{path}: corrupt GGUF tensor info for {name!r}; "
                                  "download the model again.")
            shape = tuple(h.unpack("<Q") for _ in range(n_dims))
            tcode = h.unpack("<I")
            offset = h.unpack("<Q")
            try:
                qtype = GGMLQuantizationType(tcode)
                block, tsize = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError) as err:
                raise ConfigError(f"{path}: tensor {name!r} has tensor type {tcode}, unknown to "
                                  "this gguf package; upgrade the `gguf` package.") from err
            n_el = 1
            for d in shape:
                n_el *= d
            infos.append(TensorInfo(name, qtype.name.lower(), shape, n_el // block * tsize, offset))
        align = int(meta.get("general.alignment", 32))
        data_offset = (h.pos + align - 1) // align * align
    end = max((data_offset + t.offset + t.n_bytes for t in infos), default=0)
    if end > size:
        raise ConfigError(
            f"{path}: truncated: tensor data needs {end} bytes but the file has {size}; "
            "the download is incomplete — download it again and check its sha256."
        )
    return meta, infos, data_offset, size


def _per_layer(val: Any, n: int, default: int) -> list[int]:
    if val is None or isinstance(val, _Skipped):
        return [default] * n
    if isinstance(val, list):
        vals = [int(v) for v in val][:n]
        return vals + [vals[-1] if vals else default] * (n - len(vals))
    return [int(val)] * n


#: the shard naming of a split model (`NAME-00001-of-00003.gguf`), for a name or a path
SPLIT = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


def _split_siblings(path: Path, n_split: int) -> list[Path]:
    """The other shards of a split model (`NAME-00001-of-00003.gguf` naming)."""
    m = SPLIT.match(path.name)
    if not m or int(m["n"]) != n_split:
        raise ConfigError(f"{path}: the GGUF says it is part 1 of {n_split} but its name does not "
                          "follow NAME-00001-of-0000N.gguf; keep the shards' original names.")
    shards = [path.with_name(f"{m['stem']}-{i:05d}-of-{n_split:05d}.gguf")
              for i in range(1, n_split + 1)]
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise ConfigError(f"{path}: split model is missing {', '.join(missing)}; download every "
                          "part into the same folder.")
    return [p for p in shards if p.name != path.name]


def _recurrent(get: Callable[..., Any], arch: str, n_trunk: int
               ) -> tuple[list[int], int, int, int, int]:
    """Recurrent (Gated DeltaNet / Mamba-style) layers: (layers, conv-state floats, state
    floats, conv width, inner size)."""
    if arch not in HYBRID_RECURRENT:
        return [], 0, 0, 0, 0
    explicit = get("attention.recurrent_layers")
    if isinstance(explicit, list):
        recurrent = [i for i, v in enumerate(explicit[:n_trunk]) if v]
    else:
        interval = int(get("full_attention_interval", 4))
        recurrent = [i for i in range(n_trunk) if (i + 1) % interval != 0]
    d_conv = int(get("ssm.conv_kernel", 0))
    d_inner = int(get("ssm.inner_size", 0))
    d_state = int(get("ssm.state_size", 0))
    n_group = int(get("ssm.group_count", 0))
    n_v_heads = int(get("ssm.time_step_rank", 0))
    conv_dim = d_inner + 2 * n_group * d_state
    r_floats = max(d_conv - 1, 0) * conv_dim
    head_v = d_inner // n_v_heads if n_v_heads else 0
    s_floats = head_v * head_v * n_v_heads
    return recurrent, r_floats, s_floats, conv_dim, d_inner


def _swa_layers(get: Callable[..., Any], arch: str, generic: bool, n_trunk: int,
                kv_layers: list[int]) -> tuple[list[int], int]:
    """Sliding-window layers (among those with a KV cache) and the window."""
    swa_layers: list[int] = []
    window = int(get("attention.sliding_window", 0) or 0)
    if window > 0 and not generic:
        pattern = get("attention.sliding_window_pattern")
        if isinstance(pattern, list):
            swa_layers = [i for i in range(n_trunk) if i < len(pattern) and bool(pattern[i])]
        elif arch in SWA_DEFAULT_PATTERN or isinstance(pattern, int):
            n_pat = int(pattern) if isinstance(pattern, int) else SWA_DEFAULT_PATTERN[arch]
            swa_layers = [i for i in range(n_trunk) if n_pat == 0 or i % n_pat < n_pat - 1]
        swa_layers = [i for i in swa_layers if i in set(kv_layers)]
    return swa_layers, window


def _tensor_sums(infos: list[Any], n_trunk: int) -> dict[str, Any]:
    """Tensor bytes: in all, by type, kept on the host, MTP blocks, output, token embeddings,
    per layer — as ModelFacts fields."""
    by_type: dict[str, int] = {}
    layer_bytes: dict[int, int] = {}
    host = mtp = out = total = embd = 0
    for t in infos:
        total += t.n_bytes
        by_type[t.ggml_type] = by_type.get(t.ggml_type, 0) + t.n_bytes
        if HOST_TENSORS.match(t.name):
            host += t.n_bytes
        if t.name.startswith("output."):
            out += t.n_bytes
        if t.name == "token_embd.weight":
            embd = t.n_bytes
        m = _BLK.match(t.name)
        if m:
            il = int(m.group(1))
            layer_bytes[il] = layer_bytes.get(il, 0) + t.n_bytes
            if il >= n_trunk:
                mtp += t.n_bytes
    return {"tensor_bytes": total, "bytes_by_type": by_type, "host_bytes": host,
            "mtp_bytes": mtp, "output_bytes": out, "token_embd_bytes": embd,
            "layer_bytes": layer_bytes}


def read_facts(path: Path) -> ModelFacts:
    """Facts the planner needs, from the header only. Raises ConfigError for a bad file."""
    meta, infos, data_offset, size = read_header(path)
    n_split = int(meta.get("split.count", 1) or 1)
    if n_split > 1 and int(meta.get("split.no", 0) or 0) != 0:
        first = [p for p in _split_siblings(Path(path), n_split) if "-00001-of-" in p.name]
        return read_facts(first[0])  # the first shard holds the model's metadata
    if n_split > 1:
        # a split model: every shard carries tensor infos of its own part of the weights
        for shard in _split_siblings(Path(path), n_split):
            _m, more, _off, more_size = read_header(shard)
            infos = infos + more
            size += more_size
    kind = meta.get("general.type")
    if kind in NOT_A_MODEL:
        raise ConfigError(f"{path}: general.type is {kind!r}, {NOT_A_MODEL[kind]}, not a model; "
                          "pass the model's own .gguf file.")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ConfigError(f"{path}: the GGUF has no general.architecture key; it is not a "
                          "llama.cpp model file.")
    a = arch + "."

    def get(key: str, default: Any = None) -> Any:
        return meta.get(a + key, default)

    warnings: list[str] = []
    generic = arch not in KNOWN_ARCHS
    if generic:
        warnings.append(f"architecture {arch!r} is not one the planner knows; the estimate "
                        "treats every layer as full attention and may be off")
    n_all = int(get("block_count", 0))
    if n_all <= 0:
        raise ConfigError(f"{path}: {a}block_count is missing; the GGUF is incomplete.")
    n_embd = int(get("embedding_length", 0))
    nextn = int(get("nextn_predict_layers", 0))
    n_trunk = n_all - nextn
    n_head = _per_layer(get("attention.head_count"), n_all, 0)
    n_head_kv = _per_layer(get("attention.head_count_kv"), n_all, n_head[0])
    head0 = max(n_head) if n_head else 0
    dk = int(get("attention.key_length", n_embd // head0 if head0 else 0))
    dv = int(get("attention.value_length", dk))
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = int(get("vocab_size", len(tokens) if tokens is not None else 0))
    is_mla = (get("attention.kv_lora_rank") is not None
              and get("attention.key_length_mla") is not None)
    recurrent, r_floats, s_floats, conv_dim, d_inner = _recurrent(get, arch, n_trunk)
    kv_layers = [i for i in range(n_trunk) if i not in set(recurrent) and n_head_kv[i] > 0]
    swa_layers, window = _swa_layers(get, arch, generic, n_trunk, kv_layers)
    n_ff_val = get("feed_forward_length", 0)
    n_ff = max(_per_layer(n_ff_val, n_all, 0)) if n_ff_val else 0
    return ModelFacts(
        path=str(path), file_size=size, architecture=arch,
        name=meta.get("general.name") if isinstance(meta.get("general.name"), str) else None,
        generic=generic, n_layer_all=n_all, n_layer_nextn=nextn, n_embd=n_embd,
        n_vocab=n_vocab, n_ctx_train=int(get("context_length", 0)),
        n_head=n_head, n_head_kv=n_head_kv, head_dim_k=dk, head_dim_v=dv,
        head_dim_k_swa=int(get("attention.key_length_swa", 0)),
        head_dim_v_swa=int(get("attention.value_length_swa", 0)),
        kv_layers=kv_layers, swa_layers=swa_layers, sliding_window=window, is_mla=is_mla,
        recurrent_layers=recurrent, recurrent_r_floats=r_floats, recurrent_s_floats=s_floats,
        recurrent_conv_dim=conv_dim,
        recurrent_inner=d_inner if recurrent else 0,
        n_expert=int(get("expert_count", 0)), n_expert_used=int(get("expert_used_count", 0)),
        n_ff=n_ff, data_offset=data_offset, warnings=warnings, **_tensor_sums(infos, n_trunk),
        **_role_facts(meta, infos, arch, Path(path), warnings),
    )
