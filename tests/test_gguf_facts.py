"""Model facts from GGUF headers: the Qwen3.6-27B numbers of docs/facts.md §3, and bad files."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from mtpwrap.build import tiny_gguf
from mtpwrap.decide.gguf_facts import read_facts, read_header
from mtpwrap.errors import ConfigError
from tests.helpers import run_cli

pytestmark = pytest.mark.usefixtures("drop_gguf_files")

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def q27(shape_27b: Path) -> Path:
    return shape_27b


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf.write_tiny_random(tmp_path_factory.mktemp("tiny") / "tiny.gguf",
                                         arch="llama")


def test_qwen36_27b_facts_match_the_published_figures(q27: Path) -> None:
    f = read_facts(q27)
    assert (f.architecture, f.generic) == ("qwen35", False)
    assert (f.n_layer_all, f.n_layer_nextn, f.n_layer) == (65, 1, 64)
    assert (f.n_embd, f.n_head[0], f.n_head_kv[0], f.head_dim_k) == (5120, 24, 4, 256)
    assert (f.n_vocab, f.n_ctx_train) == (248_320, 262_144)
    # every 4th layer holds KV; MTP layer 64 is not part of the main context
    assert f.kv_layers == list(range(3, 64, 4))
    assert len(f.recurrent_layers) == 48
    per_row = len(f.recurrent_layers) * (f.recurrent_r_floats + f.recurrent_s_floats) * 4
    assert per_row == 149.625 * MiB
    # token_embd (Q4_K) stays on the host: 682 MiB
    assert round(f.host_bytes / MiB) == 682
    assert f.mtp_bytes > 0 and f.mtp_bytes == f.layer_bytes[64]
    assert f.tensor_bytes == sum(f.bytes_by_type.values())
    assert 15.0e9 < f.tensor_bytes < 17.5e9  # a Q4_K_M 27B


def test_header_only_the_sparse_data_is_never_needed(q27: Path) -> None:
    st = q27.stat()
    assert st.st_size > 16e9
    assert st.st_blocks * 512 < 64 * MiB  # sparse: the 16 GB of tensor data is a hole
    _meta, infos, data_offset, size = read_header(q27)
    assert size == st.st_size
    assert max(data_offset + t.offset + t.n_bytes for t in infos) <= size


def test_hybrid_moe_and_sliding_window_and_mla(tmp_path: Path) -> None:
    moe = read_facts(tiny_gguf.write_shape_only(tmp_path / "moe.gguf", "qwen3.6-35b-a3b"))
    assert moe.architecture == "qwen35moe" and moe.n_expert == 256
    assert moe.kv_layers == list(range(3, 40, 4)) and moe.n_layer_nextn == 1
    gem = read_facts(tiny_gguf.write_shape_only(tmp_path / "g.gguf", "gemma3-12b"))
    assert gem.sliding_window == 1024
    # five sliding-window layers, then one global one
    assert [i for i in gem.kv_layers if i not in gem.swa_layers] == list(range(5, 48, 6))
    ds = read_facts(tiny_gguf.write_shape_only(tmp_path / "d.gguf", "deepseek2-lite"))
    assert ds.is_mla and ds.kv_row_values(0) == (576, 0)


def test_truncated_file_names_the_file_and_what_to_do(tiny: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    data = tiny.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"cut\.gguf: truncated.*download it again"):
        read_facts(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:5000])  # inside the vocabulary arrays
    with pytest.raises(ConfigError, match=r"head\.gguf: the GGUF header is cut off"):
        read_facts(head)


def test_corrupt_header_is_a_config_error(tiny: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    data = bytearray(tiny.read_bytes())
    # the first key's value type sits after magic, version, counts and the key string
    key_len = struct.unpack_from("<Q", data, 24)[0]
    struct.pack_into("<I", data, 32 + key_len, 77)
    bad.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"bad\.gguf: corrupt GGUF header"):
        read_facts(bad)


def test_non_gguf_file(tmp_path: Path) -> None:
    txt = tmp_path / "model.gguf"
    txt.write_text("NAME=Debian\nVERSION=12\n" * 10)
    with pytest.raises(ConfigError, match=r"model\.gguf: not a GGUF file"):
        read_facts(txt)
    with pytest.raises(ConfigError, match="no such model file"):
        read_facts(tmp_path / "missing.gguf")


def test_unknown_architecture_is_a_marked_generic_estimate(tmp_path: Path) -> None:
    spec = tiny_gguf.tiny_spec("llama")
    spec.arch = "mysterynet"
    path = tiny_gguf.write_spec_shape_only(spec, tmp_path / "m.gguf")
    f = read_facts(path)
    assert f.generic and f.architecture == "mysterynet"
    assert any("mysterynet" in w and "estimate" in w for w in f.warnings)
    assert f.kv_layers == [0, 1]  # generic: every layer is full attention


def test_cli_plan_bad_file_is_one_sentence_and_exit_78(tmp_path: Path) -> None:
    txt = tmp_path / "notes.gguf"
    txt.write_text("hello\n")
    r = run_cli("plan", "--model", str(txt), "--gpu", "rtx4090")
    assert r.returncode == 78
    assert "not a GGUF file" in r.stderr and "Traceback" not in r.stderr


def test_split_models_count_every_shard(tmp_path: Path) -> None:
    from gguf import GGUFWriter

    whole = read_facts(tiny_gguf.write_tiny_random(tmp_path / "whole.gguf", arch="llama"))
    spec = tiny_gguf.tiny_spec("llama")
    first = tmp_path / "m-00001-of-00002.gguf"
    # the writer names shards STEM-0000i-of-0000n.gguf
    w = GGUFWriter(tmp_path / "m.gguf", "llama", split_max_tensors=len(spec.tensors) // 2 + 1)
    tiny_gguf._add_meta(w, "llama", spec.meta)
    tiny_gguf._add_tokenizer(w, spec.vocab, spec.n_vocab)
    for name, (arr, raw_dtype) in tiny_gguf._random_tensors(spec, 0):
        w.add_tensor(name, arr, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert (tmp_path / "m-00002-of-00002.gguf").is_file()
    f = read_facts(first)
    assert f.tensor_bytes == whole.tensor_bytes and f.layer_bytes == whole.layer_bytes
    second = read_facts(tmp_path / "m-00002-of-00002.gguf")  # any shard names the model
    assert second.tensor_bytes == whole.tensor_bytes and second.architecture == "llama"
    (tmp_path / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(ConfigError, match="missing m-00002-of-00002.gguf"):
        read_facts(first)
