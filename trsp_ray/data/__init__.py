"""What a run reads: models by name (a directory, a config.json, a hub id), the offline assets, the
text domains and their calibration stream, and perplexity windows."""
