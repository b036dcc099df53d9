"""Model families: where each family keeps its decoder layers and which config lists are per layer;
tiny random models of every family for tests and dry runs."""
