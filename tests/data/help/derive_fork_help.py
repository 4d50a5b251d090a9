"""Derive the recorded --help of the MTP + TurboQuant fork from upstream's real --help.

    python tests/data/help/derive_fork_help.py

reads upstream-0c1e570.txt and writes fork-1c6e4ea.txt with exactly the differences listed in
README.md, formatted the way llama.cpp's common_arg::to_string() formats help (text at column
40, wrapped at 70 characters on word boundaries).
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
UPSTREAM_KV = "f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"
FORK_KV = UPSTREAM_KV + ", tbq4_0, tbq3_0, planar3_0, iso3_0, planar4_0, iso4_0"
PAD = " " * 40


def wrap(text: str, width: int = 70) -> list[str]:
    """llama.cpp's break_str_into_lines(): greedy word wrap, lines up to `width` kept whole."""
    if len(text) <= width:
        return [text]
    out: list[str] = []
    cur = ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            out.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    if cur:
        out.append(cur)
    return out


def derive(upstream: str) -> str:
    lines = upstream.split("\n")
    out: list[str] = []
    for line in lines:
        if line.strip() == f"allowed values: {UPSTREAM_KV}":
            # -ctk, -ctv, -ctkd and -ctvd: the fork adds its cache types to all four.
            out.extend(PAD + part for part in wrap(f"allowed values: {FORK_KV}"))
            continue
        if line.startswith("--spec-type ") and ",draft-mtp," in line:
            # the fork's own MTP implementation, next to upstream's draft-mtp
            out.append(line.replace(",draft-mtp,", ",draft-mtp,mtp,", 1))
            continue
        if line.strip() == "disable (default: -1)" and out[-1].startswith("-cpent,"):
            # --checkpoint-every-n-tokens: the fork's own flag (patch 0002 adds it to the
            # upstream build, off), on by default there as at 0bc0a27
            out.append(line.replace("(default: -1)", "(default: 8192)"))
            continue
        if line.startswith("-lm,   --load-mode"):
            # the recipe's --mlock: gone upstream, still accepted (deprecated) by the fork
            head = "--mlock".ljust(40)
            text = wrap("DEPRECATED in favor of `--load-mode`: force system to keep model in "
                        "RAM rather than swapping or compressing")
            out.append(head + text[0])
            out.extend(PAD + t for t in text[1:])
            out.append(PAD + "(env: LLAMA_ARG_MLOCK)")
        out.append(line)
    return "\n".join(out)


def main() -> None:
    upstream = (HERE / "upstream-0c1e570.txt").read_text()
    (HERE / "fork-1c6e4ea.txt").write_text(derive(upstream))
    version = ("version: 0.5.0-dev (build 1, commit 1c6e4ea)\n"
               "built with GNU 12.2.0 for Linux x86_64\n")
    (HERE / "fork-1c6e4ea.version.txt").write_text(version)


if __name__ == "__main__":
    main()
