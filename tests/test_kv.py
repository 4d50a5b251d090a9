"""The KV-type table and the admission rule (mtpwrap.decide.kv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpwrap.decide import kv
from mtpwrap.decide.gguf_facts import ModelFacts, read_facts
from mtpwrap.decide.vocab import KV_TYPES, TBQ3_V_ENV
from mtpwrap.errors import ConfigError


def facts(*, head: int, n_kv: int, layers: int = 4, name: str = "m", mla: bool = False,
          head_v: int | None = None) -> ModelFacts:
    """The attention shape of a model, as gguf_facts reads it from a header."""
    return ModelFacts(
        path=f"/models/{name}.gguf", file_size=0, architecture="llama", name=name,
        generic=False, n_layer_all=layers, n_layer_nextn=0, n_embd=head * 4, n_vocab=1000,
        n_ctx_train=4096, n_head=[4] * layers, n_head_kv=[n_kv] * layers, head_dim_k=head,
        head_dim_v=head if head_v is None else head_v, head_dim_k_swa=0, head_dim_v_swa=0,
        kv_layers=list(range(layers)), swa_layers=[], sliding_window=0, is_mla=mla,
        recurrent_layers=[], recurrent_r_floats=0, recurrent_s_floats=0, recurrent_conv_dim=0,
        recurrent_inner=0, n_expert=0, n_expert_used=0, n_ff=head * 8, tensor_bytes=0,
        bytes_by_type={}, host_bytes=0, mtp_bytes=0, output_bytes=0, token_embd_bytes=0,
        layer_bytes={}, data_offset=0)


SMOLLM2 = facts(head=64, n_kv=3, name="SmolLM2-135M")      # rows of 192
GEMMA3_270M = facts(head=256, n_kv=1, name="gemma-3-270m")  # rows of 256


@pytest.mark.parametrize(("name", "bits"), [
    ("f16", 16), ("q8_0", 8.5), ("q5_1", 6), ("q5_0", 5.5), ("q4_1", 5), ("q4_0", 4.5),
    ("iq4_nl", 4.5), ("tbq4_0", 4.125), ("planar4_0", 4.125), ("iso4_0", 4.125),
    ("tbq3_0", 3.125), ("planar3_0", 3.125), ("iso3_0", 3.125),
    ("turbo2", 2.125), ("turbo3", 3.125), ("turbo4", 4.25),
])
def test_table_bits_per_value(name: str, bits: float) -> None:
    assert kv.TABLE[name].bits == bits
    assert kv.TABLE[name].source


def test_every_table_type_is_in_the_vocabulary() -> None:
    assert set(kv.TABLE) <= set(KV_TYPES)


def test_measured_size_wins_and_a_difference_is_reported() -> None:
    measured = {"tbq4_0": {"block": 256, "bytes": 168}, "q4_0": {"block": 256, "bytes": 144}}
    assert kv.size("tbq4_0", measured) == (256, 168)
    diffs = kv.differences(measured)
    assert len(diffs) == 1 and "tbq4_0" in diffs[0] and "5.250" in diffs[0]
    assert kv.differences({"tbq4_0": {"block": 256, "bytes": 132}}) == []


def test_unknown_type_has_no_size() -> None:
    with pytest.raises(ConfigError, match="tbqp4_0"):
        kv.size("tbqp4_0")


def test_turbo_pads_heads_to_128() -> None:
    assert kv.padded_head("turbo3", 64) == 128
    assert kv.padded_head("tbq4_0", 64) == 64
    assert kv.admits(SMOLLM2, "turbo3").admitted


def test_tbq_refused_when_the_row_is_not_a_multiple_of_128() -> None:
    a = kv.admits(SMOLLM2, "tbq4_0", "K")
    assert not a.admitted
    assert "192" in a.reason and "128" in a.reason and "n_embd_k_gqa" in a.reason


def test_tbq_needs_a_fused_head_size() -> None:
    # rows of 128 (2 KV heads of 64): the row divides, the head size is not fused
    a = kv.admits(facts(head=64, n_kv=2), "tbq4_0", "K")
    assert not a.admitted and "128 and 256" in a.reason
    assert kv.admits(GEMMA3_270M, "tbq4_0", "K").admitted


CUDA = kv.Target(backend="cuda")


def test_rotor_types_check_the_head_size_and_fa_all_quants_on_cuda() -> None:
    assert not kv.admits(facts(head=64, n_kv=2), "planar3_0", target=CUDA).admitted
    cuda_off = kv.Target(backend="cuda", fa_all_quants=False)
    a = kv.admits(GEMMA3_270M, "iso4_0", "V", cuda_off)
    assert not a.admitted and "GGML_CUDA_FA_ALL_QUANTS" in a.reason
    assert kv.admits(GEMMA3_270M, "iso4_0", "V", kv.Target(backend="cuda",
                                                           fa_all_quants=True)).admitted
    # on the CPU the fork's rotor types crash llama-server at warm-up (measured at 0bc0a27)
    a = kv.admits(GEMMA3_270M, "iso4_0", "V", kv.Target(backend="cpu", fa_all_quants=False))
    assert not a.admitted and "SIGSEGV" in a.reason


def test_tbq3_0_on_the_cpu_is_admitted_with_the_measured_warning() -> None:
    a = kv.admits(GEMMA3_270M, "tbq3_0", "K", kv.Target(backend="cpu"))
    assert a.admitted and "unusable" in a.reason
    assert "unusable" not in kv.admits(GEMMA3_270M, "tbq3_0", "K",
                                       kv.Target(backend="cuda")).reason


def test_upstream_types_need_whole_blocks_per_head() -> None:
    assert kv.admits(SMOLLM2, "q4_0").admitted
    a = kv.admits(facts(head=80, n_kv=2), "q4_0")
    assert not a.admitted and "80" in a.reason


def test_quantized_v_needs_flash_attention() -> None:
    a = kv.admits(GEMMA3_270M, "q8_0", "V", kv.Target(flash_attn="off"))
    assert not a.admitted and "flash attention" in a.reason
    assert kv.admits(GEMMA3_270M, "q8_0", "K", kv.Target(flash_attn="off")).admitted


def test_tbq3_v_needs_the_fork_environment() -> None:
    a = kv.admits(GEMMA3_270M, "tbq3_0", "V")
    assert a.admitted and dict(a.env) == {TBQ3_V_ENV: "1"}
    assert kv.admits(GEMMA3_270M, "tbq3_0", "K").env == ()


def test_mla_has_no_v_cache() -> None:
    assert kv.admits(facts(head=576, n_kv=1, mla=True), "tbq4_0", "V").admitted


def test_first_admitted_names_the_refusals() -> None:
    got, refused = kv.first_admitted(SMOLLM2, ["tbq4_0", "q4_0"], "K")
    assert got is not None and got.kv_type == "q4_0"
    assert [r.kv_type for r in refused] == ["tbq4_0"]
    got, _ = kv.first_admitted(GEMMA3_270M, ["tbq4_0", "q4_0"], "K")
    assert got is not None and got.kv_type == "tbq4_0"


def test_real_27b_header_admits_the_recipe_types(shape_27b: Path) -> None:
    f = read_facts(shape_27b)
    for t in ("tbq4_0", "tbq3_0", "planar4_0", "q4_0", "turbo4"):
        assert kv.admits(f, t, "K", CUDA).admitted, t
        assert kv.admits(f, t, "V", CUDA).admitted, t
