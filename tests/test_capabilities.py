"""Capabilities parsed from llama-server's --help and --version.

The recorded texts live in tests/data/help/ (see its README for where each came from); the
integration test checks the recorded upstream text against the live binary built from the
pinned source, so the recording cannot drift from what the tests claim.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.build.probe import outputs_capped, probe
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.errors import MissingToolError, RuntimeFailure

HELP = Path(__file__).parent / "data" / "help"
UPSTREAM_KV = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FORK_EXTRA_KV = ("tbq4_0", "tbq3_0", "planar3_0", "iso3_0", "planar4_0", "iso4_0")
REMOVED = ("--draft", "--draft-n", "--draft-max", "--draft-min")


def caps_of(name: str) -> Capabilities:
    return Capabilities.from_help((HELP / f"{name}.txt").read_text(),
                                  (HELP / f"{name}.version.txt").read_text())


@pytest.fixture(scope="module")
def upstream() -> Capabilities:
    return caps_of("upstream-0c1e570")


@pytest.fixture(scope="module")
def fork() -> Capabilities:
    return caps_of("fork-1c6e4ea")


def test_version_and_commit(upstream: Capabilities) -> None:
    assert upstream.version == "0.5.0-dev"
    assert upstream.build == 1
    assert upstream.commit == "0c1e570"
    assert upstream.built_with and "for" in upstream.built_with


@pytest.mark.parametrize("flag", [
    "--spec-draft-n-max", "--spec-draft-p-min", "-ctkd", "-ctvd", "--flash-attn", "-fa", "-np",
    "--parallel", "-ub", "--no-warmup", "--metrics", "-c", "-ngl", "-ctk", "-ctv", "--spec-type",
    "--host", "--port", "--api-key", "-m", "-md", "--load-mode",
])
def test_recipe_flags_exist_upstream(upstream: Capabilities, flag: str) -> None:
    assert upstream.has(flag)


def test_upstream_has_no_mlock_flag_but_load_mode_mlock(upstream: Capabilities,
                                                         fork: Capabilities) -> None:
    assert not upstream.has("--mlock")
    assert "mlock" in (upstream.allowed("--load-mode") or ())
    assert fork.has("--mlock")


def test_removed_flags_are_listed_but_not_accepted(upstream: Capabilities) -> None:
    for flag in REMOVED:
        assert flag in upstream.options
        assert upstream.is_removed(flag)
        assert not upstream.has(flag)


def test_allowed_values(upstream: Capabilities, fork: Capabilities) -> None:
    assert upstream.allowed("-ctk") == UPSTREAM_KV
    assert upstream.allowed("--cache-type-v") == UPSTREAM_KV
    assert upstream.allowed("-ctkd") == UPSTREAM_KV
    assert upstream.allowed("--flash-attn") == ("on", "off", "auto")
    spec = upstream.allowed("--spec-type") or ()
    assert "draft-mtp" in spec and "mtp" not in spec and "ngram-mod" in spec
    for flag in ("-ctk", "-ctv", "-ctkd", "-ctvd"):
        assert fork.allowed(flag) == UPSTREAM_KV + FORK_EXTRA_KV
    fork_spec = fork.allowed("--spec-type") or ()
    assert "mtp" in fork_spec and "draft-mtp" in fork_spec


def test_env_names_and_defaults(upstream: Capabilities) -> None:
    assert upstream.env_for("--api-key") == "LLAMA_API_KEY"
    assert upstream.env_for("-ctk") == "LLAMA_ARG_CACHE_TYPE_K"
    assert upstream.env_for("--cache-type-k") == "LLAMA_ARG_CACHE_TYPE_K"
    assert upstream.env_for("-np") == "LLAMA_ARG_N_PARALLEL"
    assert upstream.default("-ctk") == "f16"
    assert upstream.default("--flash-attn") == "auto"


def test_spellings_share_one_option(upstream: Capabilities) -> None:
    assert upstream.option("-ctk") is upstream.option("--cache-type-k")
    info = upstream.option("--spec-draft-model")
    assert info is not None and "-md" in info.names
    kvo = upstream.option("--no-kv-offload")
    assert kvo is not None and "-kvo" in kvo.names and "-nkvo" in kvo.names


def test_fork_differs_from_upstream_exactly_as_documented(upstream: Capabilities,
                                                          fork: Capabilities) -> None:
    """The fork's recorded text is upstream's plus the differences its README lists."""
    assert fork.options - upstream.options == {"--mlock"}
    assert upstream.options - fork.options == set()
    changed = {f for f in upstream.options
               if upstream.allowed(f) != fork.allowed(f) or upstream.env_for(f) != fork.env_for(f)}
    spellings = {n for f in ("-ctk", "-ctv", "-ctkd", "-ctvd", "--spec-type")
                 for n in (upstream.option(f).names if upstream.option(f) else ())}
    assert changed == spellings


def test_every_option_parsed_has_names_and_no_stray_text(upstream: Capabilities) -> None:
    assert len(upstream.infos) > 150
    for info in upstream.infos:
        assert info.names and all(n.startswith("-") for n in info.names)
        assert "(env:" not in (info.value_hint or "")


def test_to_dict_round_trip(fork: Capabilities) -> None:
    data = json.loads(json.dumps(fork.to_dict()))
    again = Capabilities.from_dict(data)
    assert again.options == fork.options
    assert again.allowed("-ctk") == fork.allowed("-ctk")
    assert again.env_for("--api-key") == "LLAMA_API_KEY"
    assert again.is_removed("--draft-max") and not again.has("--draft-max")
    assert (again.version, again.commit) == (fork.version, fork.commit)


def test_parser_handles_long_heads_and_hints() -> None:
    text = (
        "----- common params -----\n\n"
        "-x,    --example-with-a-very-long-name-indeed VALUE\n"
        + " " * 40 + "help on the next line\n"
        + " " * 40 + "(env: LLAMA_ARG_EXAMPLE)\n"
        "-sm,   --split-mode {none,layer,row}     how to split\n"
        "--poll <0...100>                        polling level (default: 50)\n"
        "-ts,   --tensor-split N0,N1,N2,...       fractions\n"
    )
    caps = Capabilities.from_help(text, "")
    assert caps.env_for("--example-with-a-very-long-name-indeed") == "LLAMA_ARG_EXAMPLE"
    assert caps.allowed("-sm") == ("none", "layer", "row")
    assert caps.allowed("--poll") is None and caps.default("--poll") == "50"
    assert caps.allowed("-ts") is None
    assert caps.option("-x") is not None and caps.option("-x").section == "common params"


# ---------------------------------------------------------------- probe


def _runner(results: dict[str, Any]) -> Any:
    def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        r = results[cmd[1]]
        if isinstance(r, BaseException):
            raise r
        return r
    return run


def _fake_binary(tmp_path: Path) -> Path:
    p = tmp_path / "llama-server"
    p.write_text("#!/bin/sh\n")
    p.chmod(0o755)
    return p


def test_probe_missing_binary(tmp_path: Path) -> None:
    with pytest.raises(MissingToolError, match="does not exist"):
        probe(tmp_path / "nope")


def test_probe_timeout_and_failure(tmp_path: Path) -> None:
    exe = _fake_binary(tmp_path)
    hang = _runner({"--help": subprocess.TimeoutExpired([str(exe)], 1)})
    with pytest.raises(RuntimeFailure, match="did not finish"):
        probe(exe, timeout=1, runner=hang)
    fail = _runner({"--help": subprocess.CompletedProcess([], 1, "", "error: libggml.so: cannot "
                                                                    "open shared object file")})
    with pytest.raises(RuntimeFailure, match="exited with code 1: error: libggml.so"):
        probe(exe, runner=fail)


def test_probe_real_timeout(tmp_path: Path) -> None:
    """A binary that hangs on --help is cut off by the timeout, not waited for."""
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexec sleep 30\n")
    exe.chmod(0o755)
    with pytest.raises(RuntimeFailure, match="did not finish within 0.5 s"):
        probe(exe, timeout=0.5)


def test_probe_not_a_llama_server(tmp_path: Path) -> None:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\necho hello\n")
    exe.chmod(0o755)
    with pytest.raises(RuntimeFailure, match="listed no options"):
        probe(exe)


@pytest.mark.integration
def test_live_binary_matches_recorded_upstream_help(llama_server_bin: Path,
                                                    upstream: Capabilities) -> None:
    live = probe(llama_server_bin)
    assert live.binary == str(llama_server_bin)
    assert live.commit == upstream.commit == "0c1e570"
    assert live.options == upstream.options
    for flag in ("-ctk", "-ctv", "-ctkd", "-ctvd", "--spec-type", "--flash-attn", "--load-mode"):
        assert live.allowed(flag) == upstream.allowed(flag), flag
    assert live.env_for("--api-key") == "LLAMA_API_KEY"
    assert live.is_removed("--draft-max")
    # upstream 0c1e570 caps the logits rows a context reserves (n_outputs_max)
    assert live.outputs_capped is True


def test_outputs_cap_is_read_from_the_binary_or_its_libllama(tmp_path: Path) -> None:
    """A binary holding llama_context's n_outputs_max_per_seq log text caps its logits rows; a
    shared build keeps that text in the libllama beside it; without it (the fork at 0bc0a27)
    a whole ubatch is reserved."""
    plain = tmp_path / "static" / "llama-server"
    plain.parent.mkdir()
    plain.write_bytes(b"\x7fELF" + b"\0" * 64 + b"n_outputs_max         = %u\n")
    assert outputs_capped(plain) is False  # n_outputs_max alone: the fork has the variable
    plain.write_bytes(b"\x7fELF" + b"\0" * 64 + b"%s: n_outputs_max_per_seq = %u\n")
    assert outputs_capped(plain) is True
    shared = tmp_path / "shared" / "bin" / "llama-server"
    shared.parent.mkdir(parents=True)
    shared.write_bytes(b"\x7fELF")
    assert outputs_capped(shared) is False
    (tmp_path / "shared" / "lib").mkdir()
    (tmp_path / "shared" / "lib" / "libllama.so").write_bytes(b"n_outputs_max_per_seq = %u")
    assert outputs_capped(shared) is True
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert outputs_capped(empty) is False


def test_outputs_cap_survives_the_manifest_round_trip(fork: Capabilities) -> None:
    d = fork.to_dict() | {"outputs_capped": False}
    assert Capabilities.from_dict(d).outputs_capped is False
    assert Capabilities.from_dict({"options": []}).outputs_capped is None
