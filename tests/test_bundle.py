"""The offline bundle without the network: its checks (every file against SHA256SUMS, the
signature, the target), its SBOM against CycloneDX's own schema, and refusals that leave
nothing half-made or half-installed. The whole path, made from the real pieces and installed in
a network namespace with no network, is tests/test_bundle_real.py."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mtpwrap import paths
from mtpwrap.build import patchset
from mtpwrap.bundle import check, create, install, sbom
from mtpwrap.errors import ConfigError, IntegrityError
from tests.helpers import require_tool, run_cli

HERE_PY = "{}.{}".format(*sys.version_info[:2])
HERE_TARGET = create.Target(python=HERE_PY,
                            platforms=(f"manylinux_2_17_{platform.machine()}",))


def small_bundle(root: Path, sign_key: Path | None = None) -> Path:
    """A bundle of the real shape with stand-in wheel and build files: what the checks and the
    SBOM see is the same as for a real one (tests/test_bundle_real.py makes that)."""
    wheel = root / "wheels" / "demo_pkg-1.0-py3-none-any.whl"
    build = root / "builds" / "cpu.tar.xz"
    for path, data in ((wheel, b"PK wheel"), (build, b"xz build")):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    patch = patchset.available()[0]
    copied = root / "patches" / patch.path.name
    copied.parent.mkdir(parents=True, exist_ok=True)
    copied.write_bytes(patch.path.read_bytes())
    items = [
        create.item_for(root, "wheel", wheel, "demo-pkg", "1.0"),
        create.item_for(root, "patch", copied, patch.name, patch.diff_sha256[:12],
                        summary=patch.summary),
        create.item_for(root, "build", build, "llama-server", "0c1e570", variant="cpu",
                        patches=[patch.name], binaries={"llama-server": "ab" * 32}),
    ]
    create.finish(root, items, HERE_TARGET, sign_key=sign_key)
    return root


def openssl_keys(folder: Path, name: str) -> tuple[Path, Path]:
    openssl = require_tool("openssl", "openssl")
    key, pub = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    subprocess.run([openssl, "genpkey", "-algorithm", "RSA", "-pkeyopt",
                    "rsa_keygen_bits:2048", "-out", str(key)], check=True, capture_output=True)
    subprocess.run([openssl, "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True,
                   capture_output=True)
    return key, pub


def test_a_made_bundle_checks_and_its_sbom_validates(tmp_path: Path) -> None:
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    root = small_bundle(tmp_path / "b")
    assert check.problems(root) == []
    text = (root / sbom.FILE).read_text()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    doc = json.loads(text)
    manifest = check.read_manifest(root)
    by_ref = {c["bom-ref"]: c for c in doc["components"]}
    assert set(by_ref) == {i["path"] for i in manifest["items"]}  # type: ignore[union-attr]
    for item in manifest["items"]:  # type: ignore[union-attr]
        assert by_ref[item["path"]]["hashes"] == [{"alg": "SHA-256", "content": item["sha256"]}]
    assert by_ref["wheels/demo_pkg-1.0-py3-none-any.whl"]["purl"] == "pkg:pypi/demo-pkg@1.0"
    build = by_ref["builds/cpu.tar.xz"]
    assert build["type"] == "application"
    assert [p["diff"]["url"] for p in build["pedigree"]["patches"]] == [
        f"patches/{patchset.available()[0].path.name}"]
    # every file but the list itself is listed, with its digest
    listed = dict(line.split("  ")[::-1] for line in (root / check.SUMS).read_text().splitlines())
    assert set(listed) == set(check.files_under(root)[0]) - {check.SUMS}
    assert {"install.sh", "check.py", "bundle.json", sbom.FILE} <= set(listed)


@pytest.mark.parametrize("damage", ["wheel", "build", "missing", "added"])
def test_a_tampered_missing_or_added_file_is_named(tmp_path: Path, damage: str) -> None:
    root = small_bundle(tmp_path / "b")
    wheel, build = root / "wheels/demo_pkg-1.0-py3-none-any.whl", root / "builds/cpu.tar.xz"
    if damage == "wheel":
        wheel.write_bytes(b"PK wheel with something else inside")
        named, why = wheel, "does not match its sha256"
    elif damage == "build":
        build.write_bytes(b"xz build, changed")
        named, why = build, "does not match its sha256"
    elif damage == "missing":
        wheel.unlink()
        named, why = wheel, "is missing"
    else:
        named, why = root / "wheels/extra-1.0-py3-none-any.whl", "is not in SHA256SUMS"
        named.write_bytes(b"PK")
    found = check.problems(root)
    assert len(found) == 1 and str(named) in found[0] and why in found[0], found
    r = run_cli("bundle", "verify", str(root))
    assert r.returncode != 0
    assert str(named) in r.stderr and "Traceback" not in r.stderr + r.stdout, r.stderr


def test_the_signature_is_checked_with_the_public_key(tmp_path: Path) -> None:
    key, pub = openssl_keys(tmp_path, "ours")
    _, other = openssl_keys(tmp_path, "theirs")
    root = small_bundle(tmp_path / "b", sign_key=key)
    assert check.problems(root, pub) == []
    assert run_cli("bundle", "verify", str(root), "--public-key", str(pub)).returncode == 0
    wrong = check.problems(root, other)
    assert len(wrong) == 1 and "does not verify" in wrong[0] and str(other) in wrong[0]
    # A file changed and its line in SHA256SUMS changed to match: only the signature sees it.
    wheel = root / "wheels/demo_pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK another wheel")
    sums = root / check.SUMS
    sums.write_text("".join(
        f"{check.sha256(wheel)}  {name}\n" if name == "wheels/demo_pkg-1.0-py3-none-any.whl"
        else line + "\n" for line in sums.read_text().splitlines()
        for name in [line.split("  ", 1)[1]]))
    assert check.file_problems(root) == []
    forged = check.problems(root, pub)
    assert len(forged) == 1 and "does not verify" in forged[0]
    unsigned = small_bundle(tmp_path / "u")
    missing = check.problems(unsigned, pub)
    assert len(missing) == 1 and check.SIGNATURE in missing[0] and "is missing" in missing[0]


@pytest.mark.parametrize("field, value, says", [
    ("python", "3.99", "for Python 3.99"),
    ("machine", "riscv64", "for riscv64 machines"),
    ("glibc", "9.99", "glibc 9.99"),
])
def test_a_bundle_for_another_target_is_refused(field: str, value: str, says: str) -> None:
    here = {"python": HERE_PY, "machine": platform.machine(), "glibc": "2.17"}
    assert check.target_problem({"target": here}) is None
    why = check.target_problem({"target": {**here, field: value}})
    assert why is not None and says in why, why


def test_a_damaged_bundle_installs_nothing(tmp_path: Path, unit_home: Path) -> None:
    root = small_bundle(tmp_path / "b")
    (root / "builds/cpu.tar.xz").write_bytes(b"not what was packed")
    with pytest.raises(IntegrityError, match="cpu.tar.xz does not match"):
        install.install(root)
    assert not paths.build_root().exists() and not paths.downloads_dir().exists()
    prefix = tmp_path / "prefix"
    r = subprocess.run(["sh", str(root / "install.sh"), "--prefix", str(prefix)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cpu.tar.xz does not match" in r.stderr, r.stderr
    assert not prefix.exists()


def test_install_sh_says_what_it_expected(tmp_path: Path) -> None:
    root = small_bundle(tmp_path / "b")
    r = subprocess.run(["sh", str(root / "install.sh"), "--prefixx", "x"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "install.sh: unknown argument '--prefixx'; expected --prefix DIR or --public-key FILE.")


@pytest.mark.parametrize("args, says", [
    (["--with-build", "cuda-sm89"], "--with-build cuda-sm89: no installed cuda-sm89 build"),
    (["--model", "no-such-model"], "--model no-such-model: neither a known model"),
    (["--platform", "win_amd64"], "--platform win_amd64: expected a manylinux tag"),
    (["--platform", "manylinux2014_x86_64", "--platform", "manylinux2014_aarch64"],
     "a bundle is for one"),
    (["--python", "three"], "--python three: expected a Python version"),
])
def test_create_refuses_bad_input_before_fetching_anything(tmp_path: Path, args: list[str],
                                                           says: str) -> None:
    out = tmp_path / "bundle"
    r = run_cli("bundle", "create", str(out), *args)
    assert r.returncode == 78 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_create_never_overwrites(tmp_path: Path) -> None:
    (tmp_path / "bundle").mkdir()
    with pytest.raises(ConfigError, match="exists already"):
        create.create(tmp_path / "bundle", HERE_TARGET)


def test_platform_tags_say_the_machine_and_the_glibc() -> None:
    assert create.platform_glibc("manylinux_2_28_x86_64") == (2, 28)
    assert create.platform_glibc("manylinux2014_aarch64") == (2, 17)
    assert create.platform_glibc("win_amd64") is None
    assert create.platform_machine("manylinux_2_28_x86_64") == "x86_64"
    assert create.platform_machine("manylinux2014_aarch64") == "aarch64"
    # a wheel runs where any of its tags does: the oldest glibc among them
    assert create.wheel_glibc(
        "numpy-2.3.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl") == (2, 27)
    assert create.wheel_glibc("click-8.1.0-py3-none-any.whl") is None


def test_a_carried_fork_tree_is_the_pinned_source_inside(tmp_path: Path, unit_home: Path) -> None:
    """The fork's tree a bundle carries (`git archive` of the submodule at its pin) is what
    `build` takes where the checkout's submodule is not there: an installed mtpwrap."""
    import tarfile

    from mtpwrap.build import source

    tree = tmp_path / "llama.cpp-mtp"
    (tree / "ggml").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    archive = tmp_path / "fork.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname="llama.cpp-mtp")
    installed = tmp_path / "site-packages"  # no vendor/ there, as in a wheel's install
    installed.mkdir()
    assert source.carried_source(installed) is None
    pin = source.pinned_commit(installed)
    assert pin == source.SUBMODULE_COMMIT
    unpacked = source.unpack_carried_fork(archive, pin)
    found = source.resolve(None, root=installed)
    assert (found.kind, found.path, found.commit) == ("submodule", unpacked, pin)
    assert found.pinned and found.identity == source.pin_identity("submodule")
    from mtpwrap import doctor

    assert "carried by a bundle" in doctor.check_pin().detail
    # a tarball that does not hold the tree is refused, and nothing is left half-unpacked
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tree / "CMakeLists.txt", arcname="CMakeLists.txt")
    with pytest.raises(IntegrityError, match="no llama.cpp-mtp/CMakeLists.txt inside"):
        source.unpack_carried_fork(bad, "0" * 40)
    assert not source.carried_fork_dir("0" * 40).exists()
    assert [p.name for p in paths.sources_dir().iterdir()] == [unpacked.name]


