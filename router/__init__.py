"""splitserve.router: the OpenAI-compatible gateway that picks a prefill and a decode worker per request."""
