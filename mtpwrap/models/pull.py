"""`models pull`: GGUF files from a Hugging Face hub (or a company's mirror of one, `HF_ENDPOINT`)
through the `huggingface_hub` library.

The revision is pinned first (the repository's listing with its LFS metadata: size and sha256 of
every file), then each file is fetched with the library's own resolve / HEAD / ranged-GET code into
a hidden partial file named after its sha256 beside the final name. A cut connection is resumed by
the library within the run; a run that ends early leaves the partial file, and the next run resumes
it with a Range request. A file gets its final name only after its bytes matched the hub's sha256
and it reads as a GGUF; a split GGUF (`-00001-of-00003`) gets its names only when every part has.
The hub's Xet transfer (`hf_xet`) is not used: every byte comes over HTTP ranges, which is the
path that resumes and the one the tests exercise.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from mtpwrap import paths
from mtpwrap.decide.gguf_facts import SPLIT
from mtpwrap.errors import ConfigError, IntegrityError, RuntimeFailure
from mtpwrap.hashing import sha256_file
from mtpwrap.models.progress import Report

DEFAULT_ENDPOINT = "https://huggingface.co"
GGUF_MAGIC = b"GGUF"
TRANSFER = "HTTP ranges through huggingface_hub (hf_xet not used)"


@dataclass(frozen=True)
class RemoteFile:
    path: str  # inside the repository
    size: int | None
    sha256: str | None  # the hub's LFS metadata; None for a file kept in git itself

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name


@dataclass(frozen=True)
class Pulled:
    repo: str
    revision: str
    endpoint: str
    files: tuple[Path, ...]

    @property
    def model(self) -> Path:
        """The path to give `--model` (the first part of a split set)."""
        return self.files[0]


def record_path(file: Path) -> Path:
    """The small JSON record beside a pulled file (also what `models import` verifies by)."""
    return file.with_name(file.name + ".json")


def partial_path(dest: Path, f: RemoteFile) -> Path:
    return dest / f".{f.name}.{(f.sha256 or 'nosha')[:16]}.part"


def public_endpoint(endpoint: str) -> str:
    """The endpoint without any user:password a mirror's URL may carry."""
    parts = urlsplit(endpoint)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit((parts.scheme, netloc, parts.path, "", "")).rstrip("/")


# --------------------------------------------------------------------------- choosing files


def _set_label(path: str) -> str:
    m = SPLIT.match(path)
    return f"{m['stem']}-*-of-{m['n']}.gguf" if m else path


def gguf_sets(files: Sequence[RemoteFile]) -> dict[str, list[RemoteFile]]:
    """GGUF files grouped so that the parts of one split model are one entry."""
    sets: dict[str, list[RemoteFile]] = {}
    for f in sorted(files, key=lambda f: f.path):
        if f.path.endswith(".gguf"):
            sets.setdefault(_set_label(f.path), []).append(f)
    return sets


def _complete(label: str, parts: list[RemoteFile], where: str) -> list[RemoteFile]:
    m = SPLIT.match(parts[0].path)
    if m and len(parts) != int(m["n"]):
        raise ConfigError(f"{where}: the split model {label} lists {len(parts)} of its "
                          f"{int(m['n'])} parts.", hint="The repository is incomplete at this "
                          "revision; pick another file or revision.")
    return parts


