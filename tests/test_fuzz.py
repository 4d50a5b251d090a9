"""The fuzz campaign (tests/fuzz/): its parts on their own, and the seed corpus replayed on the
real llama-server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings

from mtpwrap.front.access import classify
from tests.fuzz import campaign, cases, oracle, raw, seeds

CORPUS = seeds.load()


# --------------------------------------------------------------------------- the parts


def test_every_seed_names_a_served_route_and_its_trap() -> None:
    assert len(CORPUS) >= 25
    for s in CORPUS:
        assert classify("POST", s.route.encode(), frozenset()).status == 0, s.name
        assert s.why and s.expect in ("4xx", "2xx", "any"), s.name


def test_large_seeds_are_built_not_stored() -> None:
    nested = next(s for s in CORPUS if s.name == "grammar-nested-60000")
    doc = json.loads(nested.body)
    assert doc["grammar"].count("(") == 60000 and len(nested.body) > 120_000
    assert all(f.stat().st_size < 200_000 for f in seeds.SEEDS.glob("*.json"))


@given(case=cases.cases())
@settings(max_examples=300, deadline=None)
def test_cases_are_one_route_and_bytes(case: cases.Case) -> None:
    assert case.route in cases.BASE and isinstance(case.body, bytes)
    seed = case.as_seed()
    assert seed["route"] == case.route and ("body" in seed or "body_text" in seed)


@pytest.mark.parametrize("status,headers,body,expected", [
    (200, {"x-mtpwrap-answered-by": "llama-server"}, b"{}", None),
    (400, {"x-mtpwrap-answered-by": "front"}, b'{"error": {"message": "x"}}', None),
    (400, {"x-mtpwrap-answered-by": "front"}, b"oops", "400 from the front without an error"
     " message"),
    (200, {}, b"{}", "unmarked 200"),
    (503, {"x-mtpwrap-answered-by": "front"}, b'{"error": {"message": "busy"}}',
     "front 503 without Retry-After"),
    (503, {"x-mtpwrap-answered-by": "front", "retry-after": "1"},
     b'{"error": {"message": "busy"}}', None),
    (500, {"x-mtpwrap-answered-by": "front"}, b'{"error": {"message": "boom 12"}}',
     "front 500: boom N"),
    (500, {"x-mtpwrap-answered-by": "llama-server"},
     b'{"error": {"message": "type must be string, but is number"}}',
     "relayed 500 on /r: type must be string, but is number"),
    (501, {"x-mtpwrap-answered-by": "llama-server"}, b'{"error": {"message": "no"}}', None),
    (200, {"x-mtpwrap-answered-by": "front"}, b"Traceback (most recent call last):",
     "traceback in a 200 from the front"),
])
def test_the_oracle(status: int, headers: dict[str, str], body: bytes,
                    expected: str | None) -> None:
    got = oracle.verdict("/r", status, headers, body)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.startswith(expected), got


@pytest.mark.parametrize("data,kind", [
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", "agree-ok"),
    (b"GET /health HTTP/1.1\r\nHost x\r\n\r\n", "agree-bad"),
    # h11 reads the chunked body; llhttp refuses both headers together, as the front does
    (b"POST /t HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\n", "disagree"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n", "incomplete"),
    (b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", "disagree"),  # llhttp reads it, h11 not
])
def test_the_two_parsers_judge(data: bytes, kind: str) -> None:
    assert raw.judge(data)[0] == kind


def test_mutations_are_reproducible_from_the_seed() -> None:
    import random

    a = [raw.mutate(random.Random(7), s) for s in raw.SEEDS]
    b = [raw.mutate(random.Random(7), s) for s in raw.SEEDS]
    assert a == b and any(m != s for (m, _w), s in zip(a, raw.SEEDS, strict=True))


def test_shrinking_keeps_the_class_and_drops_the_rest() -> None:
    doc = {"prompt": "Hi there", "n_predict": 4, "messages": [{"role": 7, "content": "x"}],
           "x": [1, 2, 3]}

    def still(d: object) -> bool:
        msgs = d.get("messages") if isinstance(d, dict) else None
        return bool(msgs) and isinstance(msgs[0], dict) and isinstance(msgs[0].get("role"), int)

    assert campaign.shrink("/r", doc, "k", still) == {"messages": [{"role": 0}]}


def test_the_vendor_schemas_give_requests_for_every_route_both_ways() -> None:
    from hypothesis import HealthCheck, Phase

    from tests.fuzz import schema

    seen: set[tuple[str, str]] = set()

    @given(req=schema.requests())
    @settings(max_examples=150, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def draw(req: schema.Request) -> None:
        assert isinstance(req.body, bytes) and req.route in cases.BASE
        seen.add((req.route, req.mode))

    draw()
    assert {r for r, _ in seen} == {r for _, _, r in schema.OPERATIONS}
    assert {m for _, m in seen} == {"positive", "negative"}


def test_the_fault_oracle() -> None:
    from tests.fuzz.faults import Fault, check

    assert check(Fault(), 200, "complete") is None
    assert check(Fault(), 504, "complete") == "504 without a fault (none)"
    assert check(Fault("latency", 0, 0.1), 200, "error-event") is None
    assert check(Fault("cut", 60), None, "cut: RemoteProtocolError") is None
    assert check(Fault(), None, "cut: RemoteProtocolError") == "cut: RemoteProtocolError under none"
    assert check(Fault("reset", 0), 502, "complete") is None
    assert check(Fault("reset", 0), 500, "complete") == "500 under reset"
    assert check(Fault("stall", 5, 9), 200, "truncated") == (
        "a 200 answer framed complete but truncated under stall")


# --------------------------------------------------------------------------- on the real server


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, llama_server_bin: Path,
           demo_model: Path, monkeypatch_module: pytest.MonkeyPatch) -> Iterator[campaign.Target]:
    monkeypatch_module.setenv("MTPWRAP_BINARY", str(llama_server_bin))
    monkeypatch_module.setenv("MTPWRAP_DEMO_MODEL", str(demo_model))
    t = campaign.Target(tmp_path_factory.mktemp("fuzz-seeds"), threads=1)
    try:
        yield t
    finally:
        log = t.close()
        assert "Traceback" not in log


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.integration
@pytest.mark.parametrize("seed", CORPUS, ids=[s.name for s in CORPUS])
def test_seed_replays(target: campaign.Target, seed: seeds.Seed) -> None:
    r = target.client.post(seed.route, content=seed.body,
                           headers={"content-type": "application/json"})
    headers = {k.lower(): v for k, v in r.headers.items()}
    assert oracle.verdict(seed.route, r.status_code, headers, r.content) is None, r.text[:300]
    if seed.expect == "4xx":
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    elif seed.expect == "2xx":
        assert 200 <= r.status_code < 300, (r.status_code, r.text[:300])
    if seed.needle:
        assert seed.needle in r.text, r.text[:300]
    assert target.inst.ready(), "the front or llama-server is not ready after the seed"


@pytest.mark.integration
def test_the_front_keeps_its_promises_under_upstream_faults(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    """60 fixed-seed scenarios through the fault relay on the real llama-server (the campaign
    runs 300 and more with other seeds). The front's budget for a stalled stream is 3 s here
    (the campaign's is 6 s), so a long stall fault takes 4 s, not 7: the same scenarios, each
    stall still shorter or longer than the budget."""
    from tests.fuzz import faults

    with faults.rig(llama_server_bin, demo_model, tmp_path, stall_s=3.0) as r:
        done, bad = faults.run_scenarios(r, 60, seed=7)
        assert done == 60
        assert not bad, "\n".join(bad)
        relay = r.relay
    assert relay.open == 0, f"{relay.open} connections to llama-server left after the front"


@pytest.mark.integration
def test_the_front_keeps_its_promises_under_an_operators_faults(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path) -> None:
    """One case of each kind of tests/fuzz/operator.py, fixed seed, on `mtpwrap up` with the
    real llama-server: streams closed early on budgeted keys, a hung NVML, a reload and a
    restart under load (the campaign draws more). llama-server has one thread: with two, its
    workers spin at every barrier, and beside two busy processes a 48-token stream took 150 s."""
    from tests.fuzz import operator

    done, bad, kinds, log = operator.run_operator(tmp_path, llama_server_bin, demo_model,
                                                  len(operator.KINDS), seed=11, seconds=600,
                                                  threads=1)
    assert done == len(operator.KINDS)
    assert kinds == {"budget": 2, "nvml": 1, "reload": 1, "restart": 1}
    assert not bad, "\n".join(bad)
    assert "Traceback" not in log
    assert "reload ok: API keys" in log and "restart ok: llama-server restarted" in log


@pytest.mark.integration
@pytest.mark.slow
def test_the_campaign_smoke(tmp_path: Path, llama_server_bin: Path, demo_model: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`make fuzz` in about a minute with a fixed seed: every phase ran, nothing broken,
    nothing leaked. Each phase runs at its floor: one batch (the bodies two, 100 cases, all 13
    routes with this seed, when the first ends within their 13.6 s), the faults an operator's
    case and 10 s of relay scenarios. llama-server has one thread: robust on two busy cores."""
    monkeypatch.setenv("MTPWRAP_BINARY", str(llama_server_bin))
    monkeypatch.setenv("MTPWRAP_DEMO_MODEL", str(demo_model))
    report = campaign.run(tmp_path, seconds=40, n_bodies=2 * campaign.BATCH,
                          n_schema=campaign.BATCH, n_raw=10 * campaign.BATCH, n_faults=300,
                          seed=20261202, threads=1)
    print(campaign.describe(report))
    assert [p["name"] for p in report["phases"]] == ["seeds", "bodies", "schema", "raw", "faults"]
    assert all(p["tried"] > 0 for p in report["phases"]), campaign.describe(report)
    assert campaign.failures(report) == [], campaign.describe(report)
