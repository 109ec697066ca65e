"""Built-in recipes: one TOML file per target architecture (see qwen3_6-gdn.toml)."""
