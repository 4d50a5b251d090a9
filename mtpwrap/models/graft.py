"""`models graft`: give a fine-tune the MTP (nextn) head of the model it was tuned from.

A fine-tune converted to GGUF often loses the trailing nextn blocks of its base model (the
converter drops them, or they were never in the tuned checkpoint). Those blocks predict the next
tokens from the trunk's last hidden state and the shared embedding, so the base's head fits any
fine-tune that kept the base's shape and tokenizer — which is checked first, field by field.

The output is the target's metadata and tensors with its head (if `--replace`) left out, the
base's blocks `blk.N.*` for N ≥ the trunk's layer count appended, `block_count`,
`nextn_predict_layers` and any per-layer metadata array extended with the base's entries for
those blocks, and `mtpwrap.graft.*` keys saying where the head came from. Tensor data is
streamed from the memory-mapped inputs (the `gguf` package's reader and writer), so a 17 GB
model is never held in memory; the file is written under a temporary name and renamed when
complete.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpwrap.errors import ConfigError, RuntimeFailure
from mtpwrap.models.inspect import in_head

#: keys of ours recording a grafted head's origin
GRAFT_KEYS = ("mtpwrap.graft.mtp_from", "mtpwrap.graft.mtp_from_name",
              "mtpwrap.graft.mtp_from_sha256", "mtpwrap.graft.mtp_from_repo",
              "mtpwrap.graft.mtp_layers")
#: what must agree between the base and the target (key without the architecture prefix,
#: how to name it)
SHAPE_KEYS = (
    ("embedding_length", "embedding size"),
    ("attention.head_count", "attention heads"),
    ("attention.head_count_kv", "KV heads"),
    ("attention.key_length", "K head size"),
    ("attention.value_length", "V head size"),
    ("full_attention_interval", "full-attention interval"),
)
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre")
#: metadata that llama.cpp reads per layer when it is an array (llama-model-loader
#: get_key_or_arr): one entry per block, so the head's blocks need theirs
PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length",
                  "attention.sliding_window_pattern", "attention.recurrent_layers")


@dataclass
class Model:
    """One GGUF opened for grafting: its reader and what the checks need."""

    path: Path
    reader: Any
    arch: str
    blocks: int
    nextn: int

    @property
    def trunk(self) -> int:
        return self.blocks - self.nextn

    def value(self, key: str) -> Any:
        field = self.reader.get_field(key)
        return None if field is None else field.contents()

    def arch_value(self, key: str) -> Any:
        return self.value(f"{self.arch}.{key}")

    def head_tensors(self) -> list[Any]:
        return [t for t in self.reader.tensors if in_head(t.name, self.trunk)]

    def vocab(self) -> int:
        n = self.arch_value("vocab_size")
        if n is not None:
            return int(n)
        field = self.reader.get_field("tokenizer.ggml.tokens")
        return len(field.data) if field is not None else 0


def _reader(path: Path) -> Any:
    """The gguf package's reader over a plain ndarray view of its memory map. Slicing a
    `np.memmap` costs a subclass round trip per slice, and the reader slices once per token
    string (500,000 times for a Qwen vocabulary): the plain view reads the same mapped pages,
    still lazily, in a quarter of the time."""
    import numpy as np
    from gguf import GGUFReader

    class Reader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return Reader(path, "r")


def open_model(path: Path, what: str) -> Model:
    if not path.is_file():
        raise ConfigError(f"{what} {path}: no such file.")
    try:
        reader = _reader(path)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{what} {path}: not a readable GGUF file ({exc}).") from None
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    if not isinstance(arch, str):
        raise ConfigError(f"{what} {path}: the GGUF has no general.architecture.")
    split = reader.get_field("split.count")
    if split is not None and int(split.contents()) > 1:
        raise ConfigError(f"{what} {path}: a split GGUF; merge it first "
                          "(llama-gguf-split --merge) and graft the whole file.")
    m = Model(path, reader, arch, 0, 0)
    m.blocks = int(m.arch_value("block_count") or 0)
    m.nextn = int(m.arch_value("nextn_predict_layers") or 0)
    if m.blocks <= 0:
        raise ConfigError(f"{what} {path}: {arch}.block_count is missing.")
    return m


def _per_layer(val: Any, n: int) -> list[Any]:
    return list(val) if isinstance(val, list) else [val] * n


def check_together(base: Model, target: Model) -> None:
    """Refuse, naming the field, a head that does not belong to the target."""
    def differ(what: str, b: Any, t: Any) -> ConfigError:
        return ConfigError(f"graft: the target's {what} is {t}, the base's {b}; the base's MTP "
                           "head does not belong to this model.",
                           hint="Take the head from the model the fine-tune was made from.")

    if base.arch != target.arch:
        raise differ("architecture (general.architecture)", base.arch, target.arch)
    if base.trunk != target.trunk:
        raise differ(f"trunk layer count ({base.arch}.block_count − nextn_predict_layers)",
                     base.trunk, target.trunk)
    for key, what in SHAPE_KEYS:
        b, t = base.arch_value(key), target.arch_value(key)
        if isinstance(b, list) or isinstance(t, list):
            # per-layer arrays: the trunk's entries must agree
            b = _per_layer(b, base.blocks)[: base.trunk]
            t = _per_layer(t, target.blocks)[: target.trunk]
        if b != t:
            raise differ(f"{what} ({base.arch}.{key})", b, t)
    if base.vocab() != target.vocab():
        raise differ("vocabulary size (tokenizer.ggml.tokens)", base.vocab(), target.vocab())
    for key in TOKENIZER_KEYS:
        if base.value(key) != target.value(key):
            raise differ(f"tokenizer ({key})", base.value(key), target.value(key))
    bt, tt = base.reader.get_field("tokenizer.ggml.tokens"), \
        target.reader.get_field("tokenizer.ggml.tokens")
    if (bt is None) != (tt is None) or (bt is not None and bt.contents() != tt.contents()):
        raise differ("tokenizer (tokenizer.ggml.tokens)", "another token list", "one token list")
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in base.reader.tensors}
    for t in target.reader.tensors:
        if in_head(t.name, target.trunk):
            continue
        want = shapes.get(t.name)
        if want is not None and want != tuple(int(x) for x in t.shape):
            raise differ(f"tensor {t.name} shape", list(want), [int(x) for x in t.shape])


def _origin(base: Model) -> dict[str, Any]:
    """What the output records about the head's origin: file, name, and the pull record's
    repository and sha256 when one is beside the base."""
    out: dict[str, Any] = {"mtpwrap.graft.mtp_from": base.path.name,
                           "mtpwrap.graft.mtp_layers": base.nextn}
    name = base.value("general.name")
    if isinstance(name, str):
        out["mtpwrap.graft.mtp_from_name"] = name
    rec = base.path.with_name(base.path.name + ".json")
    try:
        data = json.loads(rec.read_text())
        out["mtpwrap.graft.mtp_from_sha256"] = str(data["sha256"])
        if data.get("repo"):
            out["mtpwrap.graft.mtp_from_repo"] = f"{data['repo']}@{data.get('revision', '')}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return out


def _metadata(base: Model, target: Model, writer: Any) -> None:
    """The target's fields, with the block count, the head's layer count and every per-layer
    array extended for the base's head blocks, and the origin keys."""
    from gguf import GGUFValueType

    blocks = target.trunk + base.nextn
    replaced = {f"{target.arch}.block_count": blocks,
                f"{target.arch}.nextn_predict_layers": base.nextn}
    for field in target.reader.fields.values():
        name = field.name
        if name == "general.architecture" or name.startswith("GGUF.") or name in replaced \
                or name in GRAFT_KEYS:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        val = field.contents()
        if (name.removeprefix(target.arch + ".") in PER_LAYER_KEYS and isinstance(val, list)
                and len(val) == target.blocks):
            more = _per_layer(base.value(name), base.blocks)
            val = val[: target.trunk] + more[base.trunk: base.blocks]
        writer.add_key_value(name, val, vtype, sub_type=sub)
    for name, val in replaced.items():
        writer.add_key_value(name, val, GGUFValueType.UINT32)
    for name, val in _origin(base).items():
        vt = GGUFValueType.UINT32 if isinstance(val, int) else GGUFValueType.STRING
        writer.add_key_value(name, val, vt)


