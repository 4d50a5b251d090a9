"""The KV benchmark's first part: which KV types a model takes, and the bits per value each one
really costs, from the KV buffer sizes llama-server logs at load.

Admission is `mtpwrap.decide.kv.admits`, the one rule the launch and `models inspect` use; a type
the model cannot take is reported as not applicable with that rule's reason, and the run goes on.
"""

from __future__ import annotations

from collections.abc import Iterable

from mtpwrap.decide import kv
from mtpwrap.decide.gguf_facts import ModelFacts

MiB = 2**20


def applicable(facts: ModelFacts, offered: Iterable[str],
               target: kv.Target | None = None) -> list[dict]:
    """Each offered type, K and V alike: admitted, or not applicable with the reason."""
    out = []
    for t in offered:
        k, v = kv.admits(facts, t, "K", target), kv.admits(facts, t, "V", target)
        row: dict = {"kv": t, "applicable": k.admitted and v.admitted,
                     "nominal_bits_per_value": (kv.bits_per_value(t) if t in kv.TABLE
                                                else None)}
        if not row["applicable"]:
            row["reason"] = "; ".join(a.reason for a in (k, v) if not a.admitted)
        out.append(row)
    return out


def effective_bits(facts: ModelFacts, logged: dict) -> dict:
    """Bits per stored value of K and V: the MiB llama-server logged for each
    (`runner.parse_kv_log`) ÷ (cells × the values per token of the layers it holds)."""
    layers = list(facts.kv_layers)[:int(logged["layers"])]
    k_vals = sum(facts.kv_row_values(il)[0] for il in layers)
    v_vals = sum(facts.kv_row_values(il)[1] for il in layers)
    cells = int(logged["cells"]) * int(logged.get("streams") or 1)
    return {"k_type": logged["k_type"], "v_type": logged["v_type"],
            "k_bits_per_value": logged["k_mib"] * MiB * 8 / (cells * k_vals) if k_vals else None,
            "v_bits_per_value": logged["v_mib"] * MiB * 8 / (cells * v_vals) if v_vals else None}