def choose(files: Sequence[RemoteFile], selector: str | None, where: str) -> list[RemoteFile]:
    """The files `selector` names: a file (its whole split set), a quantisation such as
    Q4_K_M, or nothing when the repository holds one GGUF model."""
    sets = gguf_sets(files)
    shown = ", ".join(list(sets)[:12]) + (" …" if len(sets) > 12 else "")
    if selector and selector.endswith(".gguf"):
        for label, parts in sets.items():
            if any(selector in (p.path, p.name) for p in parts):
                return _complete(label, parts, where)
        raise ConfigError(f"{where} has no GGUF file {selector} (it has: {shown or 'none'}).")
    if selector and "." in selector:
        raise ConfigError(f"{where}: {selector} is not a GGUF file; mtpwrap serves .gguf files.",
                          hint="Name a .gguf file or a quantisation such as Q4_K_M.")
    if not sets:
        raise ConfigError(f"{where} holds no GGUF file.",
                          hint="Pick a repository with GGUF files (names ending in .gguf).")
    if selector:
        pat = re.compile(rf"(?<![A-Za-z0-9]){re.escape(selector)}(?![A-Za-z0-9])", re.I)
        hits = {k: v for k, v in sets.items() if pat.search(PurePosixPath(k).name)}
    else:
        hits = sets
    if len(hits) == 1:
        label, parts = next(iter(hits.items()))
        return _complete(label, parts, where)
    if not hits:
        raise ConfigError(f"{where} has no GGUF file for {selector} (it has: {shown}).")
    what = f"{len(hits)} GGUF models match {selector}" if selector else f"{len(hits)} GGUF models"
    raise ConfigError(f"{where}: {what} ({', '.join(list(hits)[:12])}); name one.",
                      hint="Give the file name or a quantisation such as Q4_K_M.")


# --------------------------------------------------------------------------- the hub


def hub_token(token_file: Path | None) -> str | None:
    """The token from `--token-file`, else `HF_TOKEN`, else the file `hf auth login` wrote."""
    if token_file is not None:
        try:
            text = token_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {token_file}: cannot read it ({exc.strerror}).") \
                from None
        if not text:
            raise ConfigError(f"--token-file {token_file}: the file is empty.")
        return text
    from huggingface_hub import get_token

    return get_token()


@contextlib.contextmanager
def hub_errors(repo: str, endpoint: str, revision: str) -> Iterator[None]:
    """The library's exceptions as one sentence each (never with a header or token)."""
    import httpx2  # huggingface_hub's HTTP client: its transport errors come through unwrapped
    from huggingface_hub import errors as hf

    at = public_endpoint(endpoint)
    token_hint = "Give a token in HF_TOKEN or --token-file."
    try:
        yield
    except hf.GatedRepoError:
        raise ConfigError(f"{repo} on {at} is gated: accept its terms on the hub with your "
                          "account first.", hint=token_hint) from None
    except hf.RepositoryNotFoundError:
        raise ConfigError(f"{repo}: no such repository on {at}, or it is private.",
                          hint=token_hint) from None
    except hf.RevisionNotFoundError:
        raise ConfigError(f"{repo} on {at} has no revision {revision}.") from None
    except hf.RemoteEntryNotFoundError as exc:
        raise ConfigError(f"{repo}@{revision} on {at}: a listed file is missing "
                          f"({exc.response.url.path}).") from None
    except hf.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "an error"
        raise RuntimeFailure(f"the hub at {at} answered {status} for {repo}.",
                             hint="Try again later, or check HF_ENDPOINT.") from None
    except (httpx2.TransportError, hf.OfflineModeIsEnabled) as exc:
        raise RuntimeFailure(f"cannot reach the hub at {at} ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else 'no answer'}).",
                             hint="Check the network, a proxy, or HF_ENDPOINT; a partial "
                                  "download is kept and the same command resumes it.") from None


