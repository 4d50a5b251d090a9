"""Does a llama-server honour a request's own draft depth (`speculative.n_max`)?

Upstream llama.cpp at the pinned commit ignores the field (it is compiled out); the patch set's
0001 patch parses it again. The probe starts the binary with the model as its own draft (every
draft is accepted, so drafting certainly happens), asks once without the field and once with
`"speculative.n_max": 0`, and compares the responses' `timings.draft_n`:

- honoured: drafts without the field, none with n_max 0;
- ignored:  drafts in both;
- unknown:  no drafts even without the field, or the binary could not be asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpwrap.build import trial
from mtpwrap.build.probe import probe as probe_help
from mtpwrap.decide import launch
from mtpwrap.errors import MtpwrapError

if TYPE_CHECKING:
    import httpx

    from mtpwrap.decide.launch import LaunchConfig

PROMPT = ("Article 1 (Purpose) The purpose of this Act is to protect the rights of tenants. "
          "Article 2 (Definitions) In this Act,")
N_PREDICT = 24


def launch_config(model: Path, gpu: bool) -> LaunchConfig:
    """One slot, a short context, the model drafting for itself, every draft kept (`p_min` 0:
    the fork's default of 0.75 keeps none from a small model, and the probe would learn
    nothing), one thread (a self-draft is bit-exact on one, and it spins on no shared core)."""
    return launch.plain(model, context=1024, gpu_layers=99 if gpu else 0, spec="draft", threads=1,
                        spec_type="draft-simple", depth=4, draft_model=str(model), p_min=0.0,
                        why="draft-depth probe")


def draft_counts(client: httpx.Client, extra: dict[str, Any], timeout: float = 120.0
                 ) -> tuple[int, int]:
    """(timings.draft_n, timings.predicted_n) of one greedy /completion with `extra` merged in,
    asked through `client` (the one upstream client, bound to the server)."""
    body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0.0,
            "cache_prompt": False, **extra}
    r = client.post("/completion", json=body, timeout=timeout)
    r.raise_for_status()
    timings = r.json().get("timings") or {}
    return int(timings.get("draft_n", 0)), int(timings.get("predicted_n", 0))


def verdict(default_draft_n: int, zero_draft_n: int) -> str:
    if default_draft_n <= 0:
        return "unknown"
    return "honoured" if zero_draft_n == 0 else "ignored"


def probe(binary: Path, model: Path, *, gpu: bool = False, timeout: float = 180.0
          ) -> dict[str, Any]:
    """{"status": honoured | ignored | unknown, "detail": one sentence, "draft_n": {...}};
    never raises for the binary's own failures."""
    try:
        with trial.running(launch_config(model, gpu), probe_help(binary), binary=binary,
                           timeout=timeout, what="llama-server (draft-depth probe)") as srv, \
                srv.client(timeout=120.0) as client:
            default, _ = draft_counts(client, {})
            zero, _ = draft_counts(client, {"speculative.n_max": 0})
    except (MtpwrapError, OSError, ValueError) as exc:
        return {"status": "unknown", "detail": f"the probe could not run: {exc}"}
    except Exception as exc:
        return {"status": "unknown", "detail": f"the probe request failed: {exc}"}
    status = verdict(default, zero)
    detail = {
        "honoured": f"speculative.n_max 0 drafted nothing ({default} drafted without it)",
        "ignored": f"speculative.n_max 0 still drafted {zero} tokens ({default} without it)",
        "unknown": "the model drafted nothing even without the field",
    }[status]
    return {"status": status, "detail": detail,
            "draft_n": {"default": default, "n_max_0": zero}, "model": str(model)}
