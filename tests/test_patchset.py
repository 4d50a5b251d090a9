"""The llama.cpp patch set: it applies to the pinned offline source, never writes to the shared
tree, names the file and hunk of a patch that does not apply, and keys the build cache."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from mtpwrap.build import patchset, planning, source
from mtpwrap.errors import BuildError, ConfigError


@pytest.fixture(scope="module")
def offline_tree() -> Path:
    return source.offline_source().path


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


NAMES = ["0001-per-request-speculative", "0002-checkpoint-every-n-tokens",
         "0003-draft-context-checkpoint-size", "0004-slot-checkpoint-sidecar",
         "0005-slot-checkpoint-sidecar-fork", "0006-per-request-speculative-fork"]
#: the patches for the pinned upstream source; 0005 and 0006 are for the fork in the submodule
UPSTREAM = NAMES[:4]


def _diff(p: patchset.Patch) -> str:
    text = p.path.read_text()
    return text[text.index("diff --git"):]


def test_each_patch_has_a_header_and_touches_files() -> None:
    patches = patchset.available()
    assert [p.name for p in patches] == NAMES
    for p in patches:
        text = p.path.read_text()
        assert text.startswith(f"# mtpwrap patch {p.name[:4]}: ")
        for part in ("Why:", "How to drop it:", "What it changes", "For:", "Without it:",
                     "Fork base:" if p.name not in UPSTREAM
                     else "Upstream base:"):
            assert part in text, f"{p.name}: header lacks {part!r}"
    assert "tools/server/server-schema.cpp" in patches[0].files
    assert patches[1].files == ("common/arg.cpp", "common/common.h", "tools/server/README.md",
                                "tools/server/server-context.cpp")
    assert patches[2].files == patches[3].files == patches[4].files == (
        "tools/server/server-context.cpp",)


def test_the_checkpoint_patches_are_shaped_for_upstream() -> None:
    """Periodic checkpoints behind a flag of their own (the fork's spelling), upstream's
    --checkpoint-min-step keeping its meaning; the sidecar's format versioned and named
    neutrally, bound to the slot file's tokens."""
    _, every, draft, sidecar, fork, _ = patchset.available()
    added = "\n".join(ln for ln in _diff(every).splitlines() if ln.startswith("+"))
    assert '{"-cpent", "--checkpoint-every-n-tokens"}' in added
    assert '.set_env("LLAMA_ARG_CHECKPOINT_EVERY_NT")' in added
    assert "checkpoint_every_nt = -1;" in added  # off unless asked for
    for p in (every, draft, sidecar):  # upstream's minimum spacing is read, never redefined
        removed = [ln for ln in _diff(p).splitlines() if ln.startswith("-") and
                   not ln.startswith("---")]
        assert not any("checkpoint-min-step" in ln or "checkpoint_min_step =" in ln
                       for ln in removed), p.name
    assert "COMMON_CONTEXT_SEQ_RM_TYPE_PART" in _diff(draft)
    for code in (_diff(sidecar), _diff(fork)):  # one format on both sources
        assert "{'L', 'L', 'C', 'K', 'P', 'T'}" in code and "SLOT_SIDECAR_VERSION    = 1" in code
        assert "slot_sidecar_hash" in code and "params_base.n_ctx_checkpoints" in code
    for p in patchset.available():
        assert "mtpwrap" not in _diff(p).lower() and "MTPW" not in _diff(p), p.name


@pytest.mark.integration
def test_patch_set_applies_to_the_pinned_offline_source(offline_tree: Path,
                                                        tmp_path: Path) -> None:
    applied = [p for p in patchset.select()[0] if p.name in UPSTREAM]
    touched = {f: _sha(offline_tree / f) for p in applied for f in p.files}
    out = patchset.overlay(offline_tree, tmp_path / "patched", applied)
    schema = (out / "tools/server/server-schema.cpp").read_text()
    assert 'field_num("speculative.n_max", params.spec_n_max)' in schema
    assert "spec_n_max" in (out / "tools/server/server-task.h").read_text()
    assert "--checkpoint-every-n-tokens" in (out / "common/arg.cpp").read_text()
    server = (out / "tools/server/server-context.cpp").read_text()
    assert "every_due" in server and "ctx_dft_seq_rm_type != COMMON_CONTEXT_SEQ_RM_TYPE_PART" \
        in server and "slot_sidecar_load" in server
    for rel, sha in touched.items():  # the shared tree is as it was
        assert _sha(offline_tree / rel) == sha
        assert _sha(out / rel) != sha
    untouched = out / "CMakeLists.txt"
    assert untouched.stat().st_ino == (offline_tree / "CMakeLists.txt").stat().st_ino


@pytest.mark.integration
def test_a_patch_that_does_not_apply_names_file_and_hunk(offline_tree: Path,
                                                         tmp_path: Path) -> None:
    good = patchset.available()[0]
    bad_dir = tmp_path / "patches"
    bad_dir.mkdir()
    text = good.path.read_text().replace(
        "         ->set_desc(\"Minimum speculative decoding probability for draft tokens "
        "(0 = greedy)\"));",
        "         ->set_desc(\"a line upstream never had\"));")
    assert text != good.path.read_text()
    (bad_dir / good.path.name).write_text(text)
    bad = patchset.available(bad_dir)[0]
    with pytest.raises(BuildError, match=r"0001-per-request-speculative does not apply .*"
                       r"tools/server/server-schema.cpp hunk #1") as info:
        patchset.overlay(offline_tree, tmp_path / "out", [bad])
    assert "--skip-patch 0001" in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
@pytest.mark.parametrize("left_out", UPSTREAM)
def test_each_patch_can_be_left_out(left_out: str, offline_tree: Path, tmp_path: Path) -> None:
    """One purpose per patch: with any one opted out, the others still apply."""
    applied, out = patchset.select(skip=(left_out[:4],))
    assert [p.name for p in out] == [left_out] and len(applied) == len(NAMES) - 1
    patchset.overlay(offline_tree, tmp_path / "patched",
                     [p for p in applied if p.name in UPSTREAM])


def test_opting_out() -> None:
    applied, out = patchset.select(skip=("0001",))
    assert [p.name for p in applied] == NAMES[1:]
    assert [p.name for p in out] == ["0001-per-request-speculative"]
    applied, out = patchset.select(no_patches=True)
    assert applied == [] and len(out) == len(NAMES)
    with pytest.raises(ConfigError, match=r"--skip-patch 0009: no such patch"):
        patchset.select(skip=("0009",))


def test_cache_key_holds_the_patches_content() -> None:
    opts = {"GGML_NATIVE": "OFF"}
    plain = planning.cache_key("offline:x", opts, "c++ 12")
    one = planning.cache_key("offline:x", opts, "c++ 12", [["0001-a", "aa"]])
    other = planning.cache_key("offline:x", opts, "c++ 12", [["0001-a", "bb"]])
    assert len({plain, one, other}) == 3
    assert planning.cache_key("offline:x", opts, "c++ 12", []) == plain


def test_each_patch_says_which_sources_it_is_for() -> None:
    speculative, every, draft, sidecar, fork, fork_speculative = patchset.available()
    assert "per-request draft depth unsupported" in speculative.without
    assert "lacks --checkpoint-every-n-tokens" in every.without
    assert "MTP context's whole KV" in draft.without
    assert "re-reads the whole document" in sidecar.without
    for patch in (speculative, every, draft, sidecar):
        assert patch.sources == (f"offline@{source.OFFLINE_COMMIT}",)
        assert patch.meant_for("offline", source.OFFLINE_COMMIT)
        assert not patch.meant_for("submodule", source.SUBMODULE_COMMIT)
        assert not patch.meant_for("offline", "1234567")  # another upstream commit
    for patch in (fork, fork_speculative):
        assert patch.sources == (f"submodule@{source.SUBMODULE_COMMIT[:7]}",)
        assert patch.meant_for("submodule", source.SUBMODULE_COMMIT)
        assert not patch.meant_for("offline", source.OFFLINE_COMMIT)
    assert "re-reads the whole document" in fork.without
    assert "per-request draft depth unsupported" in fork_speculative.without


def test_a_patch_not_for_the_source_is_recorded_not_tried() -> None:
    applied, records = patchset.for_source("submodule", source.SUBMODULE_COMMIT)
    assert [p.name for p in applied] == NAMES[4:] and len(records) == len(NAMES)
    rec = records[0]
    assert [r["status"] for r in records] == ["not-for-source"] * 4 + ["applied"] * 2
    assert rec["why"] == (f"written for offline@{source.OFFLINE_COMMIT}; this build's source is "
                          f"the submodule at {source.SUBMODULE_COMMIT[:12]}")
    assert rec["without"] and "policy is off" in rec["without"]
    applied, records = patchset.for_source("offline", source.OFFLINE_COMMIT)
    assert [p.name for p in applied] == UPSTREAM
    assert [r["status"] for r in records] == ["applied"] * 4 + ["not-for-source"] * 2
    assert [r["name"] for r in records] == NAMES
    # opting out still wins, and a PATH tree is built as it is
    assert [r["status"] for r in patchset.for_source("offline", source.OFFLINE_COMMIT,
                                                     skip=("0003",))[1]] == [
        "applied", "applied", "opted-out", "applied", "not-for-source", "not-for-source"]
    applied, records = patchset.for_source("path", None)
    assert applied == [] and records[0]["why"] == "a --source PATH tree is built as it is"


def test_a_patch_with_no_for_line_is_for_every_pinned_source(tmp_path: Path) -> None:
    patch = patchset.available()[0]
    text = "".join(line for line in patch.path.read_text().splitlines(keepends=True)
                   if not line.startswith("# For:"))
    (tmp_path / patch.path.name).write_text(text)
    (anywhere,) = patchset.available(tmp_path)
    assert anywhere.sources == () and anywhere.meant_for("submodule", "abc")


def test_the_header_is_not_part_of_the_cache_key(tmp_path: Path) -> None:
    patch = patchset.available()[0]
    (tmp_path / patch.path.name).write_text("# a new first line of prose\n"
                                            + patch.path.read_text())
    (reworded,) = patchset.available(tmp_path)
    assert reworded.sha256 != patch.sha256
    assert patchset.key_part([reworded]) == patchset.key_part([patch])
