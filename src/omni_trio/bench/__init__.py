"""The benchmark suite: the Trio orchestrator against its asyncio twin, and the
process data plane against its floors.

``omni-trio bench`` runs every scenario once per implementation, each in its own
process (``python -m omni_trio.bench --impl NAME``), and prints the comparison; then
the process scenarios (``python -m omni_trio.bench._process --family NAME``), each
beside its floor measured in the same run.
"""
