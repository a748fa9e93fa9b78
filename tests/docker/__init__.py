"""Container tier: the compose stack on a private Docker engine."""
