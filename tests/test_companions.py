"""Companions decided before anything starts: the profile's `companions:` keys, the argv each
companion's llama-server gets, what they take from the chat model (GPU bytes as rows of its
memory plan on a recorded RTX 4090, CPU threads, RAM), and the front's routing table. The real
llama-server path is tests/test_companions_real.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from mtpwrap.build import tiny_gguf
from mtpwrap.config import settings
from mtpwrap.decide import companions, profiles
from mtpwrap.decide.hardware import HardwareSnapshot
from mtpwrap.decide.profile_types import Companion
from mtpwrap.errors import ConfigError
from mtpwrap.front.companions import Companion as Served
from mtpwrap.front.companions import CompanionInfo, Routes, UnknownModel
from mtpwrap.service import startup
from mtpwrap.supervision.state import State, SupervisorStatus, Upstream
from tests.helpers import recorded_fork, replay

GiB = 2**30


def resolve(tmp_path: Path, profile: str, model: Path, binary: Path,
            free_gib: float | None = None) -> startup.Runtime:
    """`up`'s launch on the recorded RTX 4090 (with less memory free when asked)."""
    s = settings.load_settings({"profile": profile, "model": str(model), "binary": str(binary),
                                "hw_replay": str(replay(tmp_path, free_gib))}, env={})
    return startup.load_runtime(s)


def _validate(companions_: Any) -> profiles.Profile:
    return profiles.validate({"description": "d", "model": "m.gguf", "context": 4096,
                              "companions": companions_}, where="p.yaml", expected_name="p")


