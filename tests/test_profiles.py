"""Profiles: the shipped files, validation errors with file and key path, search path, selection."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mtpwrap.decide import hardware, profiles
from mtpwrap.errors import EXIT_CONFIG, ConfigError
from mtpwrap.units import GiB
from tests.helpers import cli_env, run_cli

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTS = REPO / "tests" / "data" / "snapshots"
SHIPPED = ["cpu-demo", "4090-262k", "4090-128k-q8", "3090-192k", "5090-262k", "h100-262k",
           "h200-262k"]

GOOD = """\
description: test profile
hardware:
  gpu_name: RTX 4090
  min_memory_gib: 22
model: m.gguf
context: 262144
kv:
  k: [tbq4_0, q4_0]
  v: [tbq4_0, q4_0]
spec:
  kind: mtp
  depth: 3
gpu_layers: 99
ubatch: 32
slots: 1
flash_attn: "on"
mlock: true
no_warmup: true
"""


def snap(name: str) -> hardware.HardwareSnapshot:
    return hardware.load_snapshot(SNAPSHOTS / f"{name}.json")


def write(tmp_path: Path, text: str, name: str = "bad") -> Path:
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    p = d / f"{name}.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def replace(line: str, new: str | None) -> str:
    """GOOD with one line replaced (or removed when new is None)."""
    lines = GOOD.splitlines()
    i = next(n for n, x in enumerate(lines) if x.startswith(line))
    if new is None:
        del lines[i]
    else:
        lines[i] = new
    return "\n".join(lines) + "\n"


def test_shipped_profiles_all_load() -> None:
    names = [p.name for p in profiles.list_profiles(profiles.shipped_dirs())]
    assert sorted(names) == sorted(SHIPPED)


def test_good_fixture_is_valid(tmp_path: Path) -> None:
    p = profiles.load_file(write(tmp_path, GOOD, "good"))
    assert p.kv.k == ("tbq4_0", "q4_0") and p.spec.depth == 3 and p.flash_attn == "on"


# Each case: the document, the key path the error must name, and a fragment of what it expects.
MALFORMED = [
    ("unknown top key", GOOD + "contxt: 4096\n", "contxt", "unknown key"),
    ("unknown nested key", replace("  depth:", "  depht: 3"), "spec.depht",
     "unknown key. Did you mean 'depth'?"),
    ("slots as text", replace("slots:", "slots: '2'"), "slots",
     "expected an integer 1..256, got '2'."),
    ("adapt out of range", replace("  depth:", "  depth: 3\n  adapt: {probe_share: 2}"),
     "spec.adapt.probe_share", "expected a number 0..1, got 2."),
    ("policy depth out of range", replace("  depth:", "  depth: 3\n  policy: {code: 9}"),
     "spec.policy.code", "expected an integer 0..8, got 9."),
    ("policy p_min out of range",
     replace("  depth:", "  depth: 3\n  policy: {code: {depth: 2, p_min: -1}}"),
     "spec.policy.code.p_min", "expected a number 0..1, got -1."),
    ("requires_gpu as text", replace("hardware:", "hardware:\n  requires_gpu: 'no'"),
     "hardware.requires_gpu", "expected true or false, got 'no'."),
    ("depth out of range", replace("  depth:", "  depth: 12"), "spec.depth",
     "expected an integer 1..8, got 12."),
    ("depth wrong type", replace("  depth:", "  depth: three"), "spec.depth",
     "expected an integer 1..8"),
    ("spec kind unknown", replace("  kind:", "  kind: eagle"), "spec.kind", "mtp, draft, ngram"),
    ("kv type unknown", replace("  k: [", "  k: [tbq5_0]"), "kv.k[0]", "must be one of"),
    ("kv list empty", replace("  v: [", "  v: []"), "kv.v", "list of them"),
    ("context negative", replace("context:", "context: -5"), "context", "must be 256.."),
    ("context wrong text", replace("context:", "context: huge"), "context", "\"max\""),
    ("slots zero", replace("slots:", "slots: 0"), "slots", "expected an integer 1..256, got 0."),
    ("ubatch above batch", GOOD + "batch: 16\n", "ubatch", "must not exceed batch (16)"),
    ("flash_attn bad", replace("flash_attn:", "flash_attn: maybe"), "flash_attn", "on, off, auto"),
    ("mlock not bool", replace("mlock:", "mlock: yes please"), "mlock", "true or false"),
    ("missing model", replace("model:", None), "model", "missing"),
    ("hardware not mapping", replace("hardware:", "hardware: 4090")
     .replace("  gpu_name: RTX 4090\n  min_memory_gib: 22\n", ""), "hardware",
     "expected a mapping"),
    ("gpu_name bad regex", replace("  gpu_name:", "  gpu_name: 'RTX (4090'"), "hardware.gpu_name",
     "regular expression"),
    ("min memory negative", replace("  min_memory_gib:", "  min_memory_gib: -1"),
     "hardware.min_memory_gib", "expected a number 0.5..4096, got -1."),
    ("mtp without depth", replace("  depth:", None), "spec.depth", "missing"),
    ("draft without model", replace("  kind:", "  kind: draft"), "spec.draft_model", "missing"),
    ("extra_args not list", GOOD + "extra_args: --foo\n", "extra_args", "list of arguments"),
    ("name mismatch", "name: other\n" + GOOD, "name", "must match the file name 'bad'"),
    ("p_min above one", replace("  depth:", "  depth: 3\n  p_min: 1.5"), "spec.p_min",
     "expected a number 0..1, got 1.5."),
    ("description multi-line", replace("description:", "description: |\n  one\n  two"),
     "description", "one line"),
    ("supervisor not mapping", GOOD + "supervisor: [1, 2]\n", "supervisor", "expected a mapping"),
    ("gpu_layers bad text", replace("gpu_layers:", "gpu_layers: most"), "gpu_layers",
     "0..999, all or auto, got 'most'"),
]


@pytest.mark.parametrize("case,doc,key,expect", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_profile_names_file_and_key(tmp_path: Path, case: str, doc: str, key: str,
                                              expect: str) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(ConfigError) as info:
        profiles.load_file(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: {key}: "), msg
    assert expect in msg, msg
    assert "\n" not in msg


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "description: x\nmodel: m.gguf\ncontext: [4096\nslots: 1\n")
    with pytest.raises(ConfigError) as info:
        profiles.load_file(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:") and "YAML syntax error" in msg
    line = int(msg[len(str(path)) + 1:].split(":")[0])
    assert line in (3, 4)  # the unclosed list opens on line 3; PyYAML notices on line 4


def test_empty_and_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the file is empty"):
        profiles.load_file(write(tmp_path, "", "empty"))
    with pytest.raises(ConfigError, match="expected a mapping of profile keys"):
        profiles.load_file(write(tmp_path, "- a\n- b\n", "list"))


def test_yaml_on_off_booleans_become_flash_attn_words(tmp_path: Path) -> None:
    p = profiles.load_file(write(tmp_path, replace("flash_attn:", "flash_attn: on"), "onoff"))
    assert p.flash_attn == "on"
    p = profiles.load_file(write(tmp_path, replace("flash_attn:", "flash_attn: off"), "onoff"))
    assert p.flash_attn == "off"


def test_free_sections_are_kept_for_their_owners(tmp_path: Path) -> None:
    doc = GOOD + "supervisor:\n  oom_step_down: true\nproxy:\n  max_body_bytes: 8\n"
    p = profiles.load_file(write(tmp_path, doc, "free"))
    assert p.supervisor == {"oom_step_down": True} and p.proxy == {"max_body_bytes": 8}
    # checked with the settings' table, as the config file is
    with pytest.raises(ConfigError, match=r"typo.yaml: proxy.max_body_mb: unknown key"):
        profiles.load_file(write(tmp_path, doc.replace("max_body_bytes", "max_body_mb"), "typo"))
    with pytest.raises(ConfigError, match=r"supervisor.wedge_s: expected a number of seconds"):
        profiles.load_file(write(tmp_path, doc.replace("oom_step_down: true", "wedge_s: -1"),
                                 "neg"))


def test_context_max_and_single_kv_type_string(tmp_path: Path) -> None:
    doc = replace("context:", "context: max").replace("  k: [tbq4_0, q4_0]", "  k: q8_0")
    p = profiles.load_file(write(tmp_path, doc, "maxctx"))
    assert p.context == "max" and p.kv.k == ("q8_0",)


def test_user_profile_overrides_shipped_by_name(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = tmp_path / "xdg"
    user_dir = xdg / "mtpwrap" / "profiles"
    user_dir.mkdir(parents=True)
    (user_dir / "cpu-demo.yaml").write_text(
        "description: my demo\nhardware:\n  requires_gpu: false\nmodel: demo\ncontext: 2048\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    p = profiles.load_profile("cpu-demo")
    assert p.description == "my demo" and p.context == 2048
    assert p.source == str(user_dir / "cpu-demo.yaml")
    # the other shipped profiles are still found
    assert profiles.load_profile("4090-262k").context == 262144
    names = [q.name for q in profiles.list_profiles()]
    assert names.count("cpu-demo") == 1 and "h200-262k" in names


def test_profiles_path_env_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = tmp_path / "site"
    d.mkdir()
    (d / "4090-262k.yaml").write_text(GOOD.replace("context: 262144", "context: 65536"))
    monkeypatch.setenv("MTPWRAP_PROFILES_PATH", str(d))
    assert profiles.load_profile("4090-262k").context == 65536


def test_unknown_profile_lists_available() -> None:
    with pytest.raises(ConfigError) as info:
        profiles.load_profile("4090-999k")
    assert "4090-999k" in str(info.value) and "4090-262k" in str(info.value)


def test_load_by_path(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD, "bypath")
    assert profiles.load_profile(str(path)).name == "bypath"


# ---------------------------------------------------------------- selection

SELECT = [
    ("rtx4090", "4090-262k"),
    ("rtx3090", "3090-192k"),
    ("rtx5090", "5090-262k"),
    ("h100", "h100-262k"),
    ("h200", "h200-262k"),
    ("two-rtx3090", "3090-192k"),
    ("none", "cpu-demo"),
]


@pytest.mark.parametrize("snapshot_name,expected", SELECT)
def test_select_profile_for_each_snapshot(snapshot_name: str, expected: str) -> None:
    shipped = profiles.list_profiles(profiles.shipped_dirs())
    chosen, reason = profiles.select_profile(snap(snapshot_name), shipped)
    assert chosen.name == expected
    assert reason


def test_select_reason_explains_the_choice() -> None:
    shipped = profiles.list_profiles(profiles.shipped_dirs())
    chosen, reason = profiles.select_profile(snap("rtx4090"), shipped)
    assert "RTX 4090" in reason and "4090-128k-q8" in reason
    _, reason = profiles.select_profile(snap("none"), shipped)
    assert "NVML library" in reason and "cpu-demo" in reason


def test_select_with_no_match_lists_candidates() -> None:
    gpu_only = [p for p in profiles.list_profiles(profiles.shipped_dirs())
                if p.hardware.requires_gpu]
    with pytest.raises(ConfigError) as info:
        profiles.select_profile(snap("none"), gpu_only)
    msg = str(info.value)
    assert "no profile matches" in msg and "4090-262k (GPU /RTX 4090/ >= 22 GiB)" in msg
    assert "--profile NAME" in msg


def test_too_little_memory_does_not_match() -> None:
    small = hardware.HardwareSnapshot(gpus=(hardware.GpuInfo(
        index=0, name="NVIDIA GeForce RTX 4090 D", memory_total=16 * GiB),))
    shipped = profiles.list_profiles(profiles.shipped_dirs())
    chosen, reason = profiles.select_profile(small, shipped)
    assert chosen.name == "cpu-demo" and "no GPU profile matches" in reason


# ---------------------------------------------------------------- CLI


def test_cli_profiles_list_json() -> None:
    r = run_cli("profiles", "list", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert sorted(x["name"] for x in rows) == sorted(SHIPPED)
    demo = next(x for x in rows if x["name"] == "cpu-demo")
    assert demo["speculation"] == "none" and demo["context"] == 4096


def test_cli_profiles_show_json() -> None:
    r = run_cli("profiles", "show", "4090-262k", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["spec"]["kind"] == "mtp" and data["kv"]["k"] == ["tbq4_0", "q4_0"]


def test_cli_malformed_profile_is_one_line_exit_78(tmp_path: Path) -> None:
    path = write(tmp_path, replace("  depth:", "  depth: 12"), "broken")
    r = run_cli("profiles", "show", str(path), env=cli_env())
    assert r.returncode == EXIT_CONFIG
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "spec.depth: expected an integer 1..8, got 12." in lines[0]
    assert str(path) in lines[0]
