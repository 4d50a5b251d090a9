"""The llama-server command line: every shipped profile × recorded snapshots × {upstream, fork}.

The argv for each (profile, binary) pair is pinned below; the snapshot decides only whether the
profile can run here (a GPU profile on a machine without a GPU is refused) and whether a
"meant for other hardware" warning is given. The integration test starts the real llama-server
with the argv built for cpu-demo.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.decide import choice, hardware, ladder, launch, profile_types, profiles
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.decide.hardware import HardwareSnapshot
from mtpwrap.errors import ConfigError
from mtpwrap.proc import running_server

DATA = Path(__file__).parent / "data"
SNAPSHOT_NAMES = ["rtx4090", "rtx3090", "rtx5090", "h100", "h200", "two-rtx3090", "none"]
MODEL = "/models/M.gguf"
EXE = "/opt/llama/bin/llama-server"
PORT = 18081


def caps_of(name: str) -> Capabilities:
    version = DATA / "help" / f"{name}.version.txt"  # none was recorded with fork-0bc0a27
    return Capabilities.from_help((DATA / "help" / f"{name}.txt").read_text(),
                                  version.read_text() if version.is_file() else "")


#: upstream 0c1e570; the fork's successor 1c6e4ea (offers mtp and draft-mtp); the fork at
#: 0bc0a27 as built here (offers mtp only)
CAPS = {"upstream": caps_of("upstream-0c1e570"), "fork": caps_of("fork-1c6e4ea"),
        "fork-0bc0a27": caps_of("fork-0bc0a27")}
SHIPPED = {p.name: p for p in profiles.list_profiles(profiles.shipped_dirs())}
SNAPS = {n: hardware.load_snapshot(DATA / "snapshots" / f"{n}.json") for n in SNAPSHOT_NAMES}

HEAD = [EXE, "-m", MODEL, "--host", "127.0.0.1", "--port", str(PORT)]
QWEN_TAIL = ["--no-warmup", "--metrics", "--no-webui"]

#: (profile, binary) → argv after HEAD. Reviewed by hand against docs/facts.md §1 and the --help
#: texts.
PINNED: dict[tuple[str, str], list[str]] = {
    ("cpu-demo", "upstream"): ["-c", "4096", "-ngl", "0", "-np", "2", "-t", "1", "-ctk", "f16",
                               "-ctv", "f16", "--flash-attn", "auto", "--metrics", "--no-webui"],
    # 4090-262k leaves the ubatch to the memory plan (resolve), which this table precedes
    ("4090-262k", "fork"): ["-c", "262144", "-ngl", "99", "-np", "1",
                            "-ctk", "tbq4_0", "-ctv", "tbq4_0", "--flash-attn", "on",
                            "--spec-type", "mtp", "--spec-draft-n-max", "3",
                            "-ctkd", "tbq4_0", "-ctvd", "tbq4_0", "--mlock", *QWEN_TAIL],
    ("4090-262k", "upstream"): ["-c", "262144", "-ngl", "99", "-np", "1",
                                "-ctk", "q4_0", "-ctv", "q4_0", "--flash-attn", "on",
                                "--spec-type", "draft-mtp", "--spec-draft-n-max", "3",
                                "-ctkd", "f16", "-ctvd", "f16",
                                "--load-mode", "mlock", *QWEN_TAIL],
    ("4090-128k-q8", "upstream"): ["-c", "131072", "-ngl", "99", "-np", "1", "-ub", "32",
                                   "-ctk", "q8_0", "-ctv", "q8_0", "--flash-attn", "on",
                                   "--spec-type", "draft-mtp", "--spec-draft-n-max", "3",
                                   "-ctkd", "q8_0", "-ctvd", "q8_0",
                                   "--load-mode", "mlock", *QWEN_TAIL],
    ("4090-128k-q8", "fork"): ["-c", "131072", "-ngl", "99", "-np", "1", "-ub", "32",
                               "-ctk", "q8_0", "-ctv", "q8_0", "--flash-attn", "on",
                               "--spec-type", "mtp", "--spec-draft-n-max", "3",
                               "-ctkd", "q8_0", "-ctvd", "q8_0", "--mlock", *QWEN_TAIL],
    ("3090-192k", "fork"): ["-c", "196608", "-ngl", "99", "-np", "1", "-ub", "64",
                            "-ctk", "tbq4_0", "-ctv", "tbq4_0", "--flash-attn", "on",
                            "--spec-type", "mtp", "--spec-draft-n-max", "3",
                            "-ctkd", "q8_0", "-ctvd", "q8_0", "--mlock", *QWEN_TAIL],
    ("3090-192k", "upstream"): ["-c", "196608", "-ngl", "99", "-np", "1", "-ub", "64",
                                "-ctk", "q4_0", "-ctv", "q4_0", "--flash-attn", "on",
                                "--spec-type", "draft-mtp", "--spec-draft-n-max", "3",
                                "-ctkd", "q8_0", "-ctvd", "q8_0",
                                "--load-mode", "mlock", *QWEN_TAIL],
    ("5090-262k", "fork"): ["-c", "262144", "-ngl", "99", "-np", "1", "-ub", "128",
                            "-ctk", "q8_0", "-ctv", "q8_0", "--flash-attn", "on",
                            "--spec-type", "mtp", "--spec-draft-n-max", "3",
                            "-ctkd", "q8_0", "-ctvd", "q8_0", "--mlock", *QWEN_TAIL],
    ("5090-262k", "upstream"): ["-c", "262144", "-ngl", "99", "-np", "1", "-ub", "128",
                                "-ctk", "q8_0", "-ctv", "q8_0", "--flash-attn", "on",
                                "--spec-type", "draft-mtp", "--spec-draft-n-max", "3",
                                "-ctkd", "q8_0", "-ctvd", "q8_0",
                                "--load-mode", "mlock", *QWEN_TAIL],
    ("h100-262k", "fork"): ["-c", "262144", "-ngl", "99", "-np", "1", "-b", "2048", "-ub", "512",
                            "-ctk", "f16", "-ctv", "f16", "--flash-attn", "on",
                            "--spec-type", "mtp", "--spec-draft-n-max", "3", *QWEN_TAIL],
    ("h100-262k", "upstream"): ["-c", "262144", "-ngl", "99", "-np", "1", "-b", "2048",
                                "-ub", "512", "-ctk", "f16", "-ctv", "f16", "--flash-attn", "on",
                                "--spec-type", "draft-mtp", "--spec-draft-n-max", "3",
                                *QWEN_TAIL],
    ("h200-262k", "fork"): ["-c", "262144", "-ngl", "99", "-np", "1", "-b", "2048", "-ub", "512",
                            "-ctk", "f16", "-ctv", "f16", "--flash-attn", "on",
                            "--spec-type", "mtp", "--spec-draft-n-max", "4", *QWEN_TAIL],
    ("h200-262k", "upstream"): ["-c", "262144", "-ngl", "99", "-np", "1", "-b", "2048",
                                "-ub", "512", "-ctk", "f16", "-ctv", "f16", "--flash-attn", "on",
                                "--spec-type", "draft-mtp", "--spec-draft-n-max", "4",
                                *QWEN_TAIL],
}
PINNED[("cpu-demo", "fork")] = PINNED[("cpu-demo", "upstream")]
# The fork as built here (0bc0a27) spells every flag of these profiles as its successor does
# (its own mtp, --mlock, -ctkd/-ctvd), so each argv is the same.
for _name in SHIPPED:
    PINNED[(_name, "fork-0bc0a27")] = PINNED[(_name, "fork")]

#: warnings each (profile, binary) gives whatever the machine, as fragments.
PINNED_WARNINGS: dict[tuple[str, str], list[str]] = {
    ("4090-262k", "upstream"): ["K KV type tbq4_0 is not offered", "V KV type tbq4_0 is not "
                                "offered", "no 'mtp' spec type; using its 'draft-mtp'",
                                "draft K KV type tbq4_0 is not offered",
                                "draft V KV type tbq4_0 is not offered"],
    ("3090-192k", "upstream"): ["K KV type tbq4_0 is not offered", "V KV type tbq4_0 is not "
                                "offered", "no 'mtp' spec type; using its 'draft-mtp'"],
}
for _p in SHIPPED.values():
    if _p.spec.kind == "mtp":
        PINNED_WARNINGS.setdefault((_p.name, "upstream"), ["no 'mtp' spec type"])


CASES = [(p, c, s) for p in sorted(SHIPPED) for c in CAPS for s in SNAPSHOT_NAMES]


def spec_of(prof: profile_types.Profile, caps: Capabilities, snap: HardwareSnapshot | None, *,
            model: str | Path = MODEL, port: int | None = None, api_key: str | None = None,
            extra: list[str] | None = None, draft_model: str | Path | None = None,
            binary: str | None = None) -> launch.ChildCommand:
    """choose() then render(): what `up` does for a profile before any plan."""
    cfg = choice.choose(prof, caps, snap, model=model, draft_model=draft_model)
    return launch.render(cfg, caps, binary=binary, port=port, api_key=api_key,
                         extra=extra or [])


def build(profile: str, caps: str, snap: str | None, **kw: Any) -> launch.ChildCommand:
    return spec_of(SHIPPED[profile], CAPS[caps], SNAPS[snap] if snap else None, port=PORT,
                   binary=EXE, **kw)


def test_every_pair_is_pinned() -> None:
    assert set(PINNED) == {(p, c) for p in SHIPPED for c in CAPS}


@pytest.mark.parametrize("profile,caps,snap", CASES)
def test_argv_table(profile: str, caps: str, snap: str) -> None:
    prof = SHIPPED[profile]
    s = SNAPS[snap]
    if prof.hardware.requires_gpu and not s.has_gpu:
        with pytest.raises(ConfigError) as info:
            build(profile, caps, snap)
        assert f"profile {profile} needs a GPU" in str(info.value)
        assert "NVML library" in str(info.value)
        return
    spec = build(profile, caps, snap)
    assert spec.argv == HEAD + PINNED[(profile, caps)]
    mismatch = prof.hardware.requires_gpu and not any(prof.hardware.matches(g) for g in s.gpus)
    assert any("is meant for" in w for w in spec.warnings) == mismatch
    expected = PINNED_WARNINGS.get((profile, caps), [])
    for fragment in expected:
        assert any(fragment in w for w in spec.warnings), (fragment, spec.warnings)
    other = [w for w in spec.warnings if "is meant for" not in w]
    assert len(other) == len(expected), other
    # every emitted flag is one this binary accepts, and none is a removed one
    for arg in spec.argv[1:]:
        if arg.startswith("-") and not arg[1:].isdigit():
            assert CAPS[caps].has(arg), arg
    assert not {"--draft", "--draft-n", "--draft-max", "--draft-min"} & set(spec.argv)


def test_recipe_flags_against_fork() -> None:
    """docs/facts.md §1: --spec-type mtp --spec-draft-n-max 3 -ctk tbq4_0 -ctv tbq4_0
    --flash-attn on -np 1 -ub 32 --mlock --no-warmup -c 262144 -ngl 99."""
    argv = build("4090-262k", "fork", "rtx4090").argv
    pairs = {(a, b) for a, b in zip(argv, argv[1:], strict=False)}
    for pair in [("--spec-type", "mtp"), ("--spec-draft-n-max", "3"), ("-ctk", "tbq4_0"),
                 ("-ctv", "tbq4_0"), ("--flash-attn", "on"), ("-np", "1"),
                 ("-c", "262144"), ("-ngl", "99")]:
        assert pair in pairs, pair
    # -ub 32 is the memory plan's choice on the recorded 4090 (tests/test_resolve.py)
    assert "-ub" not in argv
    assert "--mlock" in argv and "--no-warmup" in argv
    spec = build("4090-262k", "fork", "rtx4090")
    assert spec.warnings == []


def test_upstream_falls_back_with_reasons() -> None:
    spec = build("4090-262k", "upstream", "rtx4090")
    kv_warn = [w for w in spec.warnings if "tbq4_0" in w]
    assert len(kv_warn) == 4  # K, V, and the MTP context's K and V
    assert "-ctk allows f32, f16, bf16, q8_0, q4_0" in kv_warn[0]
    assert "falling back to q4_0" in kv_warn[0]
    reasons = {d.flag: d.reason for d in spec.decisions}
    assert "this build names it draft-mtp" in reasons["--spec-type"]
    assert "spells it --load-mode" in reasons["--load-mode"]


def test_decisions_explain_every_flag() -> None:
    spec = build("4090-262k", "fork", "rtx4090")
    flags = [a for a in spec.argv[1:] if a.startswith("-")]
    assert [d.flag for d in spec.decisions] == flags
    assert all(d.reason for d in spec.decisions)
    by_flag = {d.flag: d for d in spec.decisions}
    assert "one slot" in by_flag["-np"].reason
    assert by_flag["--metrics"].value is None


def test_mtp_forces_one_slot_and_quantized_v_forces_flash_attention(tmp_path: Path) -> None:
    src = (profiles.shipped_dirs()[1] / "4090-262k.yaml").read_text()
    doc = src.replace("slots: 1", "slots: 4").replace('flash_attn: "on"', "flash_attn: \"off\"")
    path = tmp_path / "t.yaml"
    path.write_text(doc)
    prof = profiles.load_file(path)
    spec = spec_of(prof, CAPS["upstream"], SNAPS["rtx4090"])
    argv = spec.argv
    assert argv[argv.index("-np") + 1] == "1"
    assert argv[argv.index("--flash-attn") + 1] == "on"
    assert any("4 slots" in w for w in spec.warnings)
    assert any("quantized V cache (q4_0) needs it" in w for w in spec.warnings)


def test_api_key_goes_to_environment_never_argv() -> None:
    secret = "s3cr3t-internal-key"
    spec = build("cpu-demo", "upstream", "none", api_key=secret)
    assert secret not in " ".join(spec.argv)
    assert "--api-key" not in spec.argv
    assert spec.env == {"LLAMA_API_KEY": secret}
    shown = spec.to_dict()
    assert shown["env"] == {"LLAMA_API_KEY": "***"} and secret not in str(shown)


def test_slot_save_path_is_rendered_with_the_launch(tmp_path: Path) -> None:
    cfg = choice.choose(SHIPPED["cpu-demo"], CAPS["upstream"], None, model=MODEL)
    spec = launch.render(cfg, CAPS["upstream"], port=PORT, slot_save_path=tmp_path / "kv")
    assert spec.argv[spec.argv.index("--slot-save-path") + 1] == str(tmp_path / "kv")
    assert any(d.flag == "--slot-save-path" and "persist.dir" in d.reason
               for d in spec.decisions)
    assert "--slot-save-path" not in launch.render(cfg, CAPS["upstream"], port=PORT).argv
    # llama-fit-params serves nothing: no snapshot directory either
    assert "--slot-save-path" not in launch.render(cfg, CAPS["upstream"], serve=False,
                                                   slot_save_path=tmp_path).argv


def test_context_max_without_a_plan_is_the_trained_length(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text((profiles.shipped_dirs()[1] / "h200-262k.yaml").read_text()
                    .replace("context: 262144", "context: max"))
    prof = profiles.load_file(path)
    unplanned = spec_of(prof, CAPS["fork"], SNAPS["h200"])
    assert unplanned.argv[unplanned.argv.index("-c") + 1] == "0"
    assert "no memory plan" in next(d.reason for d in unplanned.decisions if d.flag == "-c")


def test_missing_flag_names_flag_and_binary() -> None:
    help_text = (DATA / "help" / "upstream-0c1e570.txt").read_text()
    # a build from before speculative decoding was configurable: no --spec-type at all
    lines = help_text.splitlines()
    i = next(n for n, x in enumerate(lines) if x.startswith("--spec-type"))
    j = i + 1
    while lines[j].startswith(" "):
        j += 1
    old = Capabilities.from_help("\n".join(lines[:i] + lines[j:]),
                                 (DATA / "help" / "upstream-0c1e570.version.txt").read_text(),
                                 binary="/srv/old/llama-server")
    with pytest.raises(ConfigError) as info:
        spec_of(SHIPPED["4090-262k"], old, SNAPS["rtx4090"])
    msg = str(info.value)
    assert msg.startswith("--spec-type: /srv/old/llama-server (version 0.5.0-dev, commit 0c1e570)")
    assert "does not accept it" in msg


def test_no_acceptable_kv_type_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tbq.yaml"
    path.write_text((profiles.shipped_dirs()[1] / "4090-262k.yaml").read_text()
                    .replace("k: [tbq4_0, q4_0]", "k: [tbq4_0, tbq3_0]"))
    with pytest.raises(ConfigError, match=r"-ctk: .* offers none of the profile's K KV types "
                                          r"\(tbq4_0, tbq3_0\)"):
        spec_of(profiles.load_file(path), CAPS["upstream"], SNAPS["rtx4090"])


@pytest.mark.parametrize("extra,match", [
    (["--draft-max", "4"], "has been removed"),
    (["--host", "0.0.0.0"], "--host is set by mtpwrap"),
    (["--api-key=abc"], "--api-key is set by mtpwrap"),
    (["--no-such-flag"], "does not accept --no-such-flag"),
])
def test_extra_args_are_checked(extra: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build("cpu-demo", "upstream", "none", extra=extra)


def test_extra_args_pass_through_when_known() -> None:
    spec = build("cpu-demo", "upstream", "none", extra=["--ctx-checkpoints", "0", "-lv", "2"])
    assert spec.argv[-4:] == ["--ctx-checkpoints", "0", "-lv", "2"]
    assert not spec.warnings


@pytest.mark.parametrize("extra", [["-v"], ["--verbose"], ["--log-verbose"], ["-lv", "4"],
                                   ["--verbosity=5"], ["--log-verbosity", "99"]])
def test_verbose_logging_needs_log_prompts(extra: list[str]) -> None:
    with pytest.raises(ConfigError, match="writes prompts and answers to the logs") as err:
        build("cpu-demo", "upstream", "none", extra=extra)
    assert "log_prompts: true" in (err.value.hint or "")
    prof = dataclasses.replace(SHIPPED["cpu-demo"], log_prompts=True)
    spec = spec_of(prof, CAPS["upstream"], None, extra=extra)
    assert spec.argv[-len(extra):] == extra
    assert any("prompts and answers are logged" in w for w in spec.warnings)


def test_rpc_needs_allow_rpc_and_warns() -> None:
    with pytest.raises(ConfigError, match="--rpc .* no authentication") as err:
        build("cpu-demo", "upstream", "none", extra=["--rpc", "10.0.0.5:50052"])
    assert "allow_rpc: true" in (err.value.hint or "")
    prof = dataclasses.replace(SHIPPED["cpu-demo"], allow_rpc=True,
                               extra_args=("--rpc", "10.0.0.5:50052"))
    spec = spec_of(prof, CAPS["upstream"], None)
    assert spec.argv[-2:] == ["--rpc", "10.0.0.5:50052"]
    assert any("--rpc 10.0.0.5:50052" in w and "private network" in w for w in spec.warnings)


def test_profile_opt_ins_are_validated(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    base = (profiles.shipped_dirs()[1] / "cpu-demo.yaml").read_text()
    path.write_text(base + "log_prompts: yes please\n")
    with pytest.raises(ConfigError, match="log_prompts: expected true or false"):
        profiles.load_file(path)
    path.write_text(base + "allow_rpc: true\nlog_prompts: true\n")
    prof = profiles.load_file(path)
    assert prof.allow_rpc and prof.log_prompts


# ---------------------------------------------------------------- real llama-server


@pytest.mark.integration
def test_cpu_demo_argv_starts_real_llama_server(llama_server_bin: Path, demo_model: Path,
                                                free_port: int, tmp_path: Path) -> None:
    import httpx
    import openai

    from mtpwrap.build.probe import probe

    caps = probe(llama_server_bin)
    key = "internal-" + os.urandom(8).hex()
    spec = spec_of(SHIPPED["cpu-demo"], caps, SNAPS["none"], model=demo_model, port=free_port,
                   api_key=key)
    assert spec.argv[0] == str(llama_server_bin)
    base = f"http://127.0.0.1:{free_port}"
    with running_server(spec.argv, base_url=base, env=spec.env, log_path=tmp_path / "server.log",
                        timeout=120) as srv:
        proc = srv.proc
        # the key is not in the process list
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline
        # ... but the server took it from the environment: no key, no completion
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # open path
        denied = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                            json={"messages": [{"role": "user", "content": "hi"}]})
        assert denied.status_code == 401
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key)
        out = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8, temperature=0)
        assert out.choices[0].message.content
        assert out.usage is not None and out.usage.completion_tokens > 0
        # two slots and --metrics as the argv asked
        auth = {"Authorization": f"Bearer {key}"}
        props = httpx.get(f"{base}/props", timeout=10, headers=auth).json()
        assert props.get("total_slots") == 2
        metrics = httpx.get(f"{base}/metrics", timeout=10, headers=auth)
        assert metrics.status_code == 200 and "llamacpp:tokens_predicted_total" in metrics.text


# ---------------------------------------------------------------- `mtpwrap args`


def _recorded_binary(tmp_path: Path, name: str) -> Path:
    """A stand-in that prints a recorded --help/--version (the fork cannot be built here)."""
    exe = tmp_path / "llama-server"
    help_file = DATA / "help" / f"{name}.txt"
    version_file = DATA / "help" / f"{name}.version.txt"
    version = f'cat "{version_file}"' if version_file.is_file() else "true"
    exe.write_text("#!/bin/sh\n"
                   f'case "$1" in --help) cat "{help_file}";; --version) {version};;'
                   " *) exit 1;; esac\n")
    exe.chmod(0o755)
    return exe


def test_cli_args_json_for_the_recipe(tmp_path: Path) -> None:
    import json

    from tests.helpers import run_cli

    exe = _recorded_binary(tmp_path, "fork-1c6e4ea")
    r = run_cli("args", "--profile", "auto", "--binary", str(exe), "--model", MODEL,
                "--replay", str(DATA / "snapshots" / "rtx4090.json"), "--port", str(PORT),
                "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["profile"] == "4090-262k"
    # the binary binds UNIX sockets: `args` shows the socket `up` uses, and no port
    sock = str(Path(os.environ["MTPWRAP_HOME"]) / "run" / "llama.sock")
    # /models/M.gguf is not here, so no plan chooses the ubatch: the smallest, 32
    pinned = PINNED[("4090-262k", "fork")]
    at = pinned.index("-np") + 2
    assert out["argv"] == [str(exe), "-m", MODEL, "--host", sock,
                           *pinned[:at], "-ub", "32", *pinned[at:]]
    assert "RTX 4090" in out["profile_reason"]
    # the only warning: /models/M.gguf does not exist here, so it is shown as given
    assert len(out["warnings"]) == 1 and "no such model file" in out["warnings"][0]
    assert {d["flag"] for d in out["decisions"]} >= {"--spec-type", "-ctk", "--flash-attn"}


def test_cli_args_text_shows_reasons_and_warnings(tmp_path: Path) -> None:
    from tests.helpers import run_cli

    exe = _recorded_binary(tmp_path, "upstream-0c1e570")
    r = run_cli("args", "--profile", "4090-262k", "--binary", str(exe), "--model", MODEL,
                "--replay", str(DATA / "snapshots" / "rtx4090.json"))
    assert r.returncode == 0, r.stderr
    assert "-ctk q4_0 -ctv q4_0 --flash-attn on --spec-type draft-mtp" in r.stdout
    assert "MTP speculation drafts for a single sequence" in r.stdout
    assert "K KV type tbq4_0 is not offered" in r.stderr


def test_cli_args_gpu_profile_without_gpu_is_exit_78(tmp_path: Path) -> None:
    from mtpwrap.errors import EXIT_CONFIG
    from tests.helpers import run_cli

    exe = _recorded_binary(tmp_path, "fork-1c6e4ea")
    r = run_cli("args", "--profile", "4090-262k", "--binary", str(exe), "--model", MODEL,
                "--replay", str(DATA / "snapshots" / "none.json"))
    assert r.returncode == EXIT_CONFIG
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "profile 4090-262k needs a GPU" in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_cli_args_auto_on_this_machine(llama_server_bin: Path, demo_model: Path) -> None:
    import json

    from tests.helpers import cli_env, run_cli

    r = run_cli("args", "--binary", str(llama_server_bin), "--json",
                env=cli_env(MTPWRAP_DEMO_MODEL=str(demo_model)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["profile"] == "cpu-demo"  # no GPU on the test machine
    assert out["argv"][:3] == [str(llama_server_bin), "-m", str(demo_model)]
    assert "commit 0c1e570" in out["binary"]


# ---------------------------------------------------------------- draft model and n-gram

DRAFT_DEMO = """\
description: demo model drafting for itself
hardware:
  requires_gpu: false
