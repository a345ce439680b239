"""The HTTP face: the aiohttp app (OpenAI endpoints, /v1/models, /health, /metrics), request
to prompt ids, and the response and SSE formats.

May import: pd.protocol, pd.worker.engine, pd.worker.build (the assembled worker). Never the
model or the transfer layer directly.
"""

from pd.worker.api.server import make_app

__all__ = ["make_app"]
