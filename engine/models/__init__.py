"""Model definitions (single-device readable) and their loaders."""