model: demo
context: 2048
kv: {k: [f16], v: [f16]}
spec:
  kind: draft
  depth: 3
  p_min: 0.5
  draft_model: demo
  draft_kv: {k: [q8_0], v: [q8_0]}
slots: 1
threads: 1
"""


def _profile(tmp_path: Path, name: str, text: str) -> profile_types.Profile:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return profiles.load_file(path)


def test_draft_and_ngram_mapping(tmp_path: Path) -> None:
    prof = _profile(tmp_path, "draft-demo", DRAFT_DEMO)
    spec = spec_of(prof, CAPS["upstream"], SNAPS["none"], draft_model="/models/D.gguf")
    argv = spec.argv
    tail = argv[argv.index("--spec-type"):]
    assert tail == ["--spec-type", "draft-simple", "--spec-draft-n-max", "3",
                    "--spec-draft-p-min", "0.5", "-md", "/models/D.gguf",
                    "-ctkd", "q8_0", "-ctvd", "q8_0", "--metrics", "--no-webui"]
    ngram = _profile(tmp_path, "ngram-demo", DRAFT_DEMO.replace("kind: draft", "kind: ngram")
                     .replace("  draft_model: demo\n", "").replace(
                         "  draft_kv: {k: [q8_0], v: [q8_0]}\n", ""))
    argv = spec_of(ngram, CAPS["fork"], SNAPS["none"]).argv
    assert argv[argv.index("--spec-type"):] == ["--spec-type", "ngram-simple",
                                                "--spec-ngram-simple-size-m", "3",
                                                "--spec-draft-p-min", "0.5", "--metrics",
                                                "--no-webui"]


@pytest.mark.integration
def test_draft_profile_drafts_on_real_llama_server(llama_server_bin: Path, demo_model: Path,
                                                   free_port: int, tmp_path: Path) -> None:
    """The draft mapping is accepted by the real binary and drafting really happens: the demo
    model drafting for itself (docs/facts.md §2 saw acceptance 1.0 this way)."""
    import httpx

    from mtpwrap.build.probe import probe

    prof = _profile(tmp_path, "draft-demo", DRAFT_DEMO)
    spec = spec_of(prof, probe(llama_server_bin), None, model=demo_model,
                   draft_model=demo_model, port=free_port)
    base = f"http://127.0.0.1:{free_port}"
    with running_server(spec.argv, base_url=base, env=spec.env, log_path=tmp_path / "server.log",
                        timeout=120):
        # short: on a loaded 2-core machine this model can drop below 1 token/s
        r = httpx.post(f"{base}/completion", timeout=300, json={
            "prompt": "Count from one to twenty: one, two, three,", "n_predict": 8,
            "temperature": 0, "seed": 1})
        assert r.status_code == 200
        timings = r.json()["timings"]
        assert timings.get("draft_n", 0) > 0, timings
        assert timings.get("draft_n_accepted", 0) > 0, timings


# ---------------------------------------------------------------- step-down ladder

#: bytes per 256 values, as `mtpwrap build` measures them from the fork (4.125 and 3.125 bits)
FORK_SIZES = {"tbq4_0": {"block": 256, "bytes": 132}, "tbq3_0": {"block": 256, "bytes": 100}}


def _rungs(prof: profile_types.Profile, caps: str, sizes: dict[str, Any] | None = None
           ) -> list[launch.LaunchConfig]:
    cfg = choice.choose(prof, CAPS[caps], SNAPS["rtx4090"], model=MODEL)
    return ladder.ladder(cfg, CAPS[caps], sizes)


def test_step_down_never_picks_a_bigger_kv_type() -> None:
    """tbq4_0 is 4.125 bits per value and q4_0 4.5: stepping from one to the other costs
    memory. With the fork's measured sizes the only smaller rung is tbq3_0."""
    rungs = _rungs(SHIPPED["4090-262k"], "fork", FORK_SIZES)
    notes = [r.note for r in rungs]
    assert notes[0] == "step-down 1: draft depth 1"
    assert notes[1] == "step-down 2: draft depth 1, no speculation"
    assert rungs[2].cache_k == rungs[2].cache_v == "tbq3_0"
    assert all(r.cache_k != "q4_0" for r in rungs)
    assert [r.context for r in rungs[3:]] == [131072, 65536, 32768, 16384, 8192, 4096]
    for a, b in zip(rungs, rungs[1:], strict=False):  # every rung saves something
        assert a != b
    # without measured sizes the built-in table sizes the fork's types the same way
    assert _rungs(SHIPPED["4090-262k"], "fork") == rungs
    # a type with no size anywhere cannot be shown to shrink: no KV rung below it
    odd = choice.choose(SHIPPED["4090-262k"], CAPS["fork"], SNAPS["rtx4090"], model=MODEL)
    odd = odd.replace(cache_k="tbqp4_0", cache_v="tbqp4_0")
    assert all(r.cache_k == "tbqp4_0" for r in ladder.ladder(odd, CAPS["fork"]))


