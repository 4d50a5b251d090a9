"""What a launch tells the front, /healthz, the state file and `up`'s summary about itself.

`ServeInfo` is built once per launch by the service that starts llama-server (and again after a
reload); the front, `/healthz` and the draft-depth policy read its fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtpwrap.decide.profile_types import Speculation

#: what `build/spec_probe` says of a binary and a request's own `speculative.n_max`
PER_REQUEST_DEPTH = ("honoured", "ignored", "unknown")


@dataclass(frozen=True)
class ServeInfo:
    """Static facts of one launch (a reload brings a new one)."""

    profile: str | None = None
    profile_reason: str | None = None
    #: the llama-server executable and the source commit it was built from
    binary: str | None = None
    commit: str | None = None
    model: str | None = None
    context: int | None = None
    #: the model's vocabulary size (its GGUF header): token ids at or past it are refused
    n_vocab: int | None = None
    #: the KV cache types as rendered, "K / V"
    kv: str | None = None
    #: the rendered `--spec-type` ("none" when the launch does not speculate)
    speculation_type: str = "none"
    #: the profile's `spec:` section; None or kind "none" when it does not speculate
    speculation: Speculation | None = None
    #: whether the binary honours a request's own draft depth (one of PER_REQUEST_DEPTH) and
    #: what the probe showed
    per_request_depth: str = "unknown"
    per_request_depth_detail: str = ""
    #: the plan leaves the device near its edge (out-of-memory starts are likely)
    near_edge: bool = False
    memory_plan: str | None = None
    #: llama-server's full log
    log_file: str | None = None
    #: whether llama-server serves its own web UI, and why, as `mtpwrap build` recorded it
    #: (None: not recorded)
    webui: bool | None = None
    webui_why: str = ""
    #: how the front reaches llama-server ("unix" socket or loopback "tcp"), and why
    upstream: str = "tcp"
    upstream_why: str = ""
    #: what the build lacks for want of a patch not written for its source, one sentence each
    #: (build.manifest.Manifest.lacks)
    lacks: tuple[str, ...] = ()
    #: how documents stay warm under this launch (decide.documents.DocumentPlan.to_dict):
    #: the RAM cache, how many full-context documents it holds, the checkpoints
    documents: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.per_request_depth not in PER_REQUEST_DEPTH:
            object.__setattr__(self, "per_request_depth", "unknown")

    @property
    def speculates(self) -> bool:
        return self.speculation is not None and self.speculation.kind not in ("none", "")