@pytest.mark.parametrize(("given", "says"), [
    ({"model": "e.gguf"}, "p.yaml: companions[0].role: missing (required)"),
    ({"role": "chat", "model": "e.gguf"}, "companions[0].role: expected embedding or rerank"),
    ({"role": "embedding"}, "companions[0].model: missing (required)"),
    ({"role": "embedding", "model": "e.gguf", "device": "tpu"}, "companions[0].device"),
    ({"role": "embedding", "model": "e.gguf", "pooling": "rank"},
     "companions[0].pooling: rank pooling scores pairs"),
    ({"role": "rerank", "model": "r.gguf", "pooling": "mean"},
     "companions[0].pooling: a reranker pools with rank"),
    ({"role": "embedding", "model": "e.gguf", "context": "2048"},
     "companions[0].context: expected an integer 64..1048576, got '2048'"),
    ({"role": "embedding", "model": "e.gguf", "slots": 0}, "companions[0].slots"),
    ({"role": "embedding", "model": "e.gguf", "name": "a b"}, "companions[0].name"),
    ({"role": "embedding", "model": "e.gguf", "ctx": 1}, "companions[0].ctx: unknown key"),
    ({"role": "embedding", "model": "e.gguf", "context": 512, "ubatch": 1024},
     "companions[0].ubatch: must not exceed its context"),
])
def test_bad_companion_keys_get_one_sentence(given: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as err:
        _validate([given])
    assert says in str(err.value)
    assert "\n" not in str(err.value)


def test_companion_names_are_unique_and_default_to_the_role() -> None:
    p = _validate([{"role": "embedding", "model": "e.gguf"},
                   {"role": "rerank", "model": "r.gguf"}])
    assert [(c.name, c.pooling) for c in p.companions] == [("embedding", None),
                                                           ("rerank", "rank")]
    with pytest.raises(ConfigError, match=r"companions\[1\]\.name: 'embedding' is used"):
        _validate([{"role": "embedding", "model": "e.gguf"},
                   {"role": "embedding", "model": "f.gguf"}])
    with pytest.raises(ConfigError, match="expected a list of companion models"):
        _validate({"role": "embedding"})
    # a profile written back reads back the same
    assert profiles.validate(profiles.to_yaml(p), where="again") == dataclasses.replace(
        p, source="again")


def _snapshot(cores: int, ram_gib: float = 64) -> HardwareSnapshot:
    return HardwareSnapshot(cpu_physical=cores, cpu_logical=cores * 2,
                            ram_total=int(ram_gib * GiB), ram_available=int(ram_gib * GiB),
                            error="no NVML here")


def test_cpu_companions_take_threads_from_the_chat_model(tmp_path: Path) -> None:
    emb = tiny_gguf.write_shape_only(tmp_path / "emb.gguf", "smollm2-135m")
    p = _validate([{"role": "embedding", "model": str(emb), "threads": 3, "pooling": "mean"},
                   {"role": "rerank", "model": str(emb)}])
    snap = _snapshot(8)
    comps = companions.resolve_companions(p, {c.name: emb for c in p.companions}, snap)
    assert [c.launch.threads for c in comps] == [3, 2]  # given; a quarter of 8 cores
    chat = companions.choose(Companion("x", "embedding", "m"), "m", "p", snap)
    chat = dataclasses.replace(chat, serves=None, alias=None, threads=None, profile="p")
    adjusted = companions.chat_threads(chat, comps, snap)
    assert adjusted.threads == 3
    assert adjusted.reason("threads") == "8 cores less 5 for CPU companions (embedding 3, " \
                                         "rerank 2)"
    with pytest.raises(ConfigError, match="threads 4 for the chat model and 5 for CPU "
                                          r"companions \(embedding 3, rerank 2\) exceed the 8"):
        companions.chat_threads(dataclasses.replace(chat, threads=4), comps, snap)
    with pytest.raises(ConfigError, match="take 5 threads .* all 4 cores here"):
        companions.chat_threads(chat, comps, _snapshot(4))
    # and RAM: the chat model's share and every companion's must fit what is available; on
    # the CPU a companion's plan is all host rows, counted once
    for c in comps:
        assert c.plan is not None
        assert c.host_bytes == c.plan.host_total == sum(r.bytes for r in c.plan.rows)
        assert c.plan_text == f"{c.host_bytes / GiB:.2f} GiB on the host"
    need = 2**30 + sum(c.host_bytes for c in comps)
    companions.check_ram(2**30, comps, _snapshot(8, ram_gib=need / GiB))
    with pytest.raises(ConfigError, match=rf"need {need / GiB:.2f} GiB of RAM, but "):
        companions.check_ram(2**30 + 2**20, comps, _snapshot(8, ram_gib=need / GiB))


def test_a_gpu_companion_needs_a_gpu(tmp_path: Path) -> None:
    emb = tiny_gguf.write_shape_only(tmp_path / "emb.gguf", "smollm2-135m")
    p = _validate([{"role": "embedding", "model": str(emb), "device": "gpu", "pooling": "cls"}])
    with pytest.raises(ConfigError, match=r"companions\[0\] \(embedding\): device gpu, but "
                                          r"this machine has no GPU \(no NVML here\)"):
        companions.resolve_companions(p, {"embedding": emb}, _snapshot(8))


def _with_companions(tmp_path: Path, base: str, items: list[dict[str, Any]]) -> Path:
    data = profiles.to_yaml(profiles.load_profile(base))
    data["companions"] = items
    data.pop("name", None)
    path = tmp_path / f"{base}-with-companions.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_gpu_companion_is_a_row_of_the_plan_and_changes_what_fits(
        tmp_path: Path, shape_27b: Path) -> None:
    fork = recorded_fork(tmp_path, "fork-0bc0a27")
    emb = tiny_gguf.write_shape_only(tmp_path / "emb.gguf", "smollm2-135m")
    alone = resolve(tmp_path, "4090-262k", shape_27b, fork).resolved
    profile = _with_companions(tmp_path, "4090-262k", [
        {"role": "embedding", "name": "embed", "model": str(emb), "device": "gpu",
         "context": 8192, "slots": 4, "pooling": "mean"}])
    # the ubatch the plan chose alone, held: with more room it would choose a larger one
    assert alone is not None and alone.launch.ubatch is not None
    profile.write_text(profile.read_text() + f"ubatch: {alone.launch.ubatch}\n")
    # the recorded 4090's free memory holds the recipe alone, not beside this companion
    with pytest.raises(ConfigError, match=r"context 262,144 with KV tbq4_0/tbq4_0 and MTP "
                                          r"beside its companion embed \(embedding\) \d\.\d\d GiB "
                                          r"needs 2\d\.\d\d GiB on the device .*short by"):
        resolve(tmp_path, str(profile), shape_27b, fork)
    # with room for both, the companion's bytes are a row of the chat model's plan
    launch = resolve(tmp_path, str(profile), shape_27b, fork, free_gib=40)
    both = launch.resolved
    assert alone is not None and both is not None
    assert alone.plan is not None and both.plan is not None
    row = both.plan.row("companion embed (embedding)")
    assert row.where == "gpu"
    comp = both.companion("embed")
    assert comp.plan is not None
    # its own plan: weights, its KV for 8192 tokens, compute and its own CUDA context
    assert row.bytes == comp.plan.total == comp.gpu_bytes
    assert {r.name for r in comp.plan.rows if r.bytes} >= {"weights (GPU)", "main KV",
                                                           "compute", "overhead"}
    assert 512 * 2**20 < row.bytes < 2 * GiB
    assert both.plan.total == alone.plan.total + row.bytes
    # the companion's argv: all layers on the GPU, --embeddings, its name
    argv = both.render(cfg=comp.launch).argv
    assert argv[argv.index("-ngl") + 1] == "999"
    assert "--embeddings" in argv and argv[argv.index("-a") + 1] == "embed"
    assert [c.name for c in launch.companions] == ["embed"]


