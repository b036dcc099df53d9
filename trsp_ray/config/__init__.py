"""A run's configuration: the pipelines and benchmark rows by name (registry), the typed sections
(sections) and the validated tree loaded from YAML with overrides (run_config)."""
