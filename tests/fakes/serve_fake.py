"""Run mtpwrap's `up` service loop (service.serve) over the fake llama-server.

Usage: python -m tests.fakes.serve_fake PORT   (faults from FAKE_LLAMA_FAULTS, settings from
MTPWRAP_* variables). The profile machinery is bypassed on purpose: this exercises the
supervisor, the front, signals, sd_notify and the state file, not argv building.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from mtpwrap.config import settings
from mtpwrap.run import service
from mtpwrap.run.child import ChildSpec

FAKE = Path(__file__).resolve().parent / "fake_llama_server.py"


def main() -> int:
    s = settings.load_settings({"port": sys.argv[1]}, config=os.environ.get("MTPWRAP_CONFIG"))

    def factory(port: int, api_key: str, step: int) -> ChildSpec | None:
        return ChildSpec([sys.executable, str(FAKE), "--host", "127.0.0.1", "--port", str(port)],
                         env={"LLAMA_API_KEY": api_key})

    launch = service.Launch(factory=factory, info={"profile": "fake", "model": "fake.gguf",
                                                  "binary": str(FAKE)})
    service._configure_logging("info")
    sock = service.bind_public(s.host, s.port)
    return asyncio.run(service.serve(s, launch, sock))


if __name__ == "__main__":
    sys.exit(main())