def test_step_down_without_speculation_drops_the_draft_model(tmp_path: Path) -> None:
    prof = _profile(tmp_path, "draft-demo", DRAFT_DEMO)
    cfg = choice.choose(prof, CAPS["upstream"], SNAPS["none"], model=MODEL,
                        draft_model="/models/D.gguf")
    off = next(r for r in ladder.ladder(cfg, CAPS["upstream"]) if r.spec == "none")
    argv = launch.render(off, CAPS["upstream"], port=PORT).argv
    for flag in ("--spec-type", "-md", "-ctkd", "-ctvd", "--spec-draft-n-max",
                 "--spec-draft-p-min"):
        assert flag not in argv
    # f16 steps down through q8_0 to q4_0 on upstream (no fork types offered)
    kv = [r.cache_k for r in ladder.ladder(cfg, CAPS["upstream"]) if r.spec == "none"]
    assert kv == ["f16", "q8_0", "q4_0"]  # context 2048 is below the floor: no halving
    assert ladder.step_down(cfg, 0) is cfg
    assert ladder.step_down(cfg, 99) is None


# --------------------------------------------------------------------------- the model's KV


def _shape_facts(tmp_path: Path, which: str) -> Any:
    """The header of a shape-only GGUF with the attention shape of a real model: SmolLM2-135M
    (the demo model: 3 KV heads of 64, rows of 192) or gemma-3-270m (1 KV head of 256)."""
    from mtpwrap.build import tiny_gguf
    from mtpwrap.decide.gguf_facts import read_facts

    if which == "smollm2":
        spec = tiny_gguf._llama_spec(name="SmolLM2-135M", n_embd=576, n_layer=30, n_head=9,
                                     n_head_kv=3, n_ff=1536, n_ctx=8192, ftype="q4_0",
                                     tied=True)
    else:
        spec = tiny_gguf._gemma3_spec(name="gemma-3-270m", n_embd=640, n_layer=18, n_head=4,
                                      n_head_kv=1, head_dim=256, n_ff=2048, n_ctx=32768,
                                      window=512, ftype="q4_0")
    return read_facts(tiny_gguf.write_spec_shape_only(spec, tmp_path / f"{which}.gguf"))


