"""The planner's CPU compute rule against llama.cpp's own allocations, recorded.

tests/data/fit-params/<build>/ holds the lines that size memory from `llama-fit-params -v` (and,
in `*.server.txt`, from `llama-server -lv 4 --no-warmup`) of two CPU builds made by `mtpwrap
build`: upstream 0c1e570 and the fork at 0bc0a27, on nine models (dense, sliding-window,
hybrid recurrent, MoE hybrid, MoE with MLA). `benchmarks/record_fit_params.py` wrote them; the
first line of each is the command. The models are shape-only GGUFs with the same header
(tests/test_planner_recorded.py checks the demo model's and gemma-3-270m's where they are
cached).

The two builds reserve differently: llama-fit-params of both and the fork's llama-server
reserve a whole ubatch of logits; upstream's llama-server only slots × (1 + depth). The fork
builds its attention mask in f32 and casts it. The planner takes both from the binary
(`Capabilities.outputs_capped`, via resolve.plan_config).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Iterator
from typing import Any

import pytest

from mtpwrap import paths
from mtpwrap.build import tiny_gguf
from mtpwrap.build.calibrate import parse_allocations
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.decide.gguf_facts import ModelFacts, read_facts
from mtpwrap.decide.launch import plain
from mtpwrap.decide.planner import PlanConfig, plan
from mtpwrap.decide.resolve import plan_config
from tests.helpers import DATA

RECORDED = DATA / "fit-params"
BUILDS = {"upstream-0c1e570": True, "fork-0bc0a27": False}  #: build -> caps logits rows
#: the model file each recording names -> the shape-only model with its dimensions
SHAPE_OF = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m",
            "gemma-3-270m-q4_k_m.gguf": "gemma3-270m", "llama3-8b.gguf": "llama3-8b",
            "gemma3-12b.gguf": "gemma3-12b", "qwen3.6-35b-a3b.gguf": "qwen3.6-35b-a3b",
            "deepseek2-lite.gguf": "deepseek2-lite", "qwen3.6-27b.gguf": "qwen3.6-27b"}
MiB = 2**20


def recordings() -> list[tuple[str, str]]:
    return [(build, p.name) for build in BUILDS for p in sorted((RECORDED / build).glob("*.txt"))]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModelFacts]]:
    tmp = tmp_path_factory.mktemp("recorded-shapes")
    out: dict[str, ModelFacts] = {}
    for name, shape in SHAPE_OF.items():
        path = tiny_gguf.write_shape_only(tmp / f"{shape}.gguf", shape)
        out[name] = read_facts(path)
        path.unlink()
    tiny = tiny_gguf.write_tiny_random(tmp / "tiny-qwen35-mtp.gguf", "qwen35", mtp=True)
    out["tiny-qwen35-mtp.gguf"] = read_facts(tiny)
    yield out


def recorded(build: str, name: str) -> tuple[str, PlanConfig, int]:
    """(model file, the planner's config for the recorded command, compute bytes recorded)."""
    text = (RECORDED / build / name).read_text()
    argv = shlex.split(text.splitlines()[0].removeprefix("# "))
    opt = {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("-")}
    cfg = PlanConfig(backend="cpu", n_ctx=int(opt["-c"]), n_slots=int(opt["-np"]),
                     ubatch=int(opt["-ub"]), type_k=opt["-ctk"], type_v=opt["-ctv"],
                     flash_attn=opt["--flash-attn"] == "on")
    a = parse_allocations(text)
    assert a.compute_per_context, name
    return opt["-m"], cfg, a.compute_per_context[0]


def planned_compute(facts: ModelFacts, cfg: PlanConfig, *, capped: bool, tool: str) -> int:
    """The compute row for cfg as resolve sizes it for this binary; llama-fit-params reserves
    a whole ubatch of logits whatever the binary (common_context_params: n_outputs_max 0)."""
    caps = Capabilities(outputs_capped=capped)
    launch = plain("m.gguf", context=cfg.n_ctx, slots=cfg.n_slots, cache=cfg.type_k,
                   why="recorded", ubatch=cfg.ubatch,
                   flash_attn="on" if cfg.flash_attn else "off")
    pc = plan_config(launch, facts, backend="cpu", caps=caps)
    if tool == "fit":
        pc = dataclasses.replace(pc, n_outputs=pc.ubatch)
    return plan(facts, pc, None).row("compute").bytes


#: where the rule is known to miss by more than 15 %, and why
KNOWN_MISSES = {
    ("fork-0bc0a27", "llama3-8b-c16384-q8_0.txt"):
        "-15.3 %: at 16K the fork's allocator keeps the 48 MiB f32 mask and its f16 copy live "
        "next to the logits; at 32K and 131K it does not (docs/measurements/planner-compute.md), "
        "and the rule follows those",
    ("upstream-0c1e570", "qwen3.6-35b-a3b-c8192-f16-ub32.server.txt"):
        "-26 % (5.9 MiB planned, 8.1 recorded): at ubatch 32 the MoE hybrid's llama-server keeps "
        "about 2 MiB more than its per-token rule, which holds within 2 % at 512 and 2048 "
        "(docs/measurements/planner-compute.md)",
}


def _case(build: str, name: str) -> Any:
    why = KNOWN_MISSES.get((build, name))
    return pytest.param(build, name, marks=[pytest.mark.xfail(reason=why, strict=True)]
                        if why else [])


@pytest.mark.parametrize(("build", "name"), [_case(b, n) for b, n in recordings()])
def test_compute_within_15_percent_of_llama_cpp(models: dict[str, ModelFacts], build: str,
                                                name: str) -> None:
    model, cfg, got = recorded(build, name)
    tool = "server" if name.endswith(".server.txt") else "fit"
    pred = planned_compute(models[model], cfg, capped=BUILDS[build], tool=tool)
    assert abs(pred - got) <= 0.15 * got, (build, name, pred / MiB, got / MiB)


def test_the_recordings_cover_every_architecture_and_both_reservations() -> None:
    names = {n for _, n in recordings()}
    for build in BUILDS:
        for model in ("demo", "gemma-3-270m", "tiny-qwen35-mtp", "qwen3.6-35b-a3b",
                      "deepseek2-lite", "qwen3.6-27b", "llama3-8b", "gemma3-12b"):
            assert any(n.startswith(model) for n in names), (build, model)
        assert (RECORDED / build / "gemma-3-270m-c4096-f16.server.txt").is_file()


def test_the_reservation_decides_on_a_large_vocabulary(models: dict[str, ModelFacts]) -> None:
    """gemma-3-270m (262,144 tokens): upstream's llama-server reserves one row of logits,
    the fork's a whole ubatch (512 × 262,144 × 4 B = 512 MiB). Each build's rule matches its
    own server, and the other's would be far off."""
    _, cfg, up = recorded("upstream-0c1e570", "gemma-3-270m-c4096-f16.server.txt")
    _, _, fork = recorded("fork-0bc0a27", "gemma-3-270m-c4096-f16.server.txt")
    facts = models["gemma-3-270m-q4_k_m.gguf"]
    capped = planned_compute(facts, cfg, capped=True, tool="server")
    whole = planned_compute(facts, cfg, capped=False, tool="server")
    assert fork > 20 * up
    assert abs(capped - up) <= 0.15 * up and abs(whole - fork) <= 0.15 * fork
    assert whole - capped >= 490 * MiB  # 511 more rows of 1 MiB, less what the phases hide


def test_plan_config_follows_the_binary(models: dict[str, ModelFacts]) -> None:
    facts_free = plain("m.gguf", context=4096, why="t", ubatch=32)
    f = models["SmolLM2-135M-Instruct.Q4_1.gguf"]
    up = plan_config(facts_free, f, backend="cuda", caps=Capabilities(outputs_capped=True))
    fork = plan_config(facts_free, f, backend="cuda", caps=Capabilities(outputs_capped=False))
    unknown = plan_config(facts_free, f, backend="cuda")
    assert (up.n_outputs, up.mask_f32) == (None, False)
    assert (fork.n_outputs, fork.mask_f32) == (32, True)
    assert (unknown.n_outputs, unknown.mask_f32) == (32, True)  # the larger of the two


@pytest.mark.integration  # reads the shared model cache
@pytest.mark.parametrize(("shape", "real"), [("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                                             ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf")])
def test_the_stand_in_shapes_have_the_real_headers(models: dict[str, ModelFacts], shape: str,
                                                   real: str) -> None:
    path = paths.models_dir() / real
    if not path.is_file():
        pytest.skip(f"{real} is not in the model cache")
    a, b = models[real], read_facts(path)
    for k in ("architecture", "n_vocab", "n_embd", "n_ff", "n_layer", "n_head", "kv_layers",
              "swa_layers", "sliding_window", "is_mla", "recurrent_layers"):
        assert getattr(a, k) == getattr(b, k), k
