"""``omni-trio serve``: an OpenAI-compatible streaming server for a pipeline.

Needs the ``serve`` extra (``pip install 'omni-trio[serve]'``): Hypercorn's Trio
worker, Starlette and prometheus-client. :func:`app_for_config` builds the ASGI app
for a pipeline config (:func:`create_app` for any orchestrator), and :func:`serve`
serves it; see ``docs/serving.md``.
"""

from typing import TYPE_CHECKING

from .._util import lazy_exports

if TYPE_CHECKING:  # what __getattr__ provides, spelled out for type checkers
    from ._app import OpenPipeline as OpenPipeline
    from ._app import ServedPipeline as ServedPipeline
    from ._app import app_for_config as app_for_config
    from ._app import create_app as create_app
    from ._model import FinalOutput as FinalOutput
    from ._model import ServedModel as ServedModel
    from ._model import SpeechRoute as SpeechRoute
    from ._protocol import OpenAIError as OpenAIError
    from ._realtime_options import RealtimeOptions as RealtimeOptions
    from ._server import serve as serve

_EXPORTS = {
    "._app": [
        "OpenPipeline",
        "ServedPipeline",
        "app_for_config",
        "create_app",
    ],
    "._model": ["FinalOutput", "ServedModel", "SpeechRoute"],
    "._protocol": ["OpenAIError"],
    "._realtime_options": ["RealtimeOptions"],
    "._server": ["serve"],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
# Imported on first use: the command line imports this package before it knows
# whether the serve extra is installed.
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
