"""splitserve.router: see the package README for its role."""
