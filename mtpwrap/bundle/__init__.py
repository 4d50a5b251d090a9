"""The offline bundle: what it carries (contents), its checks (check), making it outside
(create, sbom) and placing it inside (install). Above `bench`, `build` and `models`, whose
pinned files it carries."""
