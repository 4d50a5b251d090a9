"""Configuration: every setting declared once (`table`), one YAML reader (`yamlfile`), one
coercer (`coerce`), the loader of `up`'s settings (`settings`) and the objects built from them
(`objects`). Ground layer: imports nothing of the project above errors and paths."""
