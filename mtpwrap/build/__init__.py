"""Build: the llama.cpp source, the toolchain, the CMake build, its smoke test and calibration."""
