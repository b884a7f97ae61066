"""What the server needs to know of a pipeline: its name and its final outputs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import attrs

from .._util import final
from ._protocol import OpenAIError

if TYPE_CHECKING:
    from ..config import PipelineConfig

__all__ = ["FinalOutput", "ServedModel", "SpeechRoute"]

Modality = Literal["text", "audio", "transcript", "subtitles"]


@final
@attrs.frozen
class FinalOutput:
    """One user-facing stage as the API shows it.

    Attributes:
      stage_id: The stage.
      modality: ``"text"`` (its outputs are text deltas, ``str``), ``"audio"`` (its
          outputs are 16-bit mono little-endian PCM, ``bytes``), ``"transcript"``
          (a listening stage's: the user's words, ``str``; not part of an answer) or
          ``"subtitles"`` (WebVTT cues; not part of an answer either: the API has
          no place for them, so a served request's route passes them by).
      label: Its name in metrics and messages.
      sample_rate: Hz of an audio stage's PCM.
    """

    stage_id: int
    modality: Modality
    label: str = ""
    sample_rate: int = 24_000

    def __attrs_post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", f"stage{self.stage_id}")


def _as_tuple(outputs: Iterable[FinalOutput]) -> tuple[FinalOutput, ...]:
    return tuple(outputs)


@final
@attrs.frozen
class SpeechRoute:
    """Where ``/v1/audio/speech`` runs in a pipeline: a request that enters at
    ``entry`` (the talker: the stage that reads the text output) and ends at
    ``output`` (the audio), passing the stages before ``entry`` by.

    Attributes:
      entry: The stage a speech request enters at; its input is the text
          (:func:`omni_trio.speech.say`).
      output: The audio output it ends at.
    """

    entry: int
    output: FinalOutput

    @classmethod
    def of(cls, config: PipelineConfig, outputs: tuple[FinalOutput, ...]) -> SpeechRoute | None:
        """The route of a config whose audio output is spoken from its text output
        (``None`` if it has no such path): from the stage nearest the text, on the
        way to the audio, that reads it."""
        texts = {o.stage_id for o in outputs if o.modality == "text"}
        inputs = config.stage_inputs
        for output in (o for o in outputs if o.modality == "audio"):
            stage, seen = output.stage_id, set()
            while stage not in seen:
                seen.add(stage)
                sources = inputs[stage]
                if texts & set(sources):
                    return cls(stage, output)
                if len(sources) != 1:  # the start, or a join: no single path back
                    break
                (stage,) = sources
        return None


@final
@attrs.frozen
class ServedModel:
    """A pipeline as the OpenAI-compatible API shows it.

    Attributes:
      name: The ``model`` clients ask for (a config's ``[pipeline].name``).
      outputs: The pipeline's final stages, each with its modality.
      conversation: Whether a request's prompt is an utterance (the user's turn, the
          conversation before it and the request's sampling: a config's
          ``[pipeline] prompt = "conversation"``), rather than the last user
          message's text. A model that hears (see :attr:`hearing`) always takes
          one.
      speech: Where ``/v1/audio/speech`` runs (:class:`SpeechRoute`), or ``None``:
          the model does not speak text it is given.
    """

    name: str
    outputs: tuple[FinalOutput, ...] = attrs.field(converter=_as_tuple)
    conversation: bool = False
    speech: SpeechRoute | None = None

    def __attrs_post_init__(self) -> None:
        if not self.answers:
            raise ValueError("a served model needs at least one final text or audio output")

    @classmethod
    def from_config(cls, config: PipelineConfig) -> ServedModel:
        """The model a pipeline config describes: its name, and each final stage with
        its ``final_output_type`` and ``sample_rate``."""
        outputs = tuple(
            FinalOutput(s.stage_id, s.final_output_type, s.label, s.sample_rate)
            for s in config.stages
            if s.final_output
        )
        return cls(
            config.pipeline.name,
            outputs,
            config.prompt == "conversation",
            SpeechRoute.of(config, outputs),
        )

    @property
    def modalities(self) -> list[Modality]:
        """What an answer can hold: ``"text"``, ``"audio"`` (not the transcript of
        what the model heard)."""
        return sorted({o.modality for o in self.answers})

    @property
    def answers(self) -> tuple[FinalOutput, ...]:
        """The final outputs that make an answer: all but transcripts and subtitles."""
        return tuple(o for o in self.outputs if o.modality in ("text", "audio"))

    @property
    def takes_utterances(self) -> bool:
        """Whether a request's prompt is an utterance: the model hears, or its
        pipeline says so (:attr:`conversation`)."""
        return self.conversation or self.hearing is not None

    @property
    def hearing(self) -> FinalOutput | None:
        """The listening stage's output (a pipeline whose first stage listens has one:
        it takes audio in), or ``None``."""
        return next((o for o in self.outputs if o.modality == "transcript"), None)

    def select(self, modalities: Iterable[str] | None) -> tuple[FinalOutput, ...]:
        """The final outputs a request's ``modalities`` asks for (``None``: all).

        Raises:
          OpenAIError: 400, a modality that is unknown or that this model lacks.
        """
        if modalities is None:
            return self.answers
        wanted = list(modalities)
        if not wanted:
            raise OpenAIError(400, "modalities must not be empty", param="modalities")
        for modality in wanted:
            if modality not in ("text", "audio"):
                raise OpenAIError(
                    400,
                    f"unknown modality {modality!r}: the modalities are 'text' and 'audio'",
                    param="modalities",
                )
            if modality not in self.modalities:
                raise OpenAIError(
                    400,
                    f"model {self.name!r} has no {modality} output "
                    f"(it has: {', '.join(self.modalities)})",
                    param="modalities",
                )
        return tuple(o for o in self.answers if o.modality in wanted)
