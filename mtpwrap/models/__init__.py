"""Getting model files: known models from the package index, pull from a hub, import on an
air-gapped site, inspect a GGUF, graft an MTP head. Above `decide` (it reads files and
downloads), below `build`."""
