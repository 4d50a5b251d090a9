"""The words llama-server is spoken to in: flag spellings, KV cache types, speculation kinds.

A leaf module (it imports nothing of the project), so every stage can name these without
importing the launch that uses them. `launch` spells a `LaunchConfig` with them, `profiles`
checks a profile against them, `persist` and the benchmarks read them.
"""

from __future__ import annotations

#: KV cache types known to upstream llama.cpp, to the MTP + TurboQuant fork (tbq*, planar*,
#: iso*; tbqp* at another of its commits) and to TheTom/llama-cpp-turboquant (turbo2/3/4).
#: A profile may name any of them; the launch keeps only what the built binary offers and the
#: model admits (`mtpwrap.decide.kv`).
KV_TYPES = (
    "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1",
    "tbq3_0", "tbq4_0", "tbqp3_0", "tbqp4_0", "planar3_0", "iso3_0", "planar4_0", "iso4_0",
    "turbo2", "turbo3", "turbo4",
)
FULL_PRECISION_KV = frozenset({"f32", "f16", "bf16"})
SPEC_KINDS = ("mtp", "draft", "ngram", "none")
FLASH_ATTN = ("on", "off", "auto")
#: spec types per speculation kind, in order of preference. ngram-simple first: its lookup
#: length is set per profile (spec.ngram_n), and it drafts on short prompts where ngram-mod's
#: 24-token lookup finds nothing.
SPEC_TYPES: dict[str, tuple[str, ...]] = {
    "mtp": ("mtp", "draft-mtp"),
    "draft": ("draft-simple", "draft"),
    "ngram": ("ngram-simple", "ngram-mod", "ngram-map-k", "ngram-cache"),
}

#: logical option → spellings in order of preference (the recipe's spellings first).
SPELLINGS: dict[str, tuple[str, ...]] = {
    "model": ("-m", "--model"),
    "host": ("--host",),
    "port": ("--port",),
    "context": ("-c", "--ctx-size"),
    "gpu_layers": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "slots": ("-np", "--parallel"),
    "batch": ("-b", "--batch-size"),
    "ubatch": ("-ub", "--ubatch-size"),
    "threads": ("-t", "--threads"),
    "cache_k": ("-ctk", "--cache-type-k"),
    "cache_v": ("-ctv", "--cache-type-v"),
    "flash_attn": ("--flash-attn", "-fa"),
    "spec_type": ("--spec-type",),
    "p_min": ("--spec-draft-p-min", "--draft-p-min"),
    "draft_model": ("-md", "--spec-draft-model", "--model-draft"),
    "draft_k": ("-ctkd", "--spec-draft-type-k", "--cache-type-k-draft"),
    "draft_v": ("-ctvd", "--spec-draft-type-v", "--cache-type-v-draft"),
    "mlock": ("--mlock",),
    "no_warmup": ("--no-warmup",),
    "verbosity": ("-lv", "--verbosity", "--log-verbosity"),
    "kv_unified": ("-kvu", "--kv-unified"),
    "no_kv_unified": ("-no-kvu", "--no-kv-unified"),
    "no_repack": ("--no-repack", "-nr"),
    "fit": ("--fit", "-fit"),
    "metrics": ("--metrics",),
    "no_webui": ("--no-webui", "--no-ui"),
    "api_key": ("--api-key",),
    "slot_save_path": ("--slot-save-path",),
    "ctx_checkpoints": ("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"),
    # a checkpoint every n tokens while a prompt is read: the fork at 0bc0a27's flag, which
    # patch 0002 adds to the upstream pin under the same spelling
    "checkpoint_every": ("-cpent", "--checkpoint-every-n-tokens"),
    # upstream's minimum spacing between checkpoints (a user message's start); the plan leaves
    # it to llama.cpp
    "cache_reuse": ("--cache-reuse",),
    "cache_ram": ("-cram", "--cache-ram"),
    "embeddings": ("--embeddings", "--embedding"),
    "reranking": ("--reranking", "--rerank"),
    "pooling": ("--pooling",),
    "alias": ("-a", "--alias"),
}
#: the document cache's flags (decide.documents decides them), in the order they are spelled
DOCUMENT_FLAGS = ("ctx_checkpoints", "checkpoint_every", "cache_reuse", "cache_ram")
#: the draft depth's flag and the ngram lookup length's flag, per spec type.
DEPTH_FLAGS: dict[str, tuple[str, ...]] = {
    "mtp": ("--spec-draft-n-max",), "draft-mtp": ("--spec-draft-n-max",),
    "draft-simple": ("--spec-draft-n-max",), "draft": ("--spec-draft-n-max",),
    "ngram-simple": ("--spec-ngram-simple-size-m",), "ngram-mod": ("--spec-ngram-mod-n-max",),
    "ngram-map-k": ("--spec-ngram-map-k-size-m",),
}
NGRAM_N_FLAGS: dict[str, tuple[str, ...]] = {
    "ngram-simple": ("--spec-ngram-simple-size-n",), "ngram-map-k": ("--spec-ngram-map-k-size-n",),
}
#: flags mtpwrap owns, and why: extra args may not set them.
_LOOPBACK = "the child listens on loopback with an internal key"
RESERVED: dict[str, str] = {
    **dict.fromkeys(("-m", "--model", "--host", "--port", "--api-key", "--api-key-file",
                     "--path", "--ssl-key-file", "--ssl-cert-file"), _LOOPBACK),
    "--slot-save-path": "its KV snapshot directory, persist.dir",
}
#: flags that let the model act on the machine: llama-server's built-in tools (file read and
#: write, shell commands), its agent loop and MCP servers/proxies. Refused in extra arguments
#: unless the profile sets allow_tools: true.
TOOL_FLAGS = frozenset({"--tools", "--tools-runtime", "-ag", "--agent", "--mcp-servers-config",
                        "--mcp-servers-json", "--ui-mcp-proxy", "--webui-mcp-proxy"})
#: llama-server's default log verbosity (3, info): above it, prompts and answers are logged
DEFAULT_VERBOSITY = 3
VERBOSE = frozenset({"-v", "--verbose", "--log-verbose"})
VERBOSITY = frozenset(SPELLINGS["verbosity"])
#: KV types a step-down moves through (each taken only when it is smaller per value).
STEP_KV_TYPES = ("q8_0", "tbq4_0", "q4_0", "tbq3_0")
#: flags that stretch a model past its trained context (a profile's extra_args): with one of
#: them a context above the trained one is the profile's stated choice, not capped
ROPE_FLAGS = frozenset({"--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale",
                        "--yarn-orig-ctx", "--yarn-ext-factor"})
#: the smallest context a step-down halves to.
CONTEXT_FLOOR = 4096
#: the environment variable the fork reads before it takes tbq3_0 for the V cache
TBQ3_V_ENV = "LLAMA_ALLOW_TBQ3_KV"