def _served(name: str, role: str) -> Served:
    class Sup:
        def status(self) -> SupervisorStatus:
            return SupervisorStatus(State.READY, None, 0, None, None, None, None, 1,
                                    Upstream("http://x", "k", 1))

        async def wait_ready(self, timeout: float) -> Upstream | None:
            return None

        def report_stall(self, generation: int, reason: str) -> None:
            return None

    return Served(CompanionInfo(name, role, f"{name}.gguf", 1), Sup(), None, None)  # type: ignore[arg-type]


def test_routes_choose_by_route_and_model() -> None:
    one = Routes((_served("embed", "embedding"),))
    assert one.role_of("/v1/embeddings") == "embedding"
    assert one.role_of("/embedding") == "embedding"
    assert one.role_of("/v1/rerank") is None  # no reranker: the chat model's answer
    assert one.role_of("/v1/chat/completions") is None
    # one of the role: it answers whatever `model` says (clients send their own names)
    assert one.target("embedding", "text-embedding-3-small").name == "embed"
    assert one.target("embedding", None).name == "embed"
    two = Routes((_served("embed", "embedding"), _served("embed-ko", "embedding"),
                  _served("rr", "rerank")))
    assert two.target("embedding", "embed-ko").name == "embed-ko"
    assert two.target("embedding", None).name == "embed"
    assert two.target("rerank", "anything").name == "rr"
    assert two.role_of("/reranking") == "rerank"
    with pytest.raises(UnknownModel, match="'other' does not serve embedding requests here; "
                                           "send one of 'embed', 'embed-ko' as `model`"):
        two.target("embedding", "other")


def test_mean_pooling_gets_a_batch_its_slots_divide() -> None:
    # llama.cpp aborts at load (GGML_ASSERT(ggml_can_mul_mat(a, b))) with mean pooling when
    # the physical batch is not a multiple of the slots: -np 3 -ub 2048 crashes, -ub 2046 runs
    snap = _snapshot(8)
    c = Companion("e", "embedding", "e.gguf", context=2048, slots=3, pooling="mean")
    cfg = companions.choose(c, "e.gguf", "p", snap)
    assert (cfg.ubatch, cfg.batch) == (2046, 2046)
    assert "multiple of the 3 slots" in cfg.reason("ubatch")
    with pytest.raises(ConfigError, match=r"ubatch 2048 with 3 slots and mean pooling: .* use "
                                          r"2046\.$"):
        companions.choose(dataclasses.replace(c, ubatch=2048), "e.gguf", "p", snap)
    with pytest.raises(ConfigError, match="use 1026 or 1029"):
        companions.choose(dataclasses.replace(c, ubatch=1028), "e.gguf", "p", snap)
    # other pooling, or slots that divide it: the whole context
    assert companions.choose(dataclasses.replace(c, pooling="last"), "e", "p", snap).ubatch \
        == 2048
    assert companions.choose(dataclasses.replace(c, slots=4), "e", "p", snap).ubatch == 2048