def list_files(repo: str, revision: str, endpoint: str,
               token: str | None) -> tuple[str, list[RemoteFile]]:
    """(commit, files) of the repository at `revision`, with the hub's LFS size and sha256."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint, token=token or False).model_info(
        repo, revision=revision, files_metadata=True)
    if not info.sha:
        raise RuntimeFailure(f"{public_endpoint(endpoint)} named no commit for {repo}@{revision}; "
                             "it does not answer like a Hugging Face hub.",
                             hint="Check HF_ENDPOINT.")
    files = [RemoteFile(s.rfilename, s.lfs.size if s.lfs else s.size,
                        s.lfs.sha256 if s.lfs else None) for s in info.siblings or []]
    return info.sha, files


def _same_origin(a: str, b: str) -> bool:
    pa, pb = urlsplit(a), urlsplit(b)
    return (pa.scheme, pa.hostname, pa.port) == (pb.scheme, pb.hostname, pb.port)


def locate(repo: str, commit: str, f: RemoteFile, endpoint: str,
           token: str | None) -> tuple[str, dict[str, str]]:
    """The URL the file's bytes come from and the headers to send there, from the library's
    HEAD on `resolve` (cross-checked against the listing's LFS metadata)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, f.path, revision=commit, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token or False, endpoint=endpoint)
    where = f"{repo}@{commit[:12]} {f.path}"
    if meta.etag and re.fullmatch(r"[0-9a-f]{64}", meta.etag) and meta.etag != f.sha256:
        raise IntegrityError(f"{where}: the hub's file header names sha256 {meta.etag}, its "
                             f"listing {f.sha256}.", hint="The mirror is inconsistent; ask its "
                             "operators, or pull from another endpoint.")
    if meta.size is not None and f.size is not None and meta.size != f.size:
        raise IntegrityError(f"{where}: the hub's file header says {meta.size} bytes, its "
                             f"listing {f.size}.")
    headers = build_hf_headers(token=token or False)
    location = meta.location or url
    if not _same_origin(url, location):
        headers.pop("authorization", None)  # a signed CDN URL: the token stays on the hub
    return location, headers


# --------------------------------------------------------------------------- bytes


def _open_part(path: Path) -> Any:
    return path.open("ab")


def _no_space(dest: Path, f: RemoteFile, have: int) -> RuntimeFailure:
    total = f"{f.size / 1e6:,.0f} MB" if f.size else "the whole file"
    return RuntimeFailure(
        f"no space left in {dest} while writing {f.name} ({have / 1e6:,.0f} MB of {total} "
        "written).", hint="Free space (or give --dir elsewhere) and run the same command: "
        "it resumes from the partial file.")


def fetch_bytes(url: str, headers: dict[str, str], f: RemoteFile, dest: Path,
                report: Report) -> Path:
    """The file's bytes in its partial file, resumed from what an earlier run left there."""
    import httpx2
    from huggingface_hub.file_download import http_get

    part = partial_path(dest, f)
    if f.size is not None and part.is_file() and part.stat().st_size > f.size:
        part.unlink()  # longer than the file: not a prefix of it
    try:
        with _open_part(part) as out:
            http_get(url, out, resume_size=out.tell(), headers=headers, expected_size=f.size,
                     displayed_filename=f.name, tqdm_class=report.bar_class())
    except (httpx2.RemoteProtocolError, httpx2.ReadError, httpx2.TimeoutException) as exc:
        have = part.stat().st_size if part.exists() else 0
        raise RuntimeFailure(
            f"the transfer of {f.name} kept breaking off ({type(exc).__name__}); "
            f"{have / 1e6:,.0f} MB are kept in {part.name}.",
            hint="Run the same command again to resume from there.") from None
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_space(dest, f, part.stat().st_size if part.exists() else 0) from None
        if type(exc) is OSError and "Consistency check failed" in str(exc):
            part.unlink(missing_ok=True)
            raise IntegrityError(f"{f.name}: the hub sent a different number of bytes than its "
                                 f"listing says ({f.size}).", hint="Run the command again.") \
                from None
        raise
    return part


def verify(part: Path, f: RemoteFile, where: str) -> None:
    """sha256 against the hub's, then the GGUF magic; a file that fails is deleted."""
    actual = sha256_file(part)
    if actual != f.sha256:
        part.unlink(missing_ok=True)
        raise IntegrityError(f"{where} {f.path}: the bytes received have sha256 {actual}, the "
                             f"hub's LFS metadata says {f.sha256}; nothing was kept.",
                             hint="Run the command again; if it repeats, the mirror serves a "
                                  "corrupt copy.")
    with part.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        part.unlink(missing_ok=True)
        raise ConfigError(f"{where} {f.path}: not a GGUF file (it starts with {magic!r}); "
                          "nothing was kept.", hint="Pick a .gguf file of the repository.")


def write_record(final: Path, *, repo: str, revision: str, endpoint: str,
                 f: RemoteFile) -> Path:
    rec = record_path(final)
    paths.replace_text(rec, json.dumps({
        "repo": repo, "revision": revision, "file": f.path, "sha256": f.sha256,
        "size": f.size, "endpoint": public_endpoint(endpoint),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }, indent=2) + "\n")
    return rec


def recorded(final: Path) -> tuple[str, int] | None:
    """(sha256, size) of a file as its record says, when the file is there at that size."""
    try:
        rec = json.loads(record_path(final).read_text())
        sha, size = str(rec["sha256"]), int(rec["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (sha, size) if final.is_file() and final.stat().st_size == size else None


def _check_space(dest: Path, files: Sequence[RemoteFile]) -> None:
    need = sum(max((f.size or 0) - (p.stat().st_size if (p := partial_path(dest, f)).exists()
                                    else 0), 0)
               for f in files if recorded(dest / f.name) != (f.sha256, f.size))
    free = shutil.disk_usage(dest).free
    if need > free:
        raise RuntimeFailure(f"not enough space in {dest}: {need / 1e6:,.0f} MB needed, "
                             f"{free / 1e6:,.0f} MB free; nothing was written.",
                             hint="Free space, or give --dir on a larger disk.")


class _LogToReport(logging.Handler):
    """huggingface_hub's own warnings (a resumed transfer, a retry) as report lines."""

    def __init__(self, report: Report) -> None:
        super().__init__(logging.WARNING)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        self.report.line(record.getMessage().splitlines()[0])


@contextlib.contextmanager
def _library_log(report: Report) -> Iterator[None]:
    log = logging.getLogger("huggingface_hub")
    handler, propagate = _LogToReport(report), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def quiet_library() -> None:
    """Before huggingface_hub is first imported (it reads these once): no telemetry, which
    would otherwise fetch a registry from the endpoint to tag the user agent, and no Xet."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")


def pull(repo: str, selector: str | None = None, *, revision: str = "main",
         dest: Path | None = None, token_file: Path | None = None,
         endpoint: str | None = None, report: Report | None = None) -> Pulled:
    """Fetch the GGUF file(s) `selector` names from `repo` into `dest` (the models directory)."""
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise ConfigError(f"models pull {repo}: a repository is OWNER/NAME, e.g. "
                          "unsloth/Qwen3.6-27B-GGUF.")
    quiet_library()
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    dest = dest or paths.models_dir()
    token = hub_token(token_file)
    report = report or Report(secrets=(token or "",))
    with hub_errors(repo, endpoint, revision), _library_log(report):
        commit, listing = list_files(repo, revision, endpoint, token)
        where = f"{repo}@{commit[:12]}"
        files = choose(listing, selector, where)
        for f in files:
            if not f.sha256:
                raise IntegrityError(f"{where} {f.path}: the hub gives no sha256 for it (not "
                                     "an LFS file), so it cannot be verified.")
        dest.mkdir(parents=True, exist_ok=True)
        total = sum(f.size or 0 for f in files)
        report.line(f"pull {where} from {public_endpoint(endpoint)}: "
                    f"{', '.join(f.name for f in files)} ({total / 1e6:,.0f} MB) into {dest}; "
                    f"transfer: {TRANSFER}")
        _check_space(dest, files)
        parts: list[tuple[RemoteFile, Path]] = []
        for f in files:
            if recorded(dest / f.name) == (f.sha256, f.size):
                report.line(f"{f.name}: already here, recorded with the same sha256")
                parts.append((f, dest / f.name))
                continue
            url, headers = locate(repo, commit, f, endpoint, token)
            part = fetch_bytes(url, headers, f, dest, report)
            verify(part, f, where)
            parts.append((f, part))
    finals = []
    for f, part in parts:  # every part verified: the set gets its names
        final = dest / f.name
        if part != final:
            write_record(final, repo=repo, revision=commit, endpoint=endpoint, f=f)
            os.replace(part, final)
        finals.append(final)
    report.line(f"verified sha256 of {len(finals)} file(s); model: {finals[0]}")
    return Pulled(repo=repo, revision=commit, endpoint=public_endpoint(endpoint),
                  files=tuple(finals))