def test_install_places_sources_and_models_where_build_and_up_find_them(
        tmp_path: Path, unit_home: Path) -> None:
    import tarfile

    from mtpwrap.build import source
    from mtpwrap.models.pull import record_path
    from tests.helpers import gguf_bytes

    root = tmp_path / "b"
    tree = tmp_path / "llama.cpp-mtp"
    tree.mkdir()
    (tree / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    fork = root / "sources" / f"llama.cpp-mtp-{source.SUBMODULE_COMMIT}.tar.gz"
    fork.parent.mkdir(parents=True)
    with tarfile.open(fork, "w:gz") as tar:
        tar.add(tree, arcname="llama.cpp-mtp")
    model = root / "models" / "contracts-1b.Q4_K_M.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(gguf_bytes(4096))
    sdist = root / "downloads" / "llama_cpp_python-0.3.36.tar.gz"
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(b"stand-in sdist")
    items = [create.item_for(root, "source", fork, "llama.cpp-mtp", source.SUBMODULE_COMMIT),
             create.item_for(root, "model", model, model.name, "local"),
             create.item_for(root, "download", sdist, "llama-cpp-python", "0.3.36",
                             role="llama.cpp source")]
    create.finish(root, items, HERE_TARGET)
    said: list[str] = []
    install.install(root, say=said.append)
    placed = paths.models_dir() / model.name
    assert placed.read_bytes() == model.read_bytes()
    assert json.loads(record_path(placed).read_text())["sha256"] == items[1].sha256
    assert (paths.downloads_dir() / sdist.name).read_bytes() == b"stand-in sdist"
    assert source.carried_source(tmp_path / "nowhere") is not None
    assert any("the fork at" in s for s in said) and any(str(placed) in s for s in said)
    record = paths.home() / "bundles" / f"{check.read_manifest(root)['id']}.json"
    assert json.loads(record.read_text())["installed_from"] == str(root)
    # twice is harmless: nothing is copied again
    before = placed.stat().st_mtime_ns, (paths.downloads_dir() / sdist.name).stat().st_mtime_ns
    install.install(root)
    assert (placed.stat().st_mtime_ns,
            (paths.downloads_dir() / sdist.name).stat().st_mtime_ns) == before


@pytest.mark.parametrize("sums, says", [
    ("", "does not list bundle.json, check.py, install.sh"),
    ("{d}  bundle.json\n{d}  bundle.json\n", "listed once"),
    ("{d}  ../etc/passwd\n", "not a `HEX  RELATIVE-PATH` line"),
    ("{z}  bundle.json\n", "not a `HEX  RELATIVE-PATH` line"),
])
def test_a_damaged_list_of_sums_is_refused(tmp_path: Path, sums: str, says: str) -> None:
    root = small_bundle(tmp_path / "b")
    (root / check.SUMS).write_text(sums.format(d=check.sha256(root / "bundle.json"),
                                               z="z" * 64))
    found = check.problems(root)
    assert len(found) == 1 and says in found[0], found


def test_a_link_inside_the_bundle_is_refused(tmp_path: Path) -> None:
    root = small_bundle(tmp_path / "b")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "wheels" / "more").symlink_to(outside, target_is_directory=True)
    found = check.problems(root)
    assert len(found) == 1 and "wheels/more is a symbolic link" in found[0], found