def test_an_embedding_companion_that_would_pool_with_none_is_refused(tmp_path: Path) -> None:
    # llama-server answers /v1/embeddings with 400 when the pooling is none, so the readiness
    # question and every client would fail: refused before anything starts
    emb = tiny_gguf.write_shape_only(tmp_path / "emb.gguf", "smollm2-135m")  # no pooling type
    p = _validate([{"role": "embedding", "model": str(emb)}])
    with pytest.raises(ConfigError, match=r"companions\[0\] \(embedding\): emb.gguf names no "
                                          r"pooling type in its header .* set pooling: mean, cls "
                                          r"or last\.$"):
        companions.resolve_companions(p, {"embedding": emb}, _snapshot(8))
    p = _validate([{"role": "embedding", "model": str(emb), "pooling": "none"}])
    with pytest.raises(ConfigError, match="the profile sets pooling: none"):
        companions.resolve_companions(p, {"embedding": emb}, _snapshot(8))
    # a reranker pools with rank whatever the header says
    p = _validate([{"role": "rerank", "model": str(emb)}])
    assert companions.resolve_companions(p, {"rerank": emb}, _snapshot(8))[0].launch.serves \
        == "reranking"
    with pytest.raises(ConfigError, match=r"companions\[0\]\.name: chat names the chat model"):
        _validate([{"role": "embedding", "model": "e.gguf", "name": "chat"}])


class _Child:
    """A companion's supervisor as reload sees it: its state, and what `reload` answers."""

    def __init__(self, state: State, answer: tuple[bool, str] = (True, "restarted")) -> None:
        self.state, self.answer, self.asked = state, answer, 0

    def status(self) -> SupervisorStatus:
        return SupervisorStatus(self.state, None, 0, None, None, None, None, None, None)

    async def reload(self, factory: object, drain_s: float) -> tuple[bool, str]:
        self.asked += 1
        return self.answer


def test_restart_restarts_the_ready_companions_and_says_what_it_left() -> None:
    import asyncio

    from mtpwrap.service.reload import _swap_companions

    kids = {"ok": _Child(State.READY), "loading": _Child(State.STARTING),
            "gone": _Child(State.FAILED), "bad": _Child(State.READY, (False, "did not start"))}
    failed, notes = asyncio.run(_swap_companions(kids, None, 5.0))  # type: ignore[arg-type]
    assert [k.asked for k in kids.values()] == [1, 0, 0, 1]
    assert failed == ["companion bad: did not start"]
    assert notes == ["companion loading is starting: not restarted",
                     "companion gone has failed and starts again only when mtpwrap restarts"]


def test_a_reload_may_not_change_what_the_front_routes_by(tmp_path: Path) -> None:
    from mtpwrap.service.reload import _companions_changed
    from mtpwrap.service.startup import CompanionRun

    def run(name: str, role: str = "embedding", model: str = "/m/e.gguf",
            slots: int = 1) -> CompanionRun:
        return CompanionRun(name, role, model, slots, None, None, "")  # type: ignore[arg-type]

    assert _companions_changed([run("e")], [run("e")]) is None
    assert _companions_changed([run("e")], [run("e", slots=2)]) == (
        "the companions would change from e (embedding, e.gguf, 1 slot(s)) to e (embedding, "
        "e.gguf, 2 slot(s))")
    assert "to none" in str(_companions_changed([run("e")], []))
    assert "rerank" in str(_companions_changed([run("e")], [run("e", role="rerank")]))
