"""`models import` for a site without internet: SHA256SUMS and pull's records, copies and links."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.helpers import cli_env, gguf_bytes, pull_env, run_cli
from tests.hub_server import serve


def usb(tmp_path: Path, files: dict[str, bytes], *, sums: dict[str, str] | None = None) -> Path:
    """A carried folder with the files and a SHA256SUMS as `sha256sum` writes it."""
    d = tmp_path / "usb"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    digests = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
    digests.update(sums or {})
    (d / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in digests.items()))
    return d


def env_for(tmp_path: Path) -> dict[str, str]:
    env = cli_env(MTPWRAP_HOME=str(tmp_path / "home"))
    env.pop("MTPWRAP_MODELS_DIR", None)
    return env


def test_a_correct_sha256sums_imports_the_file(tmp_path: Path) -> None:
    data = gguf_bytes(3 << 20, seed=30)
    d = usb(tmp_path, {"m.gguf": data})
    r = run_cli("models", "import", str(d / "m.gguf"), env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr
    final = tmp_path / "home" / "models" / "m.gguf"
    assert r.stdout.strip() == str(final)
    assert final.read_bytes() == data
    rec = json.loads((final.parent / "m.gguf.json").read_text())
    assert rec["sha256"] == hashlib.sha256(data).hexdigest()
    assert rec["verified_by"] == str(d / "SHA256SUMS")
    assert sorted(p.name for p in final.parent.iterdir()) == ["m.gguf", "m.gguf.json"]


def test_a_tampered_sha256sums_or_file_is_refused(tmp_path: Path) -> None:
    data = gguf_bytes(1 << 20, seed=31)
    d = usb(tmp_path, {"m.gguf": data}, sums={"m.gguf": "ab" * 32})
    r = run_cli("models", "import", str(d / "m.gguf"), env=env_for(tmp_path))
    assert r.returncode == 78, r.stderr
    assert f"{d / 'm.gguf'}: sha256 is {hashlib.sha256(data).hexdigest()}, " \
           f"{d / 'SHA256SUMS'} says {'ab' * 32}; it was not imported." in r.stderr
    assert "Traceback" not in r.stderr
    models = tmp_path / "home" / "models"
    assert not models.exists() or list(models.iterdir()) == []
    # the listing is right, the file was damaged on the way: one byte flipped
    sums = tmp_path / "sums"
    sums.write_text(f"{hashlib.sha256(data).hexdigest()} *m.gguf\n")
    (d / "m.gguf").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    r = run_cli("models", "import", str(d / "m.gguf"), "--sums", str(sums), "--link",
                env=env_for(tmp_path))
    assert r.returncode == 78 and "it was not imported" in r.stderr
    assert list(models.iterdir()) == []


def test_nothing_to_verify_by_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "usb"
    d.mkdir()
    (d / "m.gguf").write_bytes(gguf_bytes(4096))
    r = run_cli("models", "import", str(d / "m.gguf"), env=env_for(tmp_path))
    assert r.returncode == 78
    assert "nothing to verify it by" in r.stderr and "--sums" in r.stderr


def test_the_record_pull_wrote_verifies_a_hard_linked_split_set(tmp_path: Path) -> None:
    repo = "acme/Split-GGUF"
    parts = {f"S-Q4_K_M-{i:05d}-of-00002.gguf": gguf_bytes((1 << 20) + i, seed=40 + i)
             for i in (1, 2)}
    with serve() as hub:
        for name, data in parts.items():
            hub.add(repo, name, data)
        carried = tmp_path / "carried"
        r = run_cli("models", "pull", repo, "--dir", str(carried),
                    env=pull_env(hub, tmp_path / "online"))
        assert r.returncode == 0, r.stderr
    first = carried / "S-Q4_K_M-00001-of-00002.gguf"
    r = run_cli("models", "import", str(first), "--link", env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr
    models = tmp_path / "home" / "models"
    for name, data in parts.items():
        assert (models / name).read_bytes() == data
        assert (models / name).stat().st_ino == (carried / name).stat().st_ino
        rec = json.loads((models / f"{name}.json").read_text())
        assert rec["repo"] == repo and rec["verified_by"] == str(carried / f"{name}.json")
    # a part changed after the pull is refused, and no part of the set is placed
    for name in parts:
        (models / name).unlink()
        (models / f"{name}.json").unlink()
    second = carried / "S-Q4_K_M-00002-of-00002.gguf"
    body = second.read_bytes()
    second.write_bytes(body[:-1] + bytes([body[-1] ^ 1]))
    r = run_cli("models", "import", str(first), env=env_for(tmp_path))
    assert r.returncode == 78 and f"{second}: sha256 is" in r.stderr
    assert list(models.iterdir()) == []
