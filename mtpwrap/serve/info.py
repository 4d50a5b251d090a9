"""What a launch tells the front, /healthz, the state file and `up`'s summary about itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServeInfo:
    """Static facts of one launch (a reload brings a new one)."""

    profile: str
    profile_reason: str = ""
    binary: str = ""
    commit: str | None = None
    model: str = ""
    context: int | None = None
    kv: str = ""  # "K type / V type"
    speculation: str = "none"
    #: the memory plan leaves the GPU near its edge (the supervisor then steps down on OOM)
    near_edge: bool = False
    memory_plan: str | None = None
    #: the profile's speculation and whether the binary honours a request's own draft depth
    #: (spec_policy.launch_info); None when the launch does not speculate
    spec_policy: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, for /healthz and the state file."""
        return dataclasses.asdict(self)
