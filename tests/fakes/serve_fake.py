"""Run mtpwrap's `up` loop (mtpwrap.service.server.Service) over the fake llama-server.

Usage: python -m tests.fakes.serve_fake PORT   (faults from FAKE_LLAMA_FAULTS, settings from
MTPWRAP_* variables). The profile machinery is bypassed on purpose: this exercises the
supervisor, the front, signals, sd_notify and the state file, not argv building.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mtpwrap.config import settings
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.front import loop as event_loop
from mtpwrap.front.info import ServeInfo
from mtpwrap.service import startup, up
from mtpwrap.service.server import bind_public, serve
from mtpwrap.supervision.child import ChildCommand

FAKE = Path(__file__).resolve().parent / "fake_llama_server.py"


def main() -> int:
    s = settings.load_settings({"port": sys.argv[1]}, config=os.environ.get("MTPWRAP_CONFIG"))

    def factory(endpoint: Endpoint, api_key: str, step: int) -> ChildCommand | None:
        return ChildCommand([sys.executable, str(FAKE), "--host", "127.0.0.1", "--port",
                          str(endpoint.port)],
                         env={"LLAMA_API_KEY": api_key})

    runtime = startup.Runtime(
        settings=s, info=ServeInfo(profile="fake", model="fake.gguf", binary=str(FAKE)),
        supervisor=startup.supervisor_config(s), front=startup.proxy_config(s, {}, 1),
        exit_on_failed=s.supervisor["exit_on_failed"], command=factory)
    up.configure_logging("info")
    sock = bind_public(s.host, s.port)
    return event_loop.run(serve(runtime, sock))


if __name__ == "__main__":
    sys.exit(main())