def _kv_profile(tmp_path: Path, k: str, v: str) -> profile_types.Profile:
    path = tmp_path / "kv-demo.yaml"
    path.write_text((profiles.shipped_dirs()[1] / "cpu-demo.yaml").read_text()
                    + f"kv:\n  k: [{k}]\n  v: [{v}]\n")
    return profiles.load_file(path)


@pytest.mark.parametrize("caps", ["fork", "fork-0bc0a27"])
def test_kv_choice_asks_the_model(tmp_path: Path, caps: str) -> None:
    prof = _kv_profile(tmp_path, "tbq4_0, q4_0", "tbq4_0, q4_0")
    demo = choice.choose(prof, CAPS[caps], None, model=MODEL,
                         facts=_shape_facts(tmp_path, "smollm2"))
    assert (demo.cache_k, demo.cache_v) == ("q4_0", "q4_0")
    assert "192" in demo.reason("cache_k") and "not a multiple" in demo.reason("cache_k")
    assert any("tbq4_0" in w and "192" in w and "using q4_0" in w for w in demo.warnings)
    gemma = choice.choose(prof, CAPS[caps], None, model=MODEL,
                          facts=_shape_facts(tmp_path, "gemma"))
    assert (gemma.cache_k, gemma.cache_v) == ("tbq4_0", "tbq4_0")
    assert "the model admits" in gemma.reason("cache_k")
    # without the header (a preview of a model not fetched) the binary alone decides
    assert choice.choose(prof, CAPS[caps], None, model=MODEL).cache_k == "tbq4_0"


