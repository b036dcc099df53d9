"""Every memory and compute plan, from config.json alone (no weights): shapes and activations, one
process, ZeRO-3, the probes, host and checkpoints, the fit, the route, and compute in dense-forward
tokens."""
