"""KV snapshot files: modes, the size bound, what makes a snapshot fit a new launch, the
settings that govern them, and the checks that keep them out of clients' reach."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.config.objects import PersistConfig
from mtpwrap.config.settings import load_settings
from mtpwrap.decide.launch import LaunchConfig
from mtpwrap.errors import ConfigError
from mtpwrap.service import reload as reloading
from mtpwrap.service import startup
from mtpwrap.supervision import persist


def store_at(directory: Path, max_mb: int = 0) -> persist.SnapshotStore:
    return persist.SnapshotStore(PersistConfig(dir=str(directory), max_mb=max_mb))


def write(store: persist.SnapshotStore, slot: int, size: int) -> str:
    name = store.new_name(slot)
    store.path(name).write_bytes(b"\0" * size)  # as llama-server writes it: umask 022
    return name


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_directory_is_0700_files_0600_and_leftovers_go(tmp_path: Path) -> None:
    d = tmp_path / "snaps"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    left = d / f"{persist.PREFIX}0-1-abc{persist.SUFFIX}"
    left.write_bytes(b"old prompt")
    other = d / "notes.txt"  # not mtpwrap's: left alone
    other.write_text("x")
    store = store_at(d)
    store.open()
    assert mode(d) == 0o700
    assert not left.exists() and other.exists()
    assert store.max_bytes > 0  # the default bound comes from the free disk
    name = write(store, 0, 100)
    assert mode(store.path(name)) & 0o077  # as written by llama-server
    assert store.secure(name) == 100 and mode(store.path(name)) == 0o600


def test_names_are_mtpwraps_own_and_unguessable(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    names = {store.new_name(0) for _ in range(50)}
    assert len(names) == 50
    assert all(n.startswith(persist.PREFIX + "0-") and "/" not in n for n in names)


def test_eviction_removes_the_oldest_until_the_bound_holds(tmp_path: Path) -> None:
    store = store_at(tmp_path, max_mb=2)
    store.directory.mkdir(exist_ok=True)
    names = []
    for i in range(3):
        names.append(write(store, i, 2**20))
        past = time.time() - 100 + i
        os.utime(store.path(names[-1]), (past, past))
    assert store.evict() == [names[0]]
    assert [p.name for p in sorted(store.files())] == sorted(names[1:])
    assert store.evict() == []


def test_a_sidecar_goes_with_its_slot_file(tmp_path: Path) -> None:
    """llama-server (patch 0004) writes a slot's checkpoints beside its file, through a .tmp
    file it renames: mtpwrap makes it 0600, counts it in the bound and removes it, and what a
    write cut short left, with the slot file."""
    store = store_at(tmp_path, max_mb=1)
    store.directory.mkdir(exist_ok=True)
    old = write(store, 0, 2**19)
    store.path(old + persist.SIDECAR).write_bytes(b"LLCKPT" + b"\0" * (2**19 - 6))
    store.path(old + persist.SIDECAR_TMP).write_bytes(b"LLCKPT")
    past = time.time() - 100
    os.utime(store.path(old), (past, past))
    assert store.secure(old) == 2**20 and mode(store.path(old + persist.SIDECAR)) == 0o600
    new = write(store, 1, 100)
    assert store.evict() == [old]  # the slot file and its sidecar were over the bound together
    assert sorted(p.name for p in tmp_path.iterdir()) == [new]
    store.path(new + persist.SIDECAR_TMP).write_bytes(b"cut short")
    store.remove(new)
    assert list(tmp_path.iterdir()) == []

def test_directory_problems_and_the_doctor_check(tmp_path: Path) -> None:
    from mtpwrap import doctor

    d = tmp_path / "snaps"
    assert doctor.check_snapshots(d).status == doctor.OK  # not created yet
    d.mkdir()
    os.chmod(d, 0o755)
    f = d / "mtpwrap-slot0-x.bin"
    f.write_bytes(b"x")
    os.chmod(f, 0o644)
    problems = persist.directory_problems(d)
    assert any("expected 0700" in p for p in problems)
    assert any("expected 0600" in p and str(f) in p for p in problems)
    check = doctor.check_snapshots(d)
    assert check.status == doctor.WARNING and "0755" in check.detail and check.fix
    os.chmod(d, 0o700)
    os.chmod(f, 0o600)
    assert persist.directory_problems(d) == []
    assert doctor.check_snapshots(d).status == doctor.OK


def launch(model: Path, context: int = 4096, slots: int = 2, k: str = "q8_0", v: str = "q8_0",
           **more: Any) -> LaunchConfig:
    return LaunchConfig(profile="p", model=str(model), context=context, cache_k=k, cache_v=v,
                        slots=slots, **more)


def test_snapshots_fit_only_the_same_model_kv_types_and_no_smaller_slots(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    base = persist.fingerprint(launch(model))
    assert base["slot_ctx"] == 2048 and base["type_k"] == "q8_0"
    same = persist.fingerprint(launch(model, flash_attn="on"))
    assert persist.incompatibility(base, same) is None
    bigger = persist.fingerprint(launch(model, context=8192, slots=1))
    assert persist.incompatibility(base, bigger) is None
    smaller = persist.fingerprint(launch(model, slots=4))
    assert "shrank (2048 -> 1024" in (persist.incompatibility(base, smaller) or "")
    kv = persist.fingerprint(launch(model, k="q4_0"))
    assert "K cache type changed (q8_0 -> q4_0)" in (persist.incompatibility(base, kv) or "")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    moved = persist.fingerprint(launch(other))
    assert "model changed" in (persist.incompatibility(base, moved) or "")
    # The same path with other contents (a re-download, a new quantisation) is another model.
    model.write_bytes(b"GGUF" + b"\1" * 128)
    changed = persist.fingerprint(launch(model))
    assert "model changed" in (persist.incompatibility(base, changed) or "")
    # A command whose launch is not known takes no snapshot and gives none.
    assert "not known" in (persist.incompatibility(persist.fingerprint(None), changed) or "")


def test_persist_settings_from_file_and_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("persist:\n  min_tokens: 512\n  dir: /srv/snaps\n")
    s = load_settings({}, env={"MTPWRAP_PERSIST_MAX_MB": "100"}, config=cfg)
    pc = startup.persist_config(s)
    assert pc is not None and pc.min_tokens == 512 and pc.max_bytes == 100 * 2**20
    assert pc.directory == Path("/srv/snaps") and pc.checkpoints is True
    off = load_settings({}, env={"MTPWRAP_PERSIST_ENABLED": "false"}, config=cfg)
    assert startup.persist_config(off) is None
    cfg.write_text("persist:\n  min_token: 512\n")
    with pytest.raises(ConfigError, match="persist.min_token: unknown key"):
        load_settings({}, env={}, config=cfg)
    cfg.write_text("persist:\n  min_tokens: 0\n")
    with pytest.raises(ConfigError, match="persist.min_tokens: expected an integer"):
        load_settings({}, env={}, config=cfg)


def test_the_snapshot_directory_flag_is_mtpwraps_alone(tmp_path: Path) -> None:
    from mtpwrap.decide import launch as launching
    from mtpwrap.decide.capabilities import Capabilities

    help_dir = Path(__file__).resolve().parent / "data" / "help"
    caps = Capabilities.from_help((help_dir / "upstream-0c1e570.txt").read_text())
    with pytest.raises(ConfigError, match="--slot-save-path is set by mtpwrap"):
        launching.check_extra(caps, "profile extra_args", ["--slot-save-path", "/tmp"])
    with pytest.raises(ConfigError, match="--slot-save-path is set by mtpwrap"):
        launching.check_extra(caps, "profile extra_args", ["--slot-save-path=/tmp"])
    launching.check_extra(caps, "profile extra_args", ["--ctx-checkpoints", "0"])


def test_client_slot_actions_and_snapshots_do_not_mix(tmp_path: Path) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("proxy:\n  enable_paths: [slot-actions]\n")
    s = load_settings({}, env={}, config=cfg)
    with pytest.raises(ConfigError, match="slot-actions would let clients"):
        startup.proxy_config(s, {}, 1)
    off = load_settings({}, env={"MTPWRAP_PERSIST_ENABLED": "0"}, config=cfg)
    assert "slot-actions" in startup.proxy_config(off, {}, 1).enable_paths
    # A profile cannot open it either.
    plain = load_settings({}, env={}, config=None)
    with pytest.raises(ConfigError, match="slot-actions"):
        startup.proxy_config(plain, {"enable_paths": ["slot-actions"]}, 1)


def test_reload_reads_the_same_flags_variables_and_file(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("profile: cpu-demo\nport: 8099\n")
    monkeypatch.setenv("MTPWRAP_DRAIN_S", "7")
    monkeypatch.setenv("MTPWRAP_API_KEYS", "secret-key-1")
    s = load_settings({"host": "127.0.0.2", "supervisor.wedge_s": "5",
                       "proxy.cors_origins": "https://a.example"}, config=cfg)
    inputs = reloading.reload_inputs(s)
    assert inputs == {"cli": {"host": "127.0.0.2", "supervisor.wedge_s": 5.0,
                              "proxy.cors_origins": ["https://a.example"]},
                      "env": {"MTPWRAP_DRAIN_S": "7"},
                      "config": str(cfg)}  # no key in the state file
    cfg.write_text("profile: cpu-demo\nport: 8100\n")
    monkeypatch.delenv("MTPWRAP_DRAIN_S")
    again = reloading.reread_settings(inputs)
    assert (again.host, again.port, again.drain_s) == ("127.0.0.2", 8100, 7.0)
    assert again.supervisor["wedge_s"] == 5.0
    assert again.proxy["cors_origins"] == ("https://a.example",)
    assert again.api_keys == ("secret-key-1",)


def test_the_snapshot_files_are_touched_off_the_loop(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A save and a restore stat, chmod, unlink and evict snapshot files, and read the model's
    stamp: each in a thread, never on the event loop (a slow disk would hold every stream)."""
    import asyncio
    import threading

    store = store_at(tmp_path / "snaps", max_mb=1)
    store.directory.mkdir(mode=0o700, exist_ok=True)
    on_loop: list[str] = []
    for name in ("secure", "remove", "evict", "forget"):
        real = getattr(store, name)

        def watched(*args: Any, _real: Any = real, _name: str = name) -> Any:
            if threading.current_thread() is threading.main_thread():
                on_loop.append(_name)
            return _real(*args)

        monkeypatch.setattr(store, name, watched)

    class Child:
        async def slot_action(self, slot: int, action: str, name: str) -> tuple[bool, dict]:
            if action == "save":
                store.path(name).write_bytes(b"kv" * 100)
                return True, {"n_saved": 5000 + slot}
            return True, {"n_restored": 5000 + slot}

    async def scenario() -> dict[str, Any]:
        carried = await persist.save_slots(Child(), store, None)
        assert [s.tokens for s in carried.snapshots] == [5000]
        return await persist.restore_slots(Child(), store, carried, None)

    report = asyncio.run(scenario())
    assert on_loop == []
    assert report["skipped"] is not None  # an unknown launch fits nothing: files removed
    assert list(store.directory.iterdir()) == []