def write(base: Model, target: Model, tmp: Path,
          progress: Callable[[int, int], None] | None = None) -> None:
    from gguf import GGUFWriter

    keep = [t for t in target.reader.tensors if not in_head(t.name, target.trunk)]
    tensors = [(t, target.reader) for t in keep] + [(t, base.reader)
                                                   for t in base.head_tensors()]
    writer = GGUFWriter(tmp, target.arch, endianess=target.reader.endianess)
    align = target.value("general.alignment")
    if isinstance(align, int):
        writer.data_alignment = align
    _metadata(base, target, writer)
    for t, _ in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                               t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(t.n_bytes for t, _ in tensors)
    done = 0
    for t, reader in tensors:
        # a memory-mapped view: written page by page, never read into memory as a whole
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        done += t.n_bytes
        if progress:
            progress(done, total)
    writer.close()


def graft(base_path: Path, target_path: Path, out: Path, *, replace: bool = False,
          progress: Callable[[int, int], None] | None = None) -> Path:
    """Write `out`: the target with the base's MTP head. Returns `out`."""
    if out.exists():
        raise ConfigError(f"-o {out}: the file exists; remove it or name another output.")
    for p, what in ((base_path, "--mtp-from"), (target_path, "TARGET")):
        if p.exists() and out.resolve() == p.resolve():
            raise ConfigError(f"-o {out} is the {what} file; write the result elsewhere.")
    base = open_model(base_path, "--mtp-from")
    if not base.head_tensors() or base.nextn <= 0:
        raise ConfigError(f"--mtp-from {base_path}: the base has no MTP head "
                          f"({base.arch}.nextn_predict_layers is {base.nextn}, "
                          f"{len(base.head_tensors())} head tensors); there is nothing to graft.",
                          hint="Take the head from the original model's GGUF, converted with "
                               "its MTP layers.")
    target = open_model(target_path, "TARGET")
    if target.nextn > 0 and target.head_tensors() and not replace:
        raise ConfigError(f"TARGET {target_path} already has an MTP head "
                          f"({target.nextn} nextn layer(s)).",
                          hint="Pass --replace to put the base's head in its place.")
    check_together(base, target)
    tmp = out.with_name(f".{out.name}.graft-{os.getpid()}.part")
    try:
        write(base, target, tmp, progress)
        os.replace(tmp, out)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise RuntimeFailure(f"no space left in {out.parent} while writing {out.name}; "
                                 "nothing was kept.", hint="Free space, or write -o elsewhere.") \
                from None
        raise RuntimeFailure(f"-o {out}: cannot write it ({exc.strerror or exc}).") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out
