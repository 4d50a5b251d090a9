"""A long document asked many times, through `mtpwrap up` and the official `openai` client, on
the tiny hybrid qwen35 model with its MTP head (the flagship's architecture: recurrent layers,
so llama-server reuses a prompt only back to a context checkpoint). A second question re-reads at
most the checkpoint spacing of the document (1,024 tokens, or 2 % of it), whether it comes in
the document's message after a long question, in its own message, after other users' documents,
after `mtpwrap reload`, after `mtpwrap restart` and after llama-server was killed.

"read" is llama-server's own `timings.prompt_n` of the answer: the tokens it computed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.helpers import Instance, run_cli, tiny_hybrid_profile, wait_for

pytestmark = pytest.mark.integration

#: what a new question may re-read of its document: the plan's checkpoint spacing
REREAD = 1024
#: a short question and the chat template around it
QUESTION = 96


def document(name: str, clauses: int = 200) -> str:
    """About 8K tokens of contract, different for each name."""
    return " ".join(f"{name} clause {i}: the party of part {i % 5} shall deliver item {i * 7} "
                    f"by day {i % 28 + 1}." for i in range(clauses))


#: 2K tokens of instructions: longer than llama-server's own checkpoints near the prompt's end
LONG = " ".join(f"Instruction {i}: answer carefully, cite the clause and its part."
                for i in range(160))


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tiny_hybrid_profile(tmp_path_factory.mktemp("documents"), "tiny-documents")
    yield path
    Path(yaml.safe_load(path.read_text())["model"]).unlink()


class Up(Instance):
    def __init__(self, tmp: Path, port: int, binary: Path, profile: Path, **env: str) -> None:
        model = Path(yaml.safe_load(profile.read_text())["model"])
        tmp.mkdir(parents=True, exist_ok=True)
        super().__init__(tmp / "home", port, binary, model, log=tmp / "up.log",
                         profile=str(profile), **env)
        self.wait_ready(180)
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused",
                                    max_retries=0, timeout=300)

    def ask(self, messages: list[dict[str, str]]) -> tuple[int, int]:
        """(read, tokens of the prompt) of one answer, from llama-server's own timings."""
        r = self.client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                max_tokens=1, temperature=0)
        timings = (r.model_extra or {})["timings"]
        assert r.usage is not None
        return int(timings["prompt_n"]), int(r.usage.prompt_tokens)

    def state(self) -> dict:
        return json.loads((self.home / "state" / "instance.json").read_text())


