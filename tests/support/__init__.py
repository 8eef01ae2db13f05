"""Helpers the tests share: servers, clusters, peers and models they start or build."""
