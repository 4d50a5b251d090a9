"""Names vulture (`make lint`) reports as unused that are used where it cannot see.

vulture reads mtpwrap/, benchmarks/ and docs/ (pyproject.toml, [tool.vulture]); a name used only
by a test counts as unused. Click commands are left out by decorator there. Every name here is
one the code defines (tests/test_dead_code.py checks), under the reason it is kept. vulture
matches by name alone, so each line keeps that name alive wherever it is defined.
"""
# ruff: noqa: B018

_ = object()  # vulture's whitelist form: `_.name` uses `name`; this file is never imported

# --- dataclass fields that reach people through dataclasses.asdict (reports, manifests,
# status pages, --json) and no code reads by attribute
_.roofline_tokens_per_s  # benchmarks.gpu_plan.Cell
_.per_position  # bench.stats.SpecStats
_.checkpoint_bytes  # decide.documents.DocumentPlan (plan --json, /status)
_.ram_budget  # decide.documents.DocumentPlan
_.ctx_checkpoints  # decide.launch.LaunchConfig: render reads it by name (_DOCUMENT_FLAGS)
_.checkpoint_every  # decide.launch.LaunchConfig, the same
_.per_position_conditional  # bench.stats.SpecStats
_.n_decode  # bench.stats.Counters (report.json; added and subtracted by field)
_.mean_draft_length  # bench.stats.SpecStats
_.cuda_version  # build.manifest.Manifest
_.version_output  # build.manifest.Manifest
_.log_tail  # build.smoke.SmokeResult
_.n_expert_used  # decide.gguf_facts.ModelFacts
_.bytes_by_type  # decide.gguf_facts.ModelFacts
_.utilization_memory  # decide.hardware.GpuInfo and GpuReading
_.throttle_reasons_mask  # decide.hardware.GpuReading
_.finished_at  # service.reload.ReloadState

# --- called or read by a library
_.mtime  # tarfile.TarInfo, read by tarfile when build.prebuilt writes the manifest member
_.format_commands  # click.Group (cli.LazyGroup)
_.format_options  # click.Command (config.options.SettingsCommand)
_.on_body  # httptools parser callback (supervision.wire, front.http_server)
_.on_message_complete  # httptools parser callback (supervision.wire, front.http_server)
_.on_message_begin  # httptools parser callback (front.http_server)
_.on_url  # httptools parser callback (front.http_server)
_.on_header  # httptools parser callback (supervision.wire, front.http_server)
_.on_headers_complete  # httptools parser callback (supervision.wire, front.http_server)
_.eof_received  # asyncio.Protocol (front.http_server: a half-close keeps its answers)
_.capture_signals  # uvicorn.Server (service.server: mtpwrap owns the signals)
_.collect  # prometheus_client custom collectors (front.metrics)
_.component  # cyclonedx BomMetaData: the SBOM's own component (bundle.sbom)

# --- the pynvml interface of decide.nvml_replay.RecordedNvml: decide.hardware calls each by
# name (`_query(nvml, err, "nvmlDeviceGetName", h)`), on pynvml or on a recording alike
_.nvmlSystemGetDriverVersion
_.nvmlSystemGetCudaDriverVersion
_.nvmlDeviceGetCount
_.nvmlDeviceGetHandleByIndex
_.nvmlDeviceGetName
_.nvmlDeviceGetUUID
_.nvmlDeviceGetMemoryInfo
_.nvmlDeviceGetCudaComputeCapability
_.nvmlDeviceGetPowerManagementLimit
_.nvmlDeviceGetPowerUsage
_.nvmlDeviceGetCurrPcieLinkGeneration
_.nvmlDeviceGetCurrPcieLinkWidth
_.nvmlDeviceGetTemperature
_.nvmlDeviceGetUtilizationRates
_.nvmlDeviceGetCurrentClocksEventReasons
_.initialized  # RecordedNvml's open-handle count: tests check every nvmlInit is shut down

# --- kept on purpose
_.cuda_library_dirs  # build.toolchain: benchmarks/gpu_check.sh calls it from `python -c`
_.RECIPE_LENGTHS  # bench.corpora, with fill_lengths: the integration test behind
_.fill_lengths  # docs/benchmarks.md's "every Korean domain fills 262K tokens"
_.crashed  # build.smoke's SmokeResult: tests/test_build.py reads which tries crashed
_.value_hint  # decide.capabilities: fields written to and read from the recorded JSON
_.built_with
_.help_sha256
