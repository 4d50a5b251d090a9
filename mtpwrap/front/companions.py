"""The front's companions: an embedding or rerank model served by its own llama-server, with
its own supervisor, slots and queue. Which requests go to which child is decided here, from the
route and the body's `model`: embedding routes to an embedding companion, rerank routes to a
reranker, everything else (and everything when no companion serves the route) to the chat
model.

Pure apart from the objects it holds: `Routes.target` is tested with tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mtpwrap.supervision.state import SupervisorPort

if TYPE_CHECKING:
    from mtpwrap.front.admission import Admission
    from mtpwrap.front.relay import Relay

#: the routes each role answers (llama-server's own spellings and the OpenAI-style ones)
ROLE_ROUTES: dict[str, frozenset[str]] = {
    "embedding": frozenset({"/embedding", "/embeddings", "/v1/embeddings"}),
    "rerank": frozenset({"/rerank", "/reranking", "/v1/rerank", "/v1/reranking"}),
}


@dataclass(frozen=True)
class CompanionInfo:
    """What the front is told about one companion."""

    name: str  #: the `model` clients send, and the id /v1/models lists
    role: str  #: embedding | rerank
    model: str  #: the GGUF file
    slots: int
    n_vocab: int | None = None  #: its vocabulary's size (token ids are checked against it)


@dataclass
class Companion:
    """One companion as the front serves it: its supervisor, and the admission and relay bound
    to it (its own slots and queue)."""

    info: CompanionInfo
    supervisor: SupervisorPort
    admission: Admission
    relay: Relay

    @property
    def name(self) -> str:
        return self.info.name

    def health(self) -> dict[str, object]:
        """Its row on /healthz, /status.json and the state file."""
        st = self.supervisor.status()
        return {"name": self.info.name, "role": self.info.role, "model": self.info.model,
                "state": st.state.value, "reason": st.reason, "restarts": st.restarts,
                "pid": st.pid, "ready_since": st.ready_since, "last_exit": st.last_exit,
                "slots": self.info.slots, "forwarding": self.admission.forwarding,
                "queued": self.admission.queued}


class UnknownModel(Exception):
    """The body names a model no child of this role serves."""

    def __init__(self, role: str, wanted: str, names: Sequence[str]) -> None:
        served = ", ".join(repr(n) for n in names) or "none"
        super().__init__(f"The model {wanted!r} does not serve {role} requests here; send one "
                         f"of {served} as `model`.")


@dataclass(frozen=True)
class Routes:
    """The companions by role, in the profile's order."""

    companions: tuple[Companion, ...] = ()

    def role_of(self, label: str) -> str | None:
        """The role whose companions answer this route, when one is configured."""
        for role, routes in ROLE_ROUTES.items():
            if label in routes and any(c.info.role == role for c in self.companions):
                return role
        return None

    def target(self, role: str, model: object) -> Companion:
        """The companion of `role` the body's `model` names; the first of the role when the
        body names none, or names one that is not a companion of this role (the chat model's
        name, which an OpenAI client sends by default) and only one serves the role. Raises
        UnknownModel when several serve it and the name is none of theirs."""
        group = [c for c in self.companions if c.info.role == role]
        if isinstance(model, str):
            for c in group:
                if c.info.name == model:
                    return c
            if len(group) > 1:
                raise UnknownModel(role, model, [c.info.name for c in group])
        return group[0]

    def only(self, role: str) -> Companion | None:
        """The companion of `role` when it is the only one: known from the route alone."""
        group = [c for c in self.companions if c.info.role == role]
        return group[0] if len(group) == 1 else None

    def get(self, name: str) -> Companion | None:
        return next((c for c in self.companions if c.info.name == name), None)
