"""Stream the seed's worked example 1 through the orchestrator and print each output.

The talker (stage 1) reports completion 200 ms after the audio stage (stage 2) has
finished: the terminal message waits for it, and an output arriving after cleanup is
dropped and counted.

Run: python examples/seed_example1.py
"""

from __future__ import annotations

import trio

from omni_trio import open_orchestrator
from omni_trio.testing import ScriptedStage

NAMES = {0: "thinker", 1: "talker", 2: "code2wav"}


def prewarm(stage_id: int, prompt: str) -> str:
    return f"warm{stage_id}:{len(prompt)}"


async def play(thinker: ScriptedStage, talker: ScriptedStage, code2wav: ScriptedStage) -> None:
    """What the three stage engines report, 5 ms apart, in the seed's order."""
    steps = [
        (0.005, thinker, "hi", False),
        (0.005, thinker, "there", True),
        (0.005, code2wav, "wav:HI", False),
        (0.005, code2wav, "wav:THERE", True),
        (0.200, talker, None, True),  # the talker's IPC is a beat slower
        (0.005, code2wav, "wav:EXTRA", False),  # after cleanup: dropped
    ]
    for delay, stage, data, finished in steps:
        await trio.sleep(delay)
        await stage.emit("r1", data, finished)
    await trio.sleep(0.005)


async def main() -> None:
    stages = [ScriptedStage() for _ in NAMES]
    start = trio.current_time()
    async with open_orchestrator(stages, {0, 2}, prewarm_fn=prewarm) as orch:
        await orch.add_request("r1", "hi there")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(play, *stages)
            while True:  # until the terminal; play() goes on a little longer
                out = await orch.next_output()
                ms = (trio.current_time() - start) * 1000
                print(
                    f"{ms:6.1f} ms  {out.request_id} stage {out.stage_id} ({NAMES[out.stage_id]:8})"
                    f"  data={out.data!r:12} finished={out.finished}"
                    + (f"  [{out.finish_reason}]" if out.finished else "")
                )
                if out.finished:
                    break
        for sid, stage in enumerate(stages):
            print(f"stage {sid} ({NAMES[sid]}) was submitted {stage.submissions}")
        print(f"dropped outputs: {orch.dropped_outputs}")


if __name__ == "__main__":
    trio.run(main)