def test_no_kv_type_the_model_admits_is_one_sentence(tmp_path: Path) -> None:
    prof = _kv_profile(tmp_path, "tbq4_0, tbq3_0", "tbq4_0")
    with pytest.raises(ConfigError) as info:
        choice.choose(prof, CAPS["fork"], None, model=MODEL,
                      facts=_shape_facts(tmp_path, "smollm2"))
    msg = info.value.message
    assert msg.startswith("K KV types tbq4_0, tbq3_0: the model admits none of them")
    assert msg.count(". ") == 0 and msg.endswith(".") and "192" in msg
    assert "q4_0" in (info.value.hint or "")


def test_tbq3_v_sets_the_fork_switch_in_the_environment(tmp_path: Path) -> None:
    prof = _kv_profile(tmp_path, "tbq4_0", "tbq3_0")
    cfg = choice.choose(prof, CAPS["fork-0bc0a27"], None, model=MODEL,
                        facts=_shape_facts(tmp_path, "gemma"))
    spec = launch.render(cfg, CAPS["fork-0bc0a27"], port=PORT)
    assert spec.env == {"LLAMA_ALLOW_TBQ3_KV": "1"}
    assert spec.argv[spec.argv.index("-ctv") + 1] == "tbq3_0"
    said = [d for d in spec.decisions if d.flag == "LLAMA_ALLOW_TBQ3_KV=1"]
    assert said and "environment" in said[0].reason
    # tbq3_0 for K only: no switch
    k_only = choice.choose(_kv_profile(tmp_path, "tbq3_0", "tbq4_0"), CAPS["fork"], None,
                           model=MODEL, facts=_shape_facts(tmp_path, "gemma"))
    assert launch.render(k_only, CAPS["fork"], port=PORT).env == {}


