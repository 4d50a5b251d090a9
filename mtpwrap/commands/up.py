"""`mtpwrap up` (first form: the cpu-demo profile in the foreground)."""

from __future__ import annotations

import signal
import subprocess
import sys

import click

DEMO_ARGS = ["-c", "4096", "-np", "2", "--metrics", "--no-webui"]


@click.command("up")
@click.option(
    "--profile",
    envvar="MTPWRAP_PROFILE",
    default="cpu-demo",
    show_default=True,
    help="Profile to run.",
)
@click.option(
    "--model",
    envvar="MTPWRAP_MODEL",
    default=None,
    help="Model file (default: the profile's model).",
)
@click.option("--host", envvar="MTPWRAP_HOST", default="127.0.0.1", show_default=True)
@click.option(
    "--port", envvar="MTPWRAP_PORT", type=click.IntRange(1, 65535), default=8080, show_default=True
)
def command(profile: str, model: str | None, host: str, port: int) -> None:
    """Run llama-server for a profile in the foreground; Ctrl-C stops it cleanly."""
    from mtpwrap import build, console, models
    from mtpwrap.errors import ConfigError

    if profile != "cpu-demo":
        raise ConfigError(f"--profile {profile}: unknown profile; available: cpu-demo.")
    model_path = models.resolve_model(model) if model else models.ensure_demo_model()
    binary = build.find_binary()
    argv = [str(binary), "-m", str(model_path), "--host", host, "--port", str(port), *DEMO_ARGS]
    console.info(f"serving {model_path.name} at http://{host}:{port}/v1 (Ctrl-C stops)")
    proc = subprocess.Popen(argv, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    sys.exit(0 if rc in (0, -signal.SIGTERM) else 1)
