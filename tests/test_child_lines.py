"""The level of a llama-server line, read from lines the pinned build and older ones print."""

from __future__ import annotations

import logging

from mtpwrap.supervision.child import line_level

INFO_LINES = [
    "0.00.036.626 I srv  llama_server: initializing ...",
    "0.00.048.437 I srv    load_model: loading model '/m/SmolLM2-135M-Instruct.Q4_1.gguf'",
    "0.09.593.483 I slot print_timing: id  1 | task 0 | prompt eval time =    1143.19 ms",
    "0.00.001.002 D srv  debug line",
    "llama_model_loader: - kv   0:                       general.architecture str = llama",
    "llama_model_loader: loaded meta data with 33 key-value pairs and 272 tensors",
    "print_info: n_ctx_train      = 8192",
]
WARNING_LINES = [
    "warning: no usable GPU found, --gpu-layers option will be ignored",
    "0.00.020.000 W srv  init: the slot context exceeds the training context",
]
ERROR_LINES = [
    "0.00.020.000 E srv  load_model: failed to load model",
    "llama_model_load: error loading model: tensor 'blk.0' data is not within the file bounds",
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 512.00 MiB on device 0: "
    "cudaMalloc failed: out of memory",
    "couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080",
]


def test_levels() -> None:
    assert [line_level(ln) for ln in INFO_LINES] == [logging.INFO] * len(INFO_LINES)
    assert [line_level(ln) for ln in WARNING_LINES] == [logging.WARNING] * len(WARNING_LINES)
    assert [line_level(ln) for ln in ERROR_LINES] == [logging.ERROR] * len(ERROR_LINES)