@pytest.mark.parametrize("extra", [["--tools", "all"], ["--tools-runtime", "docker"],
                                   ["--agent"], ["-ag"], ["--mcp-servers-config", "m.json"],
                                   ["--ui-mcp-proxy"], ["--webui-mcp-proxy"]])
def test_tool_flags_need_allow_tools(extra: list[str]) -> None:
    assert CAPS["upstream"].has(extra[0])  # upstream's recorded help has every one of them
    with pytest.raises(ConfigError, match="act on this machine") as err:
        build("cpu-demo", "upstream", "none", extra=extra)
    assert "allow_tools: true" in (err.value.hint or "")
    prof = dataclasses.replace(SHIPPED["cpu-demo"], allow_tools=True, extra_args=tuple(extra))
    spec = spec_of(prof, CAPS["upstream"], None)
    assert spec.argv[-len(extra):] == extra
    assert any("shell and file access" in w for w in spec.warnings)


def test_tools_in_a_profile_file_are_refused_unless_opted_in(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    base = (profiles.shipped_dirs()[1] / "cpu-demo.yaml").read_text()
    path.write_text(base + 'extra_args: ["--tools", "all"]\n')
    with pytest.raises(ConfigError, match="--tools lets the model act on this machine"):
        choice.choose(profiles.load_file(path), CAPS["fork-0bc0a27"], None, model=MODEL)
    path.write_text(base + 'extra_args: ["--tools", "all"]\nallow_tools: true\n')
    cfg = choice.choose(profiles.load_file(path), CAPS["fork-0bc0a27"], None, model=MODEL)
    assert cfg.allow_tools and any("--tools" in w for w in cfg.warnings)


def test_the_recipe_trade_is_named(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text((profiles.shipped_dirs()[1] / "4090-262k.yaml").read_text()
                    .replace("  depth: 3\n", "  depth: 3\n  policy:\n    code: 3\n"
                             "    en-prose: 1\n", 1))
    prof = profiles.load_file(path)
    fork = choice.choose(prof, CAPS["fork-0bc0a27"], SNAPS["rtx4090"], model=MODEL)
    up = choice.choose(prof, CAPS["upstream"], SNAPS["rtx4090"], model=MODEL)
    fork_note = [w for w in fork.warnings if "no one llama-server gives both" in w]
    up_note = [w for w in up.warnings if "no one llama-server gives both" in w]
    assert fork_note and "takes the fork's: TBQ KV and one fixed depth" in fork_note[0]
    assert up_note and "takes upstream's: per-class depth" in up_note[0]
    plain_recipe = choice.choose(SHIPPED["4090-262k"], CAPS["fork"], SNAPS["rtx4090"],
                                 model=MODEL)
    assert not any("gives both" in w for w in plain_recipe.warnings)


def test_step_down_takes_only_types_the_model_admits(tmp_path: Path) -> None:
    prof = _kv_profile(tmp_path, "f16", "f16")
    facts = _shape_facts(tmp_path, "smollm2")
    cfg = choice.choose(prof, CAPS["fork"], None, model=MODEL, facts=facts)
    kv_rungs = [r.cache_k for r in ladder.ladder(cfg, CAPS["fork"], facts=facts)
                if r.note and "KV" in r.note]
    assert kv_rungs and not any(t.startswith("tbq") for t in kv_rungs)
    unasked = [r.cache_k for r in ladder.ladder(cfg, CAPS["fork"])]
    assert "tbq4_0" in unasked  # without the header, the fork's types are rungs too


def _without(help_name: str, flag_line_start: str) -> Capabilities:
    """A recorded help text with one option's block removed."""
    lines = (DATA / "help" / f"{help_name}.txt").read_text().splitlines()
    i = next(n for n, x in enumerate(lines) if x.startswith(flag_line_start))
    j = i + 1
    while lines[j].startswith(" "):
        j += 1
    return Capabilities.from_help("\n".join(lines[:i] + lines[j:]), "")


def test_fit_params_rendering_leaves_out_what_it_lacks_and_names_it() -> None:
    """The fork's llama-fit-params rejects --spec-type: its command line leaves the speculation
    flags out and says so; a memory flag it lacks is still refused."""
    cfg = choice.choose(SHIPPED["4090-262k"], CAPS["fork-0bc0a27"], SNAPS["rtx4090"], model=MODEL)
    fit_caps = _without("fork-0bc0a27", "--spec-type")
    spec = launch.render(cfg, fit_caps, serve=False)
    assert spec.dropped == ["--spec-type mtp"]
    for flag in ("--spec-type", "--spec-draft-n-max", "-ctkd", "--port", "--metrics"):
        assert flag not in spec.argv
    assert spec.argv[spec.argv.index("-ctk") + 1] == "tbq4_0"
    no_mlock = _without("fork-0bc0a27", "--mlock")
    assert launch.render(cfg, no_mlock, serve=False).dropped == ["--mlock"]
    with pytest.raises(ConfigError, match="--spec-type"):
        launch.render(cfg, fit_caps)  # llama-server itself: refused, never dropped
    with pytest.raises(ConfigError, match="-ub"):
        launch.render(cfg.replace(ubatch=32), _without("fork-0bc0a27", "-ub,"), serve=False)


@pytest.mark.integration
def test_the_demo_model_takes_q4_0_from_a_tbq_list(demo_model: Path, tmp_path: Path) -> None:
    """The real demo model's header (SmolLM2-135M: rows of 192) against the fork as built
    here: tbq4_0 would crash llama-server at context creation, q4_0 serves."""
    from mtpwrap.decide.gguf_facts import read_facts

    prof = _kv_profile(tmp_path, "tbq4_0, q4_0", "tbq4_0, q4_0")
    cfg = choice.choose(prof, CAPS["fork-0bc0a27"], None, model=demo_model,
                        facts=read_facts(demo_model))
    assert (cfg.cache_k, cfg.cache_v) == ("q4_0", "q4_0")
    assert f"{demo_model.name}'s K row (head size × KV heads) is 192" in cfg.reason("cache_k")


def test_the_web_ui_stays_off_unless_the_front_serves_it() -> None:
    """--no-webui is passed unless proxy.enable_paths lists webui (the front's setting could
    never work otherwise)."""
    prof, caps = SHIPPED["cpu-demo"], CAPS["upstream"]
    cfg = choice.choose(prof, caps, None, model=MODEL)
    off = launch.render(cfg, caps, binary=EXE, port=PORT)
    on = launch.render(cfg, caps, binary=EXE, port=PORT, webui=True)
    assert "--no-webui" in off.argv and "--no-webui" not in on.argv
    assert [a for a in off.argv if a != "--no-webui"] == on.argv
