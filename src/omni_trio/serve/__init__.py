"""``omni-trio serve``: an OpenAI-compatible streaming server for a pipeline.

Needs the ``serve`` extra (``pip install 'omni-trio[serve]'``): Hypercorn's Trio
worker and Starlette. See ``docs/serving.md``::

    app = app_for_config(load_pipeline("pipeline.toml"))
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(serve, app, port=0))
"""

from ._app import DEFAULT_MAX_WAITING, app_for_config, create_app
from ._model import FinalOutput, ServedModel
from ._protocol import OpenAIError
from ._server import DEFAULT_PORT, serve

__all__ = [
    "DEFAULT_MAX_WAITING",
    "DEFAULT_PORT",
    "FinalOutput",
    "OpenAIError",
    "ServedModel",
    "app_for_config",
    "create_app",
    "serve",
]