def same(doc: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{doc}\n\nQuestion: {question}"}]


def separate(doc: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": doc}, {"role": "user", "content": question}]


def bound(doc_tokens: int) -> int:
    return max(REREAD, doc_tokens // 50) + QUESTION


@pytest.fixture
def up(tmp_path: Path, free_port: int, llama_server_bin: Path, profile: Path) -> Iterator[Up]:
    u = Up(tmp_path, free_port, llama_server_bin, profile)
    try:
        yield u
    finally:
        u.close()


def test_a_new_question_reads_the_question_not_the_document(up: Up) -> None:
    """The document's own message, after a long question (whose checkpoints llama-server
    places inside the question); then the document as a message of its own. The launch says
    how documents stay warm, and llama-server was told it."""
    for page in ("healthz", "status.json"):
        said = httpx.get(f"{up.base}/{page}", timeout=30).json()["documents"]
        assert said["min_step"] == REREAD and said["checkpoints"] >= 8, said
        assert "full-context document(s) of 32,768 tokens" in said["summary"], said
        # this build's checkpoints leave the MTP context's KV out (patch 0003): none grows
        assert "carries the MTP context's KV" not in said["why"]["checkpoints"], said
    assert up.log is not None and "documents    RAM cache" in up.log.read_text()
    argv = Path(f"/proc/{up.state()['child_pid']}/cmdline").read_text().split("\0")

    def value(*spellings: str) -> str:
        (i,) = [argv.index(s) for s in spellings if s in argv]
        return argv[i + 1]

    # a checkpoint every 1,024 tokens of a read (patch 0002's flag); upstream's minimum spacing
    # keeps its default and its meaning
    assert value("-cpent", "--checkpoint-every-n-tokens") == "1024"
    assert "-cms" not in argv and "--checkpoint-min-step" not in argv
    assert value("--cache-reuse") == "0"
    assert value("-ctxcp", "--ctx-checkpoints") == str(said["checkpoints"])
    assert int(value("-cram", "--cache-ram")) > 1024
    # what runs is shown as it runs: the state file, `status`, `args --running`, /healthz (an
    # admin's, and with no keys everyone local is one)
    running = json.loads(run_cli("args", "--running", "--json", env=up.env).stdout)
    assert running["argv"] == argv[:-1]  # /proc's cmdline ends with a NUL
    assert any(d.startswith("--cache-ram") or d.startswith("-cram") for d in
               running["decisions"]), running["decisions"]
    assert "***" in running["env"].values()  # the internal key is never shown
    assert httpx.get(f"{up.base}/healthz", timeout=30).json()["command"] == running
    assert "llama-server runs" in run_cli("status", env=up.env).stdout
    a = document("Alpha")
    read, tokens = up.ask(same(a, LONG + " Which clause names day 9?"))
    doc_tokens = tokens - 2100
    assert read >= tokens - 8 and doc_tokens > 6000, (read, tokens)
    for q in ("Who delivers item 70?", "What is due on day 3?"):
        read, tokens = up.ask(same(a, q))
        assert read <= bound(doc_tokens), (q, read, tokens)
    read, _ = up.ask(separate(a, "Name the last clause."))
    assert read <= bound(doc_tokens), read
    read, _ = up.ask(separate(a, "Name the first clause."))
    assert read <= QUESTION, read


def test_three_users_three_documents_round_robin(up: Up) -> None:
    """One slot: each document leaves it for llama-server's RAM cache (sized by the plan)
    and comes back with its checkpoints."""
    docs = {n: document(n) for n in ("Alpha", "Bravo", "Charlie")}
    sizes = {}
    for n, d in docs.items():
        read, tokens = up.ask(same(d, LONG + " Which clause names day 9?"))
        assert read >= tokens - 8
        sizes[n] = tokens - 2100
    for rnd in range(2):
        for n, d in docs.items():
            read, _ = up.ask(same(d, f"Round {rnd}: what does part {rnd + 1} deliver?"))
            assert read <= bound(sizes[n]), (rnd, n, read)


def test_an_edit_of_an_early_turn_of_a_long_chat_re_reads_from_that_turn(up: Up) -> None:
    """A chat that grew past the span of llama-server's checkpoints (11 × 1,024 tokens), then
    an edit of its third turn: llama-server cannot cut its slot back that far (a hybrid model
    rewinds only to a checkpoint), so the front restores the kept state of the chat that ends
    nearest after that turn, and the edit re-reads from the turn, not from token 0."""
    turns = [document(f"Turn{i}", clauses=70) for i in range(6)]  # about 2.9K tokens each
    messages: list[dict[str, str]] = []
    for t in turns:
        messages.append({"role": "user", "content": t})
        read, tokens = up.ask(messages)
        messages.append({"role": "assistant", "content": "Noted."})
    assert tokens > 16000, tokens  # past the checkpoints' span
    # the third turn edited, with 12K tokens of chat after it
    edited = [*messages[:4], {"role": "user", "content": document("Edited", 70)}]
    read, total = up.ask(edited)
    _, kept = up.ask(messages[:3])  # what the edit keeps: the first two turns
    assert read <= total - kept + REREAD + QUESTION, (read, total, kept)


def test_every_document_read_survives_restart_reload_and_a_crash(up: Up, profile: Path) -> None:
    """Three documents asked in turn (one slot: the first two leave it), then `restart`, a
    `reload` that changes llama-server's command line, and SIGKILL of llama-server: after each,
    a new question on every document re-reads at most the checkpoint spacing of it. Each was
    kept on disk once, and goes back into the slot before its question (the audit says so)."""
    docs = {n: document(n) for n in ("Alpha", "Bravo", "Charlie")}
    sizes = {}
    for n, d in docs.items():
        read, tokens = up.ask(same(d, "Which clause names day 9?"))
        assert read >= tokens - 8
        sizes[n] = tokens
    listed = json.loads(run_cli("documents", "list", "--json", env=up.env).stdout)
    assert len(listed["kept"]) == 3, listed
    assert {e["tokens"] for e in listed["kept"]} <= set(range(6000, 10000))
    assert "clause 17" not in json.dumps(listed)

    def each(step: str) -> None:
        for n, d in docs.items():
            read, _ = up.ask(same(d, f"{step}: what does part 2 deliver?"))
            assert read <= bound(sizes[n]), (step, n, read)

    r = run_cli("restart", env=up.env, timeout=240)
    assert r.returncode == 0, r.output
    each("After a restart")

    text = profile.read_text()
    profile.write_text(text.replace("threads: 1", "threads: 2"))  # another command line
    try:
        r = run_cli("reload", env=up.env, timeout=240)
    finally:
        profile.write_text(text)
    assert r.returncode == 0, r.output
    argv = Path(f"/proc/{up.state()['child_pid']}/cmdline").read_bytes().split(b"\0")
    flag = b"-t" if b"-t" in argv else b"--threads"
    assert argv[argv.index(flag) + 1] == b"2", argv
    each("After a reload")

    crash(up)
    each("After a crash")
    # kept once each (a question adds no state), restored before each question above
    assert len(json.loads(run_cli("documents", "list", "--json", env=up.env).stdout)["kept"]) \
        == 3
    assert httpx.get(f"{up.base}/healthz", timeout=30).json()["store"]["restored"] == 9
    page = httpx.get(f"{up.base}/status.json", timeout=30).json()["store"]
    assert (page["states"], page["saved"]) == (3, 3), page  # each kept once, before the restart
    directory = Path(up.state()["persist_dir"])
    files = sorted(p.name for p in directory.iterdir())
    assert sum(f.endswith(".ckpt") for f in files) == 3, files  # the checkpoints went with it
    assert directory.stat().st_mode & 0o777 == 0o700
    for p in directory.iterdir():
        assert p.stat().st_mode & 0o777 == 0o600, p


def test_a_sliding_window_model_keeps_its_document_across_a_restart(
        tmp_path: Path, free_port: int, llama_server_bin: Path) -> None:
    """The same on gemma-3-270m (sliding-window attention: reuse goes back to a checkpoint
    too): after `mtpwrap restart`, a new question re-reads at most the checkpoint spacing."""
    from mtpwrap.models import known

    model = known.ensure(known.GEMMA)
    gemma = tmp_path / "gemma-documents.yaml"
    gemma.write_text(yaml.safe_dump({
        "name": "gemma-documents", "description": "gemma-3-270m, 16K context, one slot",
        "hardware": {"requires_gpu": False}, "model": str(model), "context": 16384,
        "kv": {"k": ["f16"], "v": ["f16"]}, "spec": {"kind": "none"}, "gpu_layers": 0,
        "slots": 1, "threads": 1}))
    # The store keeps documents of a checkpoint spacing or more (not 4,096 tokens, its default):
    # a ~2K-token document is one it keeps, and one whose whole re-read is well past the bound.
    # Each gemma read of it costs this CPU seconds: no longer.
    up = Up(tmp_path / "gemma", free_port, llama_server_bin, gemma,
            MTPWRAP_PERSIST_MIN_TOKENS=str(REREAD))
    try:
        a = document("Alpha", clauses=80)
        read, tokens = up.ask(same(a, "Which clause names day 9?"))
        # its tokenizer's count: past the store's minimum, and a whole re-read past the bound
        assert read >= tokens - 8 and tokens > 1.5 * bound(tokens), (read, tokens)
        r = run_cli("restart", env=up.env, timeout=240)
        assert r.returncode == 0, r.output
        read, _ = up.ask(same(a, "Who delivers item 70?"))
        assert read <= bound(tokens), read
        assert httpx.get(f"{up.base}/healthz", timeout=30).json()["store"]["restored"] == 1
    finally:
        up.close()


def test_a_document_read_on_one_node_is_restored_on_another(
        tmp_path: Path, free_port: int, llama_server_bin: Path, profile: Path) -> None:
    """Two nodes on one shared store (one directory, as a network mount gives several
    machines): a document read on the first re-reads at most its checkpoint spacing on the
    second, which never read it."""
    import socket

    shared = tmp_path / "shared-store"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        other_port = s.getsockname()[1]
    one = Up(tmp_path / "one", free_port, llama_server_bin, profile,
             MTPWRAP_PERSIST_DIR=str(shared))
    two = None
    try:
        two = Up(tmp_path / "two", other_port, llama_server_bin, profile,
                 MTPWRAP_PERSIST_DIR=str(shared))
        a = document("Alpha")
        read, tokens = one.ask(same(a, "Which clause names day 9?"))
        assert read >= tokens - 8
        # kept once its answer has gone out (the node's next request waits for it)
        wait_for("the first node's state kept", lambda: json.loads(run_cli(
            "documents", "list", "--json", env=two.env).stdout)["kept"], 60)
        read, _ = two.ask(same(a, "Who delivers item 70?"))
        assert read <= bound(tokens), read
        b = document("Bravo")  # and one no node read is read whole
        read, tokens = two.ask(same(b, "Who delivers item 70?"))
        assert read >= tokens - 8
    finally:
        one.close()
        if two is not None:
            two.close()


def crash(up: Up) -> None:
    """SIGKILL to llama-server; back when the supervisor has a new one ready."""
    child = up.state()["child_pid"]
    os.kill(child, signal.SIGKILL)
    wait_for("llama-server back", lambda: up.state().get("child_pid") not in (None, child)
             and up.state().get("state") == "ready", 180)


def test_warm_ahead_list_and_forget(up: Up, tmp_path: Path) -> None:
    """An operator reads tomorrow's contracts in ahead (at the batch class), lists what is
    warm (never the text) and forgets every document."""
    files = []
    for n in ("Alpha", "Bravo"):
        f = tmp_path / f"{n.lower()}-contract.txt"
        f.write_text(document(n))
        files.append(f)
    r = run_cli("documents", "warm", *map(str, files), env=up.env, timeout=300)
    assert r.returncode == 0, r.output
    listed = json.loads(run_cli("documents", "list", "--json", env=up.env).stdout)
    assert [e["name"] for e in listed["warmed"]] == ["alpha-contract.txt", "bravo-contract.txt"]
    assert all(e["tokens"] > 6000 and len(e["sha256"]) == 64 for e in listed["warmed"])
    assert "clause 17" not in json.dumps(listed)
    page = httpx.get(f"{up.base}/status.json", timeout=30).json()["warmed"]
    assert [(w["name"], w["tokens"]) for w in page] == [
        (e["name"], e["tokens"]) for e in listed["warmed"]]
    for n in ("Alpha", "Bravo"):  # the first question finds its document read
        read, tokens = up.ask(same(document(n), "Who delivers item 70?"))
        assert read <= bound(tokens), (n, read, tokens)

    # a class that is not one is the client's mistake, said in one sentence
    bad = httpx.post(f"{up.base}/v1/chat/completions", timeout=30,
                     headers={"x-mtpwrap-class": "urgent"},
                     json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert bad.status_code == 400 and "X-Mtpwrap-Class: expected one of interactive, batch" \
        in bad.json()["error"]["message"]

    child = up.state()["child_pid"]
    r = run_cli("documents", "forget", "--all", env=up.env, timeout=300)
    assert r.returncode == 0, r.output
    assert "cold" in r.output and up.state()["child_pid"] != child
    directory = Path(up.state()["persist_dir"])
    assert not list(directory.iterdir())
    listed = json.loads(run_cli("documents", "list", "--json", env=up.env).stdout)
    assert listed["warmed"] == [] and listed["kept"] == []
    assert httpx.get(f"{up.base}/status.json", timeout=30).json()["warmed"] == []
    read, tokens = up.ask(same(document("Alpha"), "Who delivers item 70?"))
    assert read >= tokens - 8, (read, tokens)  # forgotten: read again from the start


def test_a_person_queued_behind_a_long_read_is_told_how_long(
        tmp_path: Path, free_port: int, llama_server_bin: Path, profile: Path) -> None:
    """One slot, a ~26K-token document being read: the status page shows the read (tokens
    done of total, rate, time left), and a question queued behind it that waits out its queue
    time gets a 503 saying how far the read is, with Retry-After from the read's progress. A
    read longer than prefill_stall_s (5 s here: longer than one step of the read on a loaded
    2-core machine, about 3 s) is not cut while it advances."""
    u = Up.__new__(Up)
    Instance.__init__(u, tmp_path / "home", free_port, llama_server_bin,
                      Path(yaml.safe_load(profile.read_text())["model"]), log=tmp_path / "up.log",
                      profile=str(profile), MTPWRAP_PROXY_QUEUE_TIMEOUT_S="1",
                      MTPWRAP_PROXY_PREFILL_STALL_S="5")
    try:
        u.wait_ready(180)
        u.client = openai.OpenAI(base_url=f"{u.base}/v1", api_key="unused", max_retries=0,
                                 timeout=600)
        long_doc = document("Long", 600)
        outcome: dict[str, object] = {}

        def read() -> None:
            t0 = time.monotonic()
            outcome["answer"] = u.ask(same(long_doc, "Which clause names day 9?"))
            outcome["took"] = time.monotonic() - t0

        reader = threading.Thread(target=read)
        reader.start()
        seen: list[dict] = []

        def a_read_with_a_rate() -> bool:
            reads = httpx.get(f"{u.base}/status.json", timeout=30).json()["reads"]
            seen.extend(reads)
            return bool(reads) and reads[0]["rate"] is not None \
                and reads[0]["eta_s"] is not None
        wait_for("a read with its rate on the status page", a_read_with_a_rate, 120, every=0.5)
        r = httpx.post(f"{u.base}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2})
        still_reading = reader.is_alive()
        reader.join(600)
        read_n, tokens = outcome["answer"]  # type: ignore[misc]
        last = seen[-1]
        assert last["total"] == tokens and 0 < last["done"] < tokens, (last, tokens)
        assert last["rate"] > 0 and last["eta_s"] > 0
        assert still_reading, "the read ended within the queue time: a longer document"
        assert outcome["took"] > 5, "the read was shorter than the stall budget: a longer one"  # type: ignore[operator]
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "llama-server is reading a prompt (" in message and f"of {tokens:,}" in message
        assert "retry in about" in message and 1 <= int(r.headers["retry-after"]) <= 600
    finally:
        u.close()
