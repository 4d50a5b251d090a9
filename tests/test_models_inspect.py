"""`models inspect` and `models list` on the demo model, gemma-3-270m and the shape-only 27B."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli_env, run_cli

NO_BUILD = "/nonexistent/build"


def no_binary_env(**extra: str) -> dict[str, str]:
    """No built llama-server: the KV types offered are every type the product knows."""
    env = cli_env(MTPWRAP_BUILD_DIR=NO_BUILD, **extra)
    env.pop("MTPWRAP_BINARY", None)
    return env


def inspect_json(model: Path | str, *args: str) -> dict[str, Any]:
    r = run_cli("models", "inspect", str(model), "--json", *args, env=no_binary_env())
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def by_type(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["type"]: r for r in info["kv"]}


def by_profile(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["profile"]: r for r in info["profiles"]}


@pytest.mark.integration
def test_demo_model(demo_model: Path) -> None:
    from gguf import GGUFReader

    info = inspect_json(demo_model, "--gpu", "rtx4090")
    # the counts against the gguf package's own reading of the file
    reader = GGUFReader(demo_model)
    assert info["parameters"] == sum(int(t.n_elements) for t in reader.tensors)
    tensors_by_type: dict[str, int] = {}
    for t in reader.tensors:
        tensors_by_type[t.tensor_type.name.lower()] = tensors_by_type.get(
            t.tensor_type.name.lower(), 0) + 1
    assert {k: v["tensors"] for k, v in info["quantisation"].items()} == tensors_by_type
    assert info["file_type"] == "q4_1" and info["architecture"] == "llama"
    assert info["mtp"] == {"present": False, "state": "no", "layers": 0, "tensors": 0,
                           "bytes": 0}
    assert info["chat_template"] is True
    assert (info["layers"], info["kv_heads"], info["head_size"]["k"]) == (30, [3], 64)
    kv = by_type(info)
    assert kv["q8_0"]["k"] and kv["q8_0"]["v"]
    assert not kv["tbq4_0"]["k"] and "K row (head size × KV heads) is 192" in \
        kv["tbq4_0"]["reason"]
    profiles = by_profile(info)
    assert profiles["cpu-demo"]["fits"] and profiles["cpu-demo"]["where"] == "host"
    # a GPU profile with MTP on a model without a head is refused by the planner's check
    assert not profiles["4090-262k"]["fits"]
    assert "no MTP (nextn) layers" in profiles["4090-262k"]["note"]
    assert "mtpwrap models graft" in profiles["4090-262k"]["note"]


def test_shape_only_qwen36_27b(shape_27b: Path) -> None:
    info = inspect_json(shape_27b, "--gpu", "rtx4090")
    assert info["architecture"] == "qwen35"
    assert info["mtp"]["present"] and info["mtp"]["layers"] == 1 and info["mtp"]["tensors"] > 0
    assert (info["layers"], info["blocks"], info["kv_layers"], info["recurrent_layers"]) == \
        (64, 65, 16, 48)
    assert info["kv_heads"] == [4] and info["head_size"]["k"] == 256
    assert info["context_trained"] == 262144
    assert math.isclose(info["parameters"] / 1e9, 27.3, abs_tol=0.3)
    assert by_type(info)["tbq4_0"]["k"]  # row 1024: a whole number of 128-value blocks
    profiles = by_profile(info)
    recipe = profiles["4090-262k"]
    assert recipe["fits"] and recipe["where"] == "gpu" and recipe["context"] == 262144
    assert recipe["headroom_gib"] > 0
    # an H100 profile's f16 KV at 262K does not fit a 4090: the note says what would
    h100 = profiles["h100-262k"]
    assert not h100["fits"] and h100["note"].startswith("largest context that fits: f16 ")
    assert "NVIDIA GeForce RTX 4090" in info["hardware"]


def test_without_a_gpu_the_gpu_profiles_are_named_not_planned(shape_27b: Path,
                                                               tmp_path: Path) -> None:
    replay = tmp_path / "cpu.json"
    replay.write_text(json.dumps({"gpus": [], "ram_total": 64 << 30,
                                  "ram_available": 32 << 30, "error": "no GPU"}))
    r = run_cli("models", "inspect", str(shape_27b), "--hw-replay", str(replay),
                env=no_binary_env(COLUMNS="250"))
    assert r.returncode == 0, r.stderr
    assert "MTP head: yes: 1 nextn layer(s)" in r.stdout
    assert "(they need a GPU): 3090-192k, 4090-128k-q8, 4090-262k" in r.stderr


@pytest.mark.integration
def test_the_kv_types_are_the_built_binarys(shape_27b: Path, llama_server_bin: Path) -> None:
    from mtpwrap.build.probe import probe

    r = run_cli("models", "inspect", str(shape_27b), "--json", "--binary",
                str(llama_server_bin), env=cli_env())
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    caps = probe(llama_server_bin)
    assert [row["type"] for row in info["kv"]] == list(caps.allowed("-ctk") or ())
    assert "llama-server (version " in info["kv_types_from"]


@pytest.mark.integration
def test_gemma_3_270m() -> None:
    from mtpwrap.models import known

    info = inspect_json(known.ensure(known.GEMMA), "--gpu", "rtx4090")
    assert info["architecture"] == "gemma3" and info["context_trained"] == 32768
    assert info["head_size"] == {"k": 256, "v": 256} and info["kv_heads"] == [1]
    assert (info["layers"], info["swa_layers"], info["sliding_window"]) == (18, 15, 512)
    assert info["mtp"]["state"] == "no" and info["chat_template"] is False
    kv = by_type(info)
    assert kv["tbq4_0"]["k"] and kv["tbq4_0"]["v"] and kv["q4_0"]["k"]
    assert by_profile(info)["cpu-demo"]["fits"]


def test_models_list_shows_the_mtp_column(tmp_path: Path) -> None:
    from mtpwrap.build import tiny_gguf

    models = tmp_path / "models"
    tiny_gguf.write_tiny_random(models / "with-head.gguf", "qwen35", mtp=True)
    tiny_gguf.write_tiny_random(models / "no-head.gguf", "qwen35", mtp=False)
    (models / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    r = run_cli("models", "list", "--json", env=cli_env(MTPWRAP_MODELS_DIR=str(models)))
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row["mtp"] for row in json.loads(r.stdout)}
    assert rows["with-head.gguf"] == "yes" and rows["no-head.gguf"] == "no"
    assert rows["broken.gguf"].startswith("unreadable: ")