def test_a_carried_build_that_fails_here_leaves_the_installed_one(tmp_path: Path,
                                                                  unit_home: Path) -> None:
    """The carried build is tried in a folder of its own: one that does not answer here is not
    installed, the build already there stays, and the rest of the bundle installs."""
    import dataclasses

    from mtpwrap.build.prebuilt import pack_prebuilt
    from tests.helpers import packable_manifest

    made = dataclasses.replace(packable_manifest(tmp_path), variant="cpu", architectures=[],
                               cmake_options={}, smoke={"status": "passed"})
    root = tmp_path / "b"
    archive = pack_prebuilt(made, root / "builds" / "cpu.tar.xz")
    create.finish(root, [create.item_for(root, "build", archive, "llama-server", "0c1e570",
                                         variant="cpu")], HERE_TARGET)
    kept = paths.build_root() / "cpu" / "bin" / "llama-server"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"the build that was there")
    said: list[str] = []
    install.install(root, say=said.append)
    assert kept.read_bytes() == b"the build that was there"
    assert [p.name for p in paths.build_root().iterdir()] == ["cpu"]  # no staging left
    assert len(said) == 1 and said[0].startswith("build cpu: not installed: it failed on this "
                                                  "machine"), said
    assert "mtpwrap build" in said[0]


def test_a_pulled_models_record_comes_along(tmp_path: Path, unit_home: Path) -> None:
    from mtpwrap.models.pull import record_path
    from tests.helpers import gguf_bytes

    pulled = tmp_path / "pulled" / "m-Q4_K_M.gguf"
    pulled.parent.mkdir()
    pulled.write_bytes(gguf_bytes(2048))
    record = {"repo": "org/m-GGUF", "revision": "abc123", "sha256": check.sha256(pulled),
              "size": pulled.stat().st_size}
    record_path(pulled).write_text(json.dumps(record))
    root = tmp_path / "b"
    items = create.collect_models(root, create.models_to_carry([str(pulled), str(pulled)]))
    assert [i.kind for i in items] == ["model", "record"] and items[0].version == "abc123"
    create.finish(root, items, HERE_TARGET)
    install.install(root)
    placed = json.loads(record_path(paths.models_dir() / pulled.name).read_text())
    assert (placed["repo"], placed["sha256"]) == ("org/m-GGUF", record["sha256"])
    other = tmp_path / "other" / pulled.name
    other.parent.mkdir()
    other.write_bytes(b"GGUF another")
    with pytest.raises(ConfigError, match="has the same name"):
        create.models_to_carry([str(pulled), str(other)])
