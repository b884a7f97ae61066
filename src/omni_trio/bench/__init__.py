"""The benchmark suite: the Trio orchestrator against its asyncio twin, the process
data plane against its floors, and replica pools.

``omni-trio bench`` runs every scenario once per implementation, each in its own
process (``python -m omni_trio.bench --impl NAME``), and prints the comparison; then
the process scenarios (``python -m omni_trio.bench._process --family NAME``), each
beside its floor measured in the same run; then the replica pools (``python -m
omni_trio.bench._replicas --part NAME``): a bottleneck stage of device-time engines
at 1 to 8 replicas, and the speech demo with its talker and code2wav replicated.
``omni-trio bench --only voice`` (not part of a full run: it speaks at real-time
pace) times ``/v1/realtime`` serving the voice pipeline (``python -m
omni_trio.bench._voice --part NAME``): turn latency and barge-in. ``omni-trio bench
--only llm`` (not part of a full run either: minutes of a real model) weighs the
language model's engine (``python -m omni_trio.bench._llm --part NAME``): its tokens/s
through the orchestrator against llama.cpp called directly, and with four slots
against one; a cancelled request's slot and the next request's first token; the
worker's heartbeat while the model generates; and spoken turns on the assistant.
"""
