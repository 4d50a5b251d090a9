"""The document store (front/store.py) on real files: names by token chain, whole states only,
the header a state is restored under, the size and age bounds, two writers of one document,
modes; its settings and the checks that keep it out of clients' reach. The real llama-server
saving and restoring through `mtpwrap up` is tests/test_documents_real.py."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.config.objects import PersistConfig
from mtpwrap.config.settings import load_settings
from mtpwrap.errors import ConfigError
from mtpwrap.front import store
from mtpwrap.front.info import ServeInfo
from mtpwrap.service import reload as reloading
from mtpwrap.service import startup

HEAD = {"v": 1, "model": "m", "binary": "b", "kv": "f16 / f16", "context": 32768}


def shelf_at(directory: Path, max_mb: int = 1000, retention_days: int = 30) -> store.Shelf:
    s = store.Shelf(PersistConfig(dir=str(directory), max_mb=max_mb,
                                  retention_days=retention_days))
    s.open()
    return s


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def written(shelf: store.Shelf, tokens: list[int], size: int = 1000, ckpt: int = 100,
            head: Mapping[str, Any] = HEAD) -> store.Entry | None:
    """What llama-server leaves for a save (a slot file, umask 022, and patch 0004's sidecar),
    then kept by the store."""
    tmp = f"{store.TMP}{os.urandom(4).hex()}{store.STATE}"
    (shelf.directory / tmp).write_bytes(b"k" * size)
    if ckpt:
        (shelf.directory / (tmp + ".ckpt")).write_bytes(b"c" * ckpt)
    return shelf.commit(tmp, store.chain(tokens), len(tokens), len(tokens) + 5, head)


def doc(seed: int, n: int = 8192) -> list[int]:
    return [(seed * 7919 + i * 31) % 150_000 for i in range(n)]


def test_a_chain_names_blocks_by_everything_before_them() -> None:
    a, b = doc(1), doc(2)
    ca = store.chain(a)
    assert len(ca) == 8192 // store.BLOCK and len(set(ca)) == len(ca)
    assert store.chain(a + [5] * 100) == ca  # a partial block is not named
    assert store.chain(a[:1024] + b[1024:])[:4] == ca[:4]
    assert store.chain(a[:1024] + b[1024:])[4:] != ca[4:]
    # the same block after another beginning has another name
    assert store.chain(b[:256] + a[256:512])[1] != ca[1]


def test_the_longest_shared_prefix_is_found_under_the_same_header_only(tmp_path: Path) -> None:
    shelf = shelf_at(tmp_path / "docs")
    a, b = doc(1), doc(2)
    ea = written(shelf, a)
    written(shelf, b)
    assert ea is not None and ea.tokens == 8192 and ea.saved == 8197 and ea.size == 1100
    index = store.Index(shelf.entries(), HEAD)
    question = a[:6000] + doc(3, 500)
    entry, depth = index.best(store.chain(question))
    assert entry is not None and entry.name == ea.name and depth == 6000 // store.BLOCK
    assert index.best(store.chain(doc(4)))[0] is None
    # another model, binary, KV type or context: nothing of it is ever restored
    for key, value in (("model", "m2"), ("binary", "b2"), ("kv", "q8_0 / q8_0"),
                       ("context", 65536)):
        assert store.Index(shelf.entries(), {**HEAD, key: value}).best(
            store.chain(a))[0] is None, key


def test_files_are_0600_in_a_0700_directory_and_never_hold_text(tmp_path: Path) -> None:
    d = tmp_path / "docs"
    d.mkdir(mode=0o755)
    shelf = shelf_at(d)
    assert mode(d) == 0o700
    e = written(shelf, doc(1))
    assert e is not None
    names = sorted(p.name for p in d.iterdir())
    assert names == [e.name + ".bin", e.name + ".bin.ckpt", e.name + ".json"]
    assert all(mode(d / n) == 0o600 for n in names)
    assert (d / (e.name + ".json")).read_text().count(e.name) == 1  # its chain's last name


def test_a_truncated_or_foreign_state_is_removed_never_restored(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shelf = shelf_at(tmp_path / "docs")
    e = written(shelf, doc(1))
    f = written(shelf, doc(2))
    assert e is not None and f is not None
    with open(shelf.path(e.name), "r+b") as fh:  # a copy cut short
        fh.truncate(10)
    shelf.path(f.name, store.RECORD).write_text("{not json")  # not a record of ours
    assert [x.name for x in shelf.entries()] == []
    assert "is broken and is removed" in caplog.text
    assert list(shelf.directory.iterdir()) == []


def test_two_writers_of_one_document_leave_one_whole_state(tmp_path: Path) -> None:
    shelf = shelf_at(tmp_path / "docs")
    other = store.Shelf(PersistConfig(dir=str(shelf.directory)))  # a second node's
    tokens = doc(1)
    results: list[store.Entry | None] = []
    barrier = threading.Barrier(2)

    def write(s: store.Shelf, size: int) -> None:
        barrier.wait()
        results.append(written(s, tokens, size=size))

    threads = [threading.Thread(target=write, args=(s, n)) for s, n in ((shelf, 1000),
                                                                       (other, 2000))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = shelf.entries()
    assert len(entries) == 1
    kept = entries[0]
    assert shelf.path(kept.name).stat().st_size + 100 == kept.size  # its record's sizes
    assert not [p for p in shelf.directory.iterdir() if p.name.startswith(store.TMP)]


def test_the_least_recently_used_go_first_past_the_bound_and_age(tmp_path: Path) -> None:
    shelf = shelf_at(tmp_path / "docs", max_mb=1)
    kept = [written(shelf, doc(i), size=400_000) for i in range(3)]
    assert all(kept)
    old = time.time() - 100
    for i, e in enumerate(kept):
        assert e is not None
        os.utime(shelf.path(e.name, store.RECORD), (old + i, old + i))
    shelf.touch(kept[0].name)  # restored just now: used last
    assert shelf.evict() == [kept[1].name]  # 3 x 400 KB > 1 MiB: the least recently used
    stale = time.time() - 31 * 86400
    os.utime(shelf.path(kept[2].name, store.RECORD), (stale, stale))
    assert shelf.evict() == [kept[2].name]
    assert [e.name for e in shelf.entries()] == [kept[0].name]


def test_a_killed_writes_leftovers_go_at_open_and_a_younger_one_stays(tmp_path: Path) -> None:
    d = tmp_path / "docs"
    shelf = shelf_at(d)
    old, young = d / f"{store.TMP}old.bin", d / f"{store.TMP}young.bin"
    orphan = d / f"{'ab' * 16}.bin"  # linked, and killed before its record was written
    for p in (old, young, orphan):
        p.write_bytes(b"x")  # young: another node may be writing it now
    then = time.time() - store.STALE_S - 10
    os.utime(old, (then, then))
    os.utime(orphan, (then, then))
    shelf.open()
    assert not old.exists() and young.exists() and not orphan.exists()
    assert shelf.forget() == 0 and list(d.iterdir()) == []


class Slot:
    """llama-server's slot actions, as a stand-in for the decisions' own checks (the real
    ones are tests/test_documents_real.py's): saves write files, restores are counted."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, path: str, body: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        assert threading.current_thread() is threading.main_thread()
        action = path.split("action=")[1]
        self.calls.append((action, body["filename"]))
        if action == "save":
            (self.directory / body["filename"]).write_bytes(b"k" * 500)
            return 200, {"n_saved": 9000}
        return 200, {"n_restored": 9000}


def test_restored_when_it_saves_enough_and_kept_once(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file step in a thread (a slow disk never holds the loop); a document is saved once,
    restored only when llama-server's child does not hold it, and only under its header."""
    shelf = shelf_at(tmp_path / "docs")
    on_loop: list[str] = []
    for name in ("entries", "load", "commit", "touch", "evict", "stamp"):
        real = getattr(shelf, name)

        def watched(*args: Any, _real: Any = real, _name: str = name) -> Any:
            if threading.current_thread() is threading.main_thread():
                on_loop.append(_name)
            return _real(*args)

        monkeypatch.setattr(shelf, name, watched)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    info = ServeInfo(model=str(model), binary=str(model), kv="f16 / f16", context=32768,
                     documents={"documents": 4})  # llama-server's RAM cache holds four
    slot = Slot(shelf.directory)
    a, b = doc(1), doc(2)

    async def scenario() -> list[Any]:
        docs = store.Documents(shelf)
        await docs.launch(info)
        out: list[Any] = []
        for gen, tokens in ((1, a), (1, a[:7000] + doc(9, 300)), (1, b), (2, a + [1] * 40),
                            (2, a[:100]), (3, b), (3, a), (3, b)):
            read = await docs.before(slot, gen, tokens)
            out.append(None if read is None else read.restored)
            if read is not None:
                out.append(await docs.after(slot, read))
        return out

    out = asyncio.run(scenario())
    assert on_loop == []
    first, first_saved, second, second_saved, third, third_saved, fourth, _, fifth = out[:9]
    assert first is None and first_saved is not None and first_saved["tokens"] == 9000
    assert second is None and second_saved is None  # the child holds it; covered by a's state
    assert third is None and third_saved is not None
    # a new child (a restart): a's state goes into the slot before the question on it
    assert fourth is not None and fourth["shared"] == 8192
    assert fifth is None  # too short for the store
    # a restore replaces what the slot held (llama-server keeps no copy): b comes back again
    assert [r is not None for r in out[9::2]] == [True, True, True]
    assert [c[0] for c in slot.calls] == ["save", "save", "restore"] + ["restore"] * 3
    assert len(shelf.entries()) == 2


def test_directory_problems_and_the_doctor_check(tmp_path: Path) -> None:
    from mtpwrap import doctor

    d = tmp_path / "snaps"
    assert doctor.check_snapshots(d).status == doctor.OK  # not created yet
    d.mkdir()
    os.chmod(d, 0o755)
    f = d / "mtpwrap-slot0-x.bin"
    f.write_bytes(b"x")
    os.chmod(f, 0o644)
    problems = store.directory_problems(d)
    assert any("expected 0700" in p for p in problems)
    assert any("expected 0600" in p and str(f) in p for p in problems)
    check = doctor.check_snapshots(d)
    assert check.status == doctor.WARNING and "0755" in check.detail and check.fix
    os.chmod(d, 0o700)
    os.chmod(f, 0o600)
    assert store.directory_problems(d) == []
    assert doctor.check_snapshots(d).status == doctor.OK


def test_persist_settings_from_file_and_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "m.yaml"
    cfg.write_text("persist:\n  min_tokens: 512\n  dir: /srv/snaps\n")
    s = load_settings({}, env={"MTPWRAP_PERSIST_MAX_MB": "100"}, config=cfg)
    pc = startup.persist_config(s)
    assert pc is not None and pc.min_tokens == 512 and pc.max_bytes == 100 * 2**20
    assert pc.directory == Path("/srv/snaps") and pc.retention_days == 30
    cfg.write_text("persist:\n  checkpoints: true\n")  # the carrier's key: said what to do
    with pytest.raises(ConfigError, match="persist.checkpoints: every document read is kept"):
        load_settings({}, env={}, config=cfg)
    cfg.write_text("persist:\n  min_tokens: 512\n  dir: /srv/snaps\n")
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


